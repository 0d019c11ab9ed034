"""The DFlash2 drafter behind the engine's drafter interface (the one `spec.mtp.MTPDrafter` has).

Pairing with the engine's step (engine.py `_spec_step`): after every forward the engine hands `keep`
the hidden rows of the request's committed positions (a prefill chunk, or the definite token and the
accepted drafts of a verify). With the runner's `hidden_taps` set to this drafter's (`__init__` sets
it), those rows are the drafter's context features [m, taps * H], so they are exactly the context
the drafter still lacks. At the request's next step, `propose` appends them to the request's slot of
the preallocated `DraftContextStore` (all requests, prefill chunks included, one batched write) and,
for a request about to verify, drafts one block from its anchor: the step's first token, whose
position is where the context ends.

A request whose pending rows do not continue its slot's context (it was preempted, or its first rows
came after a prefix-cache hit) restarts the slot's context at its pending rows' first position: the
drafter then sees less context, which can only lower acceptance, never change the output. A request verifying
fewer drafts than the block holds takes the walk's first ones.

Drafts are the greedy walk by default ("greedy" draft_sample_method: q is one-hot in rejection
sampling). With "probabilistic" the walk samples at temperature 1 and each request's drafts carry
their proposal distribution q (the selector's softmax over its K candidates, scattered to the
vocabulary) as `DraftTokens.probs`, which rejection sampling uses as the draft distribution, so the
output distribution is exact either way. The walk's noise comes from this drafter's own generator
(seeded 0 at start-up): a seeded request's tokens may then depend on what else is drafting; the
greedy walk keeps the per-seed guarantee.
"""

from __future__ import annotations

import torch

from ...engine.runner import ModelRunner
from ..mtp import DraftItem, PendingRowsDrafter
from ..verify import DraftTokens
from .context_store import DraftContextStore, to_device
from .draft_graph import DraftGraphs
from .model import DFlash2DraftModel
from .selector import Selection
from .taps import hidden_taps


class DFlash2Drafter(PendingRowsDrafter):
    """Keeps each request's pending context rows and drafter context slot; proposes blocks with the drafter."""

    rows_name = "DFlash2 context"

    def __init__(self, runner: ModelRunner, drafter: DFlash2DraftModel, num_speculative_tokens: int,
                 sampled: bool = False, max_num_seqs: int | None = None, max_model_len: int | None = None,
                 static_view: bool = False):
        """max_num_seqs / max_model_len: the engine's, which size the context store (slots x rows per layer, as the
        cache plan budgets it). Without them (a runner driven directly) the runner's cache bounds both: no more
        requests than state slots, no request longer than the cache's pages. static_view: the store's reads are
        whole rings (one shape per batch size), what `capture_graphs` needs."""
        super().__init__()
        cfg = drafter.cfg
        if not 1 <= num_speculative_tokens <= cfg.num_drafts:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens}, but the DFlash2 drafter's blocks of "
                             f"{cfg.block_size} hold {cfg.num_drafts} drafts; use 1..{cfg.num_drafts}")
        text = runner.model.cfg.text
        cfg.check_target(text.num_hidden_layers, text.hidden_size, text.vocab_size)
        self.runner, self.drafter, self.k = runner, drafter, num_speculative_tokens
        self.text = runner.model.model.language_model
        runner.hidden_taps = hidden_taps(self.text, cfg)
        layout = runner.storage.layout
        self.store = DraftContextStore(cfg, max_num_seqs or layout.num_slots,
                                       max_model_len or layout.num_blocks * layout.block_size,
                                       drafter.fc.weight.device, drafter.fc.weight.dtype, static_view=static_view,
                                       num_kv_heads=drafter.num_kv_heads)
        # request -> (its slot in `store`, its num_preemptions), least recently drafted first
        self.caches: dict[str, tuple[int, int]] = {}
        self.sampled = sampled
        self.generator = torch.Generator(runner.model.device).manual_seed(0) if sampled else None
        self.graphs: DraftGraphs | None = None  # the block forward and walk per batch size (capture_graphs)

    def capture_graphs(self, batch_sizes: list[int], graphs: bool = True) -> DraftGraphs:
        """Replay the block forward and the greedy walk from CUDA graphs (draft_graph.py) for rounds of up to
        max(batch_sizes) drafting requests; graphs=False runs the captured code eagerly (CPU tests)."""
        if self.sampled:
            raise ValueError("the drafter graphs run the greedy walk; draft_sample_method='probabilistic' drafts "
                             "eagerly (leave dflash2_draft_graph off)")
        g = DraftGraphs(self.drafter, self.store, self.text.embed_tokens, self.runner.model.compute_logits,
                        batch_sizes)
        g.capture(graphs)
        self.graphs = g
        return g

    def drop(self, request_id: str) -> None:
        super().drop(request_id)
        entry = self.caches.pop(request_id, None)
        if entry is not None:
            self.store.release(entry[0])

    def _slot_for(self, request_id: str, start: int, num_preemptions: int, batch: set[str]) -> int:
        """The request's slot, its context kept if it ends at `start`, else emptied to start there. A new request
        takes a free slot, or the least recently drafted one outside this batch: a preempted request waiting to
        run again (or, rarely, a running one this step skipped) then restarts its context, which costs it
        acceptance, never output."""
        slot, preemptions = self.caches.pop(request_id, (None, -1))
        if slot is None:
            slot = self.store.acquire(start)
            if slot is None:
                slot = self.caches.pop(self._victim(batch))[0]
                self.store.reset(slot, start)
        elif preemptions != num_preemptions or self.store.host_end[slot] != start:
            self.store.reset(slot, start)
        self.caches[request_id] = (slot, num_preemptions)  # re-inserted: the most recently drafted last
        return slot

    def _victim(self, batch: set[str]) -> str:
        for request_id in self.caches:
            if request_id not in batch:
                return request_id
        raise ValueError(f"{len(batch)} requests draft in one step but the DFlash2 context store has "
                         f"{self.store.num_slots} slots; build the drafter with the engine's max_num_seqs")

    @torch.no_grad()
    def propose(self, items: list[DraftItem]) -> list[list[int]]:
        """Extend every item's drafter context with its pending rows and draft `num_drafts` tokens for each.

        Returns one list of draft token ids per item (empty where num_drafts is 0).
        """
        drafts: list[list[int]] = [[] for _ in items]
        batch = {it.request_id for it in items}
        rows, want = [], []
        for i, it in enumerate(items):
            p = self.take(it)  # the rows [m, taps * H] `keep` got
            if p is None:
                continue
            if it.num_drafts > self.k:
                raise ValueError(f"request {it.request_id!r} was scheduled with {it.num_drafts} drafts; this "
                                 f"drafter proposes at most {self.k}")
            slot = self._slot_for(it.request_id, p.start, it.num_preemptions, batch)
            rows.append((slot, p.hidden))
            if it.num_drafts:
                want.append((i, slot))
        self.drafter.extend_slots(self.store, rows)
        if not want:
            return drafts
        anchors = to_device([items[i].all_token_ids[items[i].step.num_computed] for i, _ in want],
                            self.runner.model.device)
        slots = [slot for _, slot in want]
        if self.graphs is not None and self.graphs.can_run(len(want)):
            tokens, probs = self.graphs.run(slots, anchors), None
        else:
            sel = self._draft(slots, anchors)
            tokens, probs = sel.tokens, None if sel.q is None else self._dense_q(sel)  # [B, D, V]
        for b, ((i, _), row) in enumerate(zip(want, tokens.tolist())):  # the round's one host sync
            n = items[i].num_drafts
            drafts[i] = DraftTokens(row[:n], None if probs is None else probs[b, :n])
        return drafts

    def _draft(self, slots: list[int], anchors: torch.Tensor) -> Selection:
        """The selector's walk (tokens [B, num_drafts], q when sampled) from slots that already hold each
        request's whole context."""
        hidden = self.drafter.block_hidden_slots(self.drafter.block_embeds(anchors, self.text.embed_tokens),
                                                 self.store, slots)
        return self.drafter.select(hidden, anchors, self.runner.model.compute_logits,
                                   temperature=1.0 if self.sampled else 0.0, generator=self.generator)

    def _dense_q(self, sel: Selection) -> torch.Tensor:
        """q [B, D, K] over candidates [B, D, K] -> [B, D, V] (zero off the candidates)."""
        vocab = self.runner.model.cfg.text.vocab_size
        q = sel.q.new_zeros(*sel.q.shape[:2], vocab)
        return q.scatter_(-1, sel.candidates, sel.q)

"""The DFlash2 drafter behind the engine's drafter interface (the one `spec.mtp.MTPDrafter` has).

Pairing with the engine's step (engine.py `_spec_step`): after every forward the engine hands `keep`
the hidden rows of the request's committed positions (a prefill chunk, or the definite token and the
accepted drafts of a verify). With the runner's `hidden_taps` set to this drafter's (`__init__` sets
it), those rows are the drafter's context features [m, taps * H], so they are exactly the context
the drafter still lacks. At the request's next step, `propose` appends them to the request's
`DraftKVCache` (all requests, prefill chunks included) and, for a request about to verify, drafts
one block from its anchor: the step's first token, whose position is where the context ends.

A request whose pending rows do not continue its cache (it was preempted, or its first rows came
after a prefix-cache hit) starts a new cache at its pending rows' first position: the drafter then
sees less context, which can only lower acceptance, never change the output. A request verifying
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
from .model import DFlash2DraftModel, DraftKVCache
from .taps import hidden_taps


class DFlash2Drafter(PendingRowsDrafter):
    """Keeps each request's pending context rows and drafter cache; proposes blocks with the drafter."""

    rows_name = "DFlash2 context"

    def __init__(self, runner: ModelRunner, drafter: DFlash2DraftModel, num_speculative_tokens: int,
                 sampled: bool = False):
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
        self.caches: dict[str, tuple[DraftKVCache, int]] = {}  # request -> (cache, its num_preemptions)
        self.sampled = sampled
        self.generator = torch.Generator(runner.model.device).manual_seed(0) if sampled else None

    def drop(self, request_id: str) -> None:
        super().drop(request_id)
        self.caches.pop(request_id, None)

    def _cache_for(self, request_id: str, start: int, num_preemptions: int) -> DraftKVCache:
        """The request's cache if it ends at `start`, else a new one starting there."""
        cache, preemptions = self.caches.get(request_id, (None, -1))
        if cache is None or preemptions != num_preemptions or cache.end != start:
            cache = DraftKVCache(start=start)
            self.caches[request_id] = (cache, num_preemptions)
        return cache

    @torch.no_grad()
    def propose(self, items: list[DraftItem]) -> list[list[int]]:
        """Extend every item's drafter cache with its pending rows and draft `num_drafts` tokens for each.

        Returns one list of draft token ids per item (empty where num_drafts is 0).
        """
        drafts: list[list[int]] = [[] for _ in items]
        want, caches = [], []
        for i, it in enumerate(items):
            p = self.take(it)  # the rows [m, taps * H] `keep` got
            if p is None:
                continue
            cache = self._cache_for(it.request_id, p.start, it.num_preemptions)
            self.drafter.extend_context(cache, p.hidden)
            if it.num_drafts:
                if it.num_drafts > self.k:
                    raise ValueError(f"request {it.request_id!r} was scheduled with {it.num_drafts} drafts; this "
                                     f"drafter proposes at most {self.k}")
                want.append(i)
                caches.append(cache)
        if not want:
            return drafts
        device = self.runner.model.device
        anchors = torch.tensor([items[i].all_token_ids[items[i].step.num_computed] for i in want], device=device)
        sel = self._draft(caches, anchors)
        probs = None if sel.q is None else self._dense_q(sel)  # [B, D, V]
        for b, (i, row) in enumerate(zip(want, sel.tokens.tolist())):
            n = items[i].num_drafts
            drafts[i] = DraftTokens(row[:n], None if probs is None else probs[b, :n])
        return drafts

    def _draft(self, caches: list[DraftKVCache], anchors: torch.Tensor):
        """The selector's walk (tokens [B, num_drafts], q when sampled) from caches that already hold
        each request's whole context."""
        empty = [anchors.new_zeros(0, self.drafter.fc.in_features, dtype=self.drafter.fc.weight.dtype)] * len(caches)
        return self.drafter(empty, caches, anchors, self.text.embed_tokens, self.runner.model.compute_logits,
                            temperature=1.0 if self.sampled else 0.0, generator=self.generator)

    def _dense_q(self, sel) -> torch.Tensor:
        """q [B, D, K] over candidates [B, D, K] -> [B, D, V] (zero off the candidates)."""
        vocab = self.runner.model.cfg.text.vocab_size
        q = sel.q.new_zeros(*sel.q.shape[:2], vocab)
        return q.scatter_(-1, sel.candidates, sel.q)

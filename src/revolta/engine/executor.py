"""The executor seam: the engine hands one packed step to an `Executor` and gets logits (and drafts) back.

The engine (engine.py) schedules, samples and applies stop rules; everything that touches the model
and the device cache sits behind this interface:

    execute(step)  cache copies (swap-ins, prefix-hit restores, fresh-slot resets), the vision tower
                   for the step's media, the drafter's proposals, the forward (eager, or a CUDA graph
                   replay), -> StepResult: the logits rows of the requests whose next token is due,
                   their drafts, and prompt-logprob rows.
    finish(...)    after sampling: commit the verified recurrent state for the accepted drafts, keep
                   the drafter's rows, take the snapshots, forget finished requests.
    can_draft / drop   the drafter's per-request state (rank 0 answers from its own copy).

`UniProcExecutor` is the single-process path: runner, cache storage, decode graphs, drafter and
speculative graphs all live in it. A multi-process executor (tensor parallelism, one worker per rank)
implements the same three calls: what crosses the process boundary per step is a `ModelStep` (per
request a `StepSequence`, which `ModelRunner.pack_step` packs into one int64 buffer, plus its cache
`Allocation` and a few ints), rank 0's worker lives in the engine's process and returns the logits
there, and `finish` broadcasts the accepted counts. CUDA-graph replay and speculative rounds are
worker-side, so nothing of them reaches the engine.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from ..cache.capacity import CachePlan
from ..cache.hybrid import Allocation, SwapOuts
from ..cache.storage import CacheStorage, kv_scales_from_state_dict
from ..forward import PagedMeta
from ..model import FlashNextModel
from ..multimodal.encoder_cache import EncoderCache
from ..multimodal.processor import MediaItem, MultimodalPrompt
from ..parallel.context import ParallelContext
from ..spec.commit import check_replay_slots, commit_verified
from ..spec.config import SpeculativeConfig
from ..spec.dflash2.checkpoint import load_draft_model
from ..spec.dflash2.drafter import DFlash2Drafter
from ..spec.dflash2.rank_drafter import load_rank_drafter
from ..spec.graphs import SpecGraphs
from ..spec.measured import slower_warning
from ..spec.mtp import DraftItem, MTPDrafter
from .cuda_graphs import DecodeGraphs, default_capture_sizes, graph_warning
from .runner import ModelRunner, StepSequence
from .sleep import SleepingMemory, check_reloadable, reload_weights, weight_tensors

logger = logging.getLogger(__name__)


@dataclass
class StepItem:
    """One scheduled request's share of a step, as the executor sees it.

    seq: its new tokens, pages and state slot (token_ids, num_computed, block_ids, slot; rope positions
    and media rows are attached by the executor from `mm`). alloc: the cache copies its step needs.
    sample: its next token is due (all known tokens computed after this step), so its logits row is
    returned. prompt_logits: every row of its chunk is projected and returned (prompt logprobs).
    verify: a decoding request verifying `num_drafts` drafts (speculation); all_token_ids and
    num_preemptions are what the drafter reads.
    """

    request_id: str
    seq: StepSequence
    alloc: Allocation
    mm: MultimodalPrompt | None = None
    sample: bool = False
    prompt_logits: bool = False
    verify: bool = False
    num_drafts: int = 0
    all_token_ids: Sequence[int] = field(default_factory=list)  # prompt + output (scheduler's TokenView)
    num_preemptions: int = 0


@dataclass
class ModelStep:
    """One engine step for the executor: its requests, the swap-outs before them, the media to encode."""

    items: list[StepItem]
    swap_outs: SwapOuts | None = None
    encode: list[MediaItem] = field(default_factory=list)
    # [B] int64 on the device: each item's one new token, in place of the placeholder in its token_ids (async
    # scheduling: the previous step's samples, which the host has not read yet; only where `runs_async`)
    input_ids: Tensor | None = None


@dataclass
class StepResult:
    """logits: rows of the items with `sample`, in item order (one each; 1 + its drafts for a verify item).
    drafts: per sampled item its drafts (empty without speculation). prompt_logits: item index -> every
    row of its chunk [n, V] (row j predicts token num_computed + j + 1)."""

    logits: Tensor
    drafts: list[list[int]]
    prompt_logits: dict[int, Tensor] = field(default_factory=dict)


def forwarded(holder: str, name: str) -> property:
    """A read-only property returning `self.<holder>.<name>`: how the engine exposes its executor's pieces and
    the multi-process executor its rank-0 executor's (runner, storage, drafter, graphs, ...)."""
    return property(lambda self: getattr(getattr(self, holder), name), doc=f"self.{holder}.{name}")


class Executor(ABC):
    """Runs the model for the engine; see the module docstring."""

    @abstractmethod
    def execute(self, step: ModelStep) -> StepResult: ...

    @abstractmethod
    def finish(self, step: ModelStep, accepted: list[int], finished: list[bool]) -> None:
        """After sampling: per item the drafts it kept (`accepted`) and whether its request finished."""

    def runs_async(self, step: ModelStep) -> bool:
        """Whether `step` may run before the host has read the previous step's tokens, taking them from
        `step.input_ids` (async scheduling, async_step.py). This default says no: an executor that cannot take its
        input ids on the device (the multi-process one) keeps it."""
        return False

    @abstractmethod
    def can_draft(self, request_id: str, num_computed: int, num_preemptions: int) -> bool:
        """Whether the request has the drafter rows to draft from at num_computed."""

    @abstractmethod
    def drop(self, request_id: str) -> None:
        """Forget a request (aborted or finished)."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise a FatalEngineError when a process the forward needs (a PLE worker, a rank) has died."""

    def stats(self) -> dict[str, int]:
        """Counters for logs and tests (graph replays, ...)."""
        return {}

    def close(self) -> None:
        """Stop the processes this executor started (TP ranks, PLE workers), bounded."""

    def plan_sleep(self, level: int) -> SleepingMemory:
        """What sleep(level) would free and copy to host memory (sleep.py); nothing changes yet."""
        raise ValueError("sleep levels 1 and 2 run in one process only; at tensor_parallel_size > 1 the ranks' "
                         "memory is theirs (not supported yet): use level 0 or tensor_parallel_size=1")

    def sleep(self, memory: SleepingMemory) -> None:
        """Free what `memory` (from plan_sleep) lists: weights to host, KV cache and CUDA graphs dropped."""
        raise NotImplementedError

    def wake_up(self) -> None:
        """Take the memory back: weights, a zeroed KV cache, CUDA graphs captured again."""
        raise NotImplementedError


class UniProcExecutor(Executor):
    """The model, its cache tensors, CUDA graphs and drafter in this process."""

    def __init__(self, model: FlashNextModel, plan: CachePlan, spec: SpeculativeConfig, config,
                 encoder_cache: EncoderCache | None = None, media_ctx: ParallelContext | None = None):
        self.model, self.plan, self.spec, self.config = model, plan, spec, config
        self.encoder_cache = encoder_cache
        # at tp > 1: rank 0 encodes media (its cache), the step's vision rows go to the other ranks (`_share_media`)
        self.media_ctx = media_ctx
        kv_scales = kv_scales_from_state_dict(model.kv_scales)
        self.storage = CacheStorage(model.cfg, plan.layout, device=model.device, kv_scales=kv_scales)
        cpu_layout = plan.cpu_layout()
        self.cpu_storage = None if cpu_layout is None else CacheStorage(model.cfg, cpu_layout, "cpu", pin_memory=True)
        self.runner = ModelRunner(model, self.storage, kernels=config.kernels,
                                  max_num_tokens=config.max_num_batched_tokens
                                  + config.max_num_seqs * (1 + spec.num_speculative_tokens))
        self.drafter = self._make_drafter()
        self.graphs: DecodeGraphs | None = None  # decode steps replay these when they fit
        self.spec_graphs: SpecGraphs | None = None  # with speculation: steady-state rounds replay these
        self._round: _Round | None = None  # the speculative step between execute and finish
        self._asleep: SleepingMemory | None = None  # what a sleep freed, until wake_up
        self._capture_all()

    def _capture_all(self) -> None:
        """The CUDA graphs this configuration replays (at start, and again on wake_up: sleep drops them)."""
        model, spec, config = self.model, self.spec, self.config
        if model.device.type == "cuda" and config.use_cuda_graphs:
            if spec.enabled:  # every decoding step is a verify round, unless the adaptive policy paused drafting
                # the round graphs run the MTP drafter (spec/graphs.py); DFlash2's verify and commit graphs unless
                # dflash2_graph_rounds is off, its drafter in graphs of its own (below)
                if round_graphs(spec.method, config.dflash2_graphs("dflash2_graph_rounds")):
                    self.spec_graphs = self._capture_graphs(spec=True)
                if self._draft_graphs_on():  # DFlash2's block forward and walk (spec/dflash2/draft_graph.py)
                    g = self.drafter.capture_graphs(self._capture_sizes())
                    logger.info("CUDA graphs: captured the DFlash2 drafter's block forward and walk, batch sizes %s "
                                "in %.0f MiB", g.batch_sizes, g.used_bytes / 2**20)
                if spec.method == "mtp" and spec.draft_policy == "adaptive":  # paused steps replay decode graphs
                    self.graphs = self._capture_graphs(hidden=True)
                # as long as a benchmark row (spec/measured_speedup.json) says speculation is slower
                warning = slower_warning(spec.method)
                if warning:
                    logger.warning(warning)
            else:
                self.graphs = self._capture_graphs()

    def _make_drafter(self) -> MTPDrafter | DFlash2Drafter | None:
        """The configured drafter: the checkpoint's MTP head, or a DFlash2 drafter loaded from
        speculative_config["model"] in the target's dtype on its device (its config was checked
        against the target before anything was allocated). At tp > 1 each rank holds its part of the
        drafter's layers, and its rows of the selector codebooks when sharded_selector_codebook is on."""
        if not self.spec.enabled:
            return None
        if not self.spec.is_dflash2:
            return MTPDrafter(self.runner, self.spec.num_speculative_tokens)
        model, ctx = self.model, self.media_ctx  # at tp > 1 media_ctx is the rank's TP group: the drafter is split too
        if ctx is None:
            draft = load_draft_model(self.spec.model, dtype=model.dtype, device=model.device)
        else:
            draft = load_rank_drafter(self.spec.model, ctx, dtype=model.dtype, device=model.device,
                                      shard_codebooks=bool(self.spec.sm70_dflash2.sharded_selector_codebook))
        return DFlash2Drafter(self.runner, draft, self.spec.num_speculative_tokens,
                              sampled=self.spec.draft_sample_method == "probabilistic",
                              max_num_seqs=self.config.max_num_seqs, max_model_len=self.config.max_model_len,
                              static_view=self._draft_graphs_on())

    def _draft_graphs_on(self) -> bool:
        """DFlash2's drafter forward replays CUDA graphs: dflash2_draft_graph not off, graphs on, greedy walk."""
        return (self.spec.is_dflash2 and self.config.dflash2_graphs("dflash2_draft_graph")
                and self.model.device.type == "cuda"
                and self.config.use_cuda_graphs and self.spec.draft_sample_method == "greedy")

    def _capture_sizes(self) -> list[int]:
        cfg = self.config
        sizes = list(cfg.cudagraph_capture_sizes or default_capture_sizes(cfg.max_num_seqs))
        if max(sizes) > cfg.max_num_seqs:
            raise ValueError(f"cudagraph_capture_sizes={sizes} has sizes above max_num_seqs={cfg.max_num_seqs}; "
                             "drop them or raise max_num_seqs")
        return sizes

    def _capture_graphs(self, spec: bool = False, hidden: bool = False) -> DecodeGraphs | SpecGraphs:
        cfg = self.config
        sizes = self._capture_sizes()
        width = -(-(cfg.max_model_len + self.plan.cache.num_speculative_tokens) // self.plan.layout.block_size)
        if spec:
            mtp = self.spec.method == "mtp"
            graphs = SpecGraphs(self.runner, sizes, self.spec.num_speculative_tokens, self.spec.spec_state_replay,
                                width, draft_graph=mtp)
            what = (f"speculative round ({'MTP draft steps, ' if mtp else ''}verify of 1 + "
                    f"{self.spec.num_speculative_tokens} rows, commit)")
        else:
            graphs = DecodeGraphs(self.runner, sizes, width, return_hidden=hidden)
            what = "decode (with hidden rows, for steps while drafting is paused)" if hidden else "decode"
        graphs.capture()
        logger.info("CUDA graphs: captured %s batch sizes %s in %.0f MiB", what, sizes, graphs.used_bytes / 2**20)
        if cfg.kv_cache_gib is None:  # the reserve was part of the memory budget
            warning = graph_warning(graphs.used_bytes, int(cfg.resolved_cudagraph_mem_mib() * 2**20))
            if warning:
                logger.warning(warning)
        return graphs

    # ---- sleep (sleep.py) --------------------------------------------------------------------------
    def plan_sleep(self, level: int) -> SleepingMemory:
        if level == 2:
            check_reloadable(self.model)
        draft = getattr(self.drafter, "drafter", None)  # DFlash2's own model (MTP shares the target's weights)
        weights = weight_tensors(self.model, [draft] if isinstance(draft, torch.nn.Module) else [])
        store = getattr(self.drafter, "store", None)  # DFlash2's context K/V: empty once every request is gone
        contexts = [] if store is None else store.tensors()
        return SleepingMemory(level, weights, self.storage.block_tensors() + self.storage.slot_tensors() + contexts,
                              self.model.device)

    def sleep(self, memory: SleepingMemory) -> None:
        self.graphs = self.spec_graphs = None  # their memory pools go with them; the addresses they baked in too
        if isinstance(self.drafter, DFlash2Drafter):
            self.drafter.graphs = None  # they read the store's K/V, whose storage the sleep frees
        memory.free()
        self._asleep = memory

    def wake_up(self) -> None:
        memory = self._asleep
        if memory is None:
            return
        memory.restore(lambda: reload_weights(self.model))
        for p in self.storage.ple.values():  # a fresh n-gram context is EOS, not 0 (storage.reset_slots)
            p.context_ids.fill_(self.storage.eos)
        self._asleep = None
        self._capture_all()

    # ---- requests --------------------------------------------------------------------------------
    def can_draft(self, request_id: str, num_computed: int, num_preemptions: int) -> bool:
        return self.drafter is not None and self.drafter.has_pending(request_id, num_computed, num_preemptions)

    def drop(self, request_id: str) -> None:
        if self.drafter is not None:
            self.drafter.drop(request_id)

    def check_health(self) -> None:
        self.runner.check_health()

    def close(self) -> None:
        """End the PLE worker process the runner started for a disk-placed table, if any (bounded)."""
        if self.runner.ple_feeder is not None:
            self.runner.ple_feeder.close()

    def stats(self) -> dict[str, int]:
        return {"graph_replays": sum(g.num_replays for g in (self.graphs, self.spec_graphs) if g is not None)}

    # ---- one step --------------------------------------------------------------------------------
    def runs_async(self, step: ModelStep) -> bool:
        """A text-only decode step (one token per request, each sampled) without speculation or prompt logprobs,
        and no disk-placed PLE table (its worker reads the step's token ids on the host)."""
        return (not self.spec.enabled and self.runner.ple_feeder is None and not step.encode
                and all(it.sample and not it.prompt_logits and it.mm is None and len(it.seq.token_ids) == 1
                        for it in step.items))

    def execute(self, step: ModelStep) -> StepResult:
        if step.input_ids is not None and not self.runs_async(step):
            raise ValueError("input_ids on the device are for text-only decode steps without speculation "
                             "(Executor.runs_async)")
        self._encode(step.encode)
        items = step.items
        self.storage.pre_forward([it.alloc for it in items], step.swap_outs, self.cpu_storage)
        seqs = [self._attach_media(it) for it in items]
        if self.media_ctx is not None:
            self._share_media(seqs)
        if self.spec.enabled:
            return self._execute_spec(step, seqs)
        prompt_logits: dict[int, Tensor] = {}
        if any(it.prompt_logits for it in items):
            logits = self._execute_with_prompt_logits(items, seqs, prompt_logits)
        elif self.graphs is not None and self.graphs.can_run(seqs):
            logits = self.graphs.run(seqs, step.input_ids)  # [B, V]
        else:
            logits = self.runner.execute(seqs, input_ids=step.input_ids)  # [B, V]
        self.storage.post_forward([it.alloc for it in items])
        ready = [i for i, it in enumerate(items) if it.sample]
        if len(ready) < len(items):
            logits = logits[torch.tensor(ready, dtype=torch.long, device=logits.device)]
        return StepResult(logits, [[] for _ in ready], prompt_logits)

    def finish(self, step: ModelStep, accepted: list[int], finished: list[bool]) -> None:
        if not self.spec.enabled:
            return
        r, self._round = self._round, None
        items = step.items
        ver = [i for i, it in enumerate(items) if it.verify]
        if ver:
            vitems, vaccepted = [items[i] for i in ver], [accepted[i] for i in ver]
            if r.graphed:
                self.spec_graphs.commit([it.alloc.state_slot for it in vitems], self._keep_slots(vitems, vaccepted),
                                        [a + 1 for a in vaccepted])
            else:
                input_ids = torch.tensor([t for i in ver for t in r.seqs[i].token_ids + r.drafts[i]],
                                         device=r.paged.slots.device)
                self._commit_verified(r.paged, input_ids, vitems, vaccepted)
            self.storage.post_forward([it.alloc for it in vitems])
        for i, it in enumerate(items):
            if finished[i]:
                self.drafter.drop(it.request_id)
            else:
                keep = len(it.seq.token_ids) + accepted[i]
                self.drafter.keep(it.request_id, r.rows[i][1][:keep], it.seq.num_computed, it.num_preemptions,
                                  it.seq.mm_embeds, it.seq.mm_index)

    def _execute_with_prompt_logits(self, items: list[StepItem], seqs: list[StepSequence],
                                    prompt_logits: dict[int, Tensor],
                                    return_hidden: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """The forward projecting every row of the flagged chunks, not only the last rows -> [B, V]
        (and the wide hidden states [T, h*d] with return_hidden); the flagged rows go to prompt_logits."""
        rows, last = [], []
        start = 0
        for s, it in zip(seqs, items):
            n = len(s.token_ids)
            rows.extend(range(start, start + n) if it.prompt_logits else [start + n - 1])
            last.append(len(rows) - 1)
            start += n
        out = self.runner.execute(seqs, logits_rows=rows, return_hidden=return_hidden)  # [len(rows), V]
        logits, wide = out if return_hidden else (out, None)
        offset = 0
        for i, (s, it) in enumerate(zip(seqs, items)):
            n = len(s.token_ids) if it.prompt_logits else 1
            if it.prompt_logits:
                prompt_logits[i] = logits[offset:offset + n]
            offset += n
        last_logits = logits[torch.tensor(last, device=logits.device)]
        return (last_logits, wide) if return_hidden else last_logits

    # ---- media -----------------------------------------------------------------------------------
    def _encode(self, items: list[MediaItem]) -> None:
        """Run the vision tower once over every item scheduled for encoding this step; store the outputs."""
        if not items or self.encoder_cache is None:  # a TP worker: rank 0 encodes and sends the rows
            return
        visual = self.model.model.visual
        vcfg = self.model.cfg.vision
        pixels = torch.cat([m.pixel_values(vcfg) for m in items]).to(self.model.device)  # [sum t*h*w, patch_dim]
        embeds = visual(pixels.to(self.model.dtype), [m.grid for m in items])  # [sum tokens, d]
        for m, e in zip(items, embeds.split([m.num_tokens for m in items])):
            self.encoder_cache.put(m.content_hash, e)

    def _attach_media(self, it: StepItem) -> StepSequence:
        """mRoPE positions of the prompt, and the encoder rows (with their places) of the chunk's pad tokens."""
        step, mm = it.seq, it.mm
        if mm is None:
            return step
        step.positions, step.rope_delta = mm.positions, mm.rope_delta
        start, end = step.num_computed, step.num_computed + len(step.token_ids)
        rows, places = [], []
        for item in mm.items_in(start, end):
            embeds = None if self.encoder_cache is None else self.encoder_cache.get(item.content_hash)
            for row, offset, count in item.rows_in(start, end):  # a TP worker: room for rank 0's rows
                rows.append(self._no_rows(count) if embeds is None else embeds[row:row + count])
                places.extend(range(offset - start, offset - start + count))
        if rows:
            step.mm_embeds = torch.cat(rows)
            step.mm_index = places
        return step

    def _no_rows(self, count: int) -> Tensor:
        return torch.zeros(count, self.model.cfg.text.hidden_size, dtype=self.model.dtype, device=self.model.device)

    def _share_media(self, seqs: list[StepSequence]) -> None:
        """Rank 0's vision rows of this step, on every rank: one broadcast of them all (each rank knows their
        count from the step's media places)."""
        with_mm = [s for s in seqs if s.mm_embeds is not None]
        if with_mm:
            rows = self.media_ctx.broadcast(torch.cat([s.mm_embeds for s in with_mm]), src=0)
            for s, part in zip(with_mm, rows.split([s.mm_embeds.shape[0] for s in with_mm])):
                s.mm_embeds = part

    # ---- speculative decoding (spec/): drafts, one verify forward, commit after sampling ----------
    def _execute_spec(self, step: ModelStep, steps: list[StepSequence]) -> StepResult:
        """Drafter seeds and drafts; the prefill chunks run as usual and the decoding requests run one verify
        forward over their definite token and drafts (a graph replay when the round fits one)."""
        items = step.items
        paused = not any(it.verify for it in items)  # the adaptive policy paused drafting (or a prefill-only step)
        draft_items = [DraftItem(it.request_id, st, it.all_token_ids, it.num_preemptions,
                                 it.num_drafts if it.verify else 0,
                                 defer_seed=paused and it.sample and len(st.token_ids) == 1 and st.num_computed > 0)
                       for it, st in zip(items, steps)]
        graphed = (self.spec_graphs is not None and all(it.verify for it in items)
                   and self.spec_graphs.can_run(steps, [d.num_drafts for d in draft_items]))
        if graphed and self.spec_graphs.draft_graph:  # MTP: the seed and draft steps replay the draft graph
            drafts = self.drafter.propose(draft_items, self.spec_graphs)
        else:
            drafts = self.drafter.propose(draft_items)
        pre = [i for i, it in enumerate(items) if not it.verify]
        ver = [i for i, it in enumerate(items) if it.verify]
        rows: dict[int, tuple[Tensor, Tensor]] = {}  # item -> (logits rows, wide rows)
        prompt_logits: dict[int, Tensor] = {}
        if pre:
            pre_items, pre_steps = [items[i] for i in pre], [steps[i] for i in pre]
            if any(it.prompt_logits for it in pre_items):
                flagged: dict[int, Tensor] = {}
                logits, wide = self._execute_with_prompt_logits(pre_items, pre_steps, flagged, return_hidden=True)
                prompt_logits = {pre[j]: x for j, x in flagged.items()}
            elif not ver and self.graphs is not None and self.graphs.can_run(pre_steps):  # drafting paused
                logits, wide = self.graphs.run(pre_steps)  # [b, V], [b, h*d]
            else:
                logits, wide = self.runner.execute(pre_steps, return_hidden=True)
            self.storage.post_forward([it.alloc for it in pre_items])
            offset = 0
            for j, i in enumerate(pre):
                n = len(steps[i].token_ids)
                rows[i] = (logits[j:j + 1], wide[offset:offset + n])
                offset += n
        paged = None
        if graphed:  # spec/graphs.py: replay the verify graph; the drafts reach the host here
            num_drafts = [d.num_drafts for d in draft_items]
            logits, wide, verified = self.spec_graphs.verify(steps, drafts, num_drafts, self._slot_rows(items))
            if isinstance(drafts, Tensor):  # drafted on the device: they reach the host here
                drafts = verified  # host drafts (DFlash2's DraftTokens, with their q) stay what the drafter proposed
            R = self.spec_graphs.rows
            for i, n in enumerate(num_drafts):
                rows[i] = (logits[i * R:i * R + n + 1], wide[i * R:i * R + n + 1])
        elif ver:
            vsteps = [replace(steps[i], token_ids=steps[i].token_ids + drafts[i]) for i in ver]
            logits, wide, paged = self.runner.verify(vsteps, self._slot_rows([items[i] for i in ver]))
            cu = paged.cu_seqlens.tolist()
            for j, i in enumerate(ver):
                rows[i] = (logits[cu[j]:cu[j + 1]], wide[cu[j]:cu[j + 1]])
        self._round = _Round(graphed, steps, drafts, rows, paged)
        # sample: the final prefill chunks' last rows, every verify row
        ready = [i for i, it in enumerate(items) if it.sample]
        logits = torch.cat([rows[i][0] for i in ready]) if ready else torch.empty(0)
        return StepResult(logits, [drafts[i] for i in ready], prompt_logits)

    def _commit_verified(self, paged: PagedMeta, input_ids: Tensor, items: list[StepItem],
                         accepted: list[int]) -> None:
        """Recurrent state of the verified requests: the state after the definite token and the
        accepted drafts goes to the slot the allocator keeps as running (spec/commit.py)."""
        device = paged.slots.device
        keep = self._keep_slots(items, accepted)
        check_replay_slots([it.alloc.state_slot for it in items], keep, paged.spec.draft_slots is None)
        commit_verified(self.storage, self.runner.ops, paged.spec, paged.cu_seqlens, input_ids,
                        paged.slots, torch.tensor(keep, dtype=torch.int32, device=device),
                        torch.tensor([a + 1 for a in accepted], dtype=torch.int32, device=device))

    def _slot_rows(self, items: list[StepItem]) -> list[list[int]] | None:
        """Per verified request its running slot then its per-draft slots (None with replay)."""
        return None if self.spec.spec_state_replay else [[it.alloc.state_slot, *it.alloc.draft_slots] for it in items]

    @staticmethod
    def _keep_slots(items: list[StepItem], accepted: list[int]) -> list[int]:
        """The slot holding each request's committed state after `accepted` drafts."""
        return [it.alloc.draft_slots[a - 1] if a and it.alloc.draft_slots else it.alloc.state_slot
                for it, a in zip(items, accepted)]


def round_graphs(method: str | None, dflash2_graph_rounds: bool) -> bool:
    """Whether speculative rounds replay CUDA graphs (on CUDA with graphs on): MTP's always (draft, verify and
    commit graphs); DFlash2's verify and commit graphs when `dflash2_graph_rounds` (EngineConfig.dflash2_graphs)."""
    return method == "mtp" or (method == "dflash2" and dflash2_graph_rounds)


@dataclass
class _Round:
    """A speculative step between `execute` and `finish` (worker-side state)."""

    graphed: bool
    seqs: list[StepSequence]
    drafts: list[list[int]]
    rows: dict[int, tuple[Tensor, Tensor]]  # item -> (logits rows, wide rows)
    paged: PagedMeta | None

"""Engine: add_request / step / abort over the scheduler, the hybrid cache and the model runner.

One `step()` = schedule (chunked prefills and decodes within the token budget) -> cache copies
(swap-ins, prefix-hit state restores, fresh-slot resets) -> one varlen forward on the paged cache
-> sampling for every request whose known tokens are all computed -> commit / free. Sampling and
stop rules belong to the caller (`sample_fn`), so `LLM` and the server share one engine.

Media: a request with `mm_prompt` (mm_processor.MultimodalPrompt) has its items encoded by the
vision tower in the step that first reaches them (encoder_cache.py decides when), and each chunk
takes the rows of its pad tokens from the encoder cache, with the prompt's mRoPE positions.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import Tensor

from ..cache.capacity import CacheConfig, MemoryBudget, default_cudagraph_reserve_mib, estimate_activation_bytes
from ..cache.capacity import plan_cache, resolve_kv_dtype
from ..cache.hybrid import HybridAllocator
from ..cache.storage import MTP, CacheStorage, kv_scales_from_state_dict
from .cuda_graphs import DecodeGraphs, default_capture_sizes, graph_warning
from ..multimodal.encoder_cache import EncoderCache, check_item_fits
from ..forward import PagedMeta
from ..multimodal.processor import MediaItem, MultimodalPrompt
from ..model import FlashNextModel
from ..ple.load import ple_memory
from ..multimodal.media import MediaError
from .runner import ModelRunner, StepSequence
from .scheduler import SchedRequest, ScheduledSeq, Scheduler, Sequence
from ..spec.commit import check_replay_slots, commit_verified
from ..spec.config import SpeculativeConfig
from ..spec.dflash2.checks import check_dflash2
from ..spec.dflash2.checkpoint import load_draft_model
from ..spec.dflash2.drafter import DFlash2Drafter
from ..spec.graphs import SpecGraphs
from ..spec.measured import slower_warning
from ..spec.mtp import DraftItem, MTPDrafter
from ..spec.stats import SpecStats

logger = logging.getLogger(__name__)

MIN_ENCODER_TOKENS = 4096
# (requests, logits [N, V]) -> append tokens. With speculation it is called as (requests, logits, drafts):
# request i owns 1 + len(drafts[i]) consecutive rows (its definite token's row, then one per draft) and
# appends the tokens it emits (accepted drafts + one more, spec/verify.py); the engine commits the drafts
# that match what it appended.
SampleFn = Callable[..., None]
# (request, index of the first prompt token predicted, logits [n, V]): rows predict prompt tokens
# first .. first + n - 1 (a prompt-logprobs request's prefill chunk)
PromptLogitsFn = Callable[[SchedRequest, int, Tensor], None]


@dataclass(frozen=True)
class EngineConfig:
    """vLLM-named knobs of the engine.

    Cache size: `kv_cache_gib` when given; else on CUDA `gpu_memory_utilization` of the device's
    memory minus the weights, the activation peak of one `max_num_batched_tokens` forward, the
    CUDA-graph reserve and a fixed allowance; on CPU 0.5 GiB.
    CUDA graphs (CUDA + Triton kernels, unless `enforce_eager`): decode steps replay graphs
    captured for `cudagraph_capture_sizes` (default 1, 2, 4, 8, 16, ... up to max_num_seqs).
    `cudagraph_mem_mib` is the memory kept for them before the cache is sized (default: env
    REVOLTA_CUDAGRAPH_MEM_MIB, else by speculative method: 1200 MiB for DFlash2, 700 MiB for MTP
    and no speculation, spec/engine.md §4.7); after capture a warning names a better value when the
    graphs took clearly more.
    """

    max_model_len: int
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 8192
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_gib: float | None = None
    kv_offload_gib: float = 0.0  # CPU tier: evicted prefix blocks and snapshots in pinned host memory
    block_size: int | None = None
    kernels: str = "torch"  # "torch" references or "triton" kernels
    # vLLM's dict ({"method": "mtp", "num_speculative_tokens": 4, "spec_state_replay": False}, or
    # {"method": "dflash2", "model": DIR, ...}); None: MTP4 when the model has its MTP head loaded, else off;
    # {"method": None}: off (spec/config.py)
    speculative_config: Mapping[str, Any] | SpeculativeConfig | None = None
    # vision-tower output rows one step may compute, and rows the encoder cache holds; default the token budget,
    # at least MIN_ENCODER_TOKENS (a default ~1 MP image is 1,024 rows, a default video up to 3,136)
    max_num_encoder_input_tokens: int | None = None
    encoder_cache_size: int | None = None
    enforce_eager: bool = False
    cudagraph_mem_mib: float | None = None
    cudagraph_capture_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1 (or None for the default)")
        if self.resolved_cudagraph_mem_mib() < 0:
            raise ValueError(f"cudagraph_mem_mib={self.resolved_cudagraph_mem_mib()} must be >= 0 MiB")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None and (not sizes or any(not isinstance(b, int) or b < 1 for b in sizes)):
            raise ValueError(f"cudagraph_capture_sizes={sizes!r} must be a non-empty list of batch sizes >= 1")

    @property
    def speculative_method(self) -> str | None:
        """"mtp", "dflash2" or None, read from speculative_config without resolving it (None: MTP or off)."""
        spec = self.speculative_config
        if isinstance(spec, SpeculativeConfig):
            return spec.method
        method = spec.get("method", "mtp") if isinstance(spec, Mapping) else None
        return "dflash2" if method == "dflash" else method

    def resolved_cudagraph_mem_mib(self) -> float:
        """Explicit value, else env REVOLTA_CUDAGRAPH_MEM_MIB, else the speculative method's default."""
        if self.cudagraph_mem_mib is not None:
            return float(self.cudagraph_mem_mib)
        env = os.environ.get("REVOLTA_CUDAGRAPH_MEM_MIB")
        if env is None:
            return default_cudagraph_reserve_mib(self.speculative_method)
        try:
            return float(env)
        except ValueError:
            raise ValueError(f"REVOLTA_CUDAGRAPH_MEM_MIB={env!r} is not a number of MiB; set it to e.g. 700") from None

    @property
    def use_cuda_graphs(self) -> bool:
        """Graphs need the Triton path: the torch references read values on the host mid-forward."""
        return not self.enforce_eager and self.kernels == "triton"


class Engine:
    def __init__(self, model: FlashNextModel, config: EngineConfig):
        self.model, self.config = model, config
        cfg = model.cfg
        dtype = str(model.dtype).removeprefix("torch.")
        self.spec = SpeculativeConfig.resolve(config.speculative_config, has_mtp=model.mtp is not None)
        kv_scales = kv_scales_from_state_dict(model.kv_scales)
        if self.spec.is_dflash2:
            for warning in check_dflash2(self.spec, cfg, kv_cache_dtype=config.kv_cache_dtype, dtype=dtype):
                logger.warning(warning)
        elif self.spec.enabled:
            check_draft_kv_dtype(self.spec, config.kv_cache_dtype, kv_scales, dtype)
        cache = CacheConfig(max_model_len=config.max_model_len, kv_cache_dtype=config.kv_cache_dtype,
                            block_size=config.block_size, max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=config.max_num_batched_tokens,
                            enable_prefix_caching=config.enable_prefix_caching,
                            kv_offload_gib=config.kv_offload_gib,
                            **self.spec.cache_fields(config.kv_cache_dtype, dtype))
        self.plan = plan_cache(cfg, cache, self._budget(), tp=1, dtype=dtype)
        logger.info("speculative decoding: %s", self.spec.describe())
        for line in self.plan.capacity_lines():
            logger.info(line)
        logger.info("PLE table: %s", ple_memory(model).describe())
        self.storage = CacheStorage(cfg, self.plan.layout, device=model.device, kv_scales=kv_scales)
        cpu_layout = self.plan.cpu_layout()
        self.cpu_storage = None if cpu_layout is None else CacheStorage(cfg, cpu_layout, "cpu", pin_memory=True)
        self.allocator = HybridAllocator(self.plan.allocator_config())
        default = max(config.max_num_batched_tokens, MIN_ENCODER_TOKENS)
        self.encoder_budget = config.max_num_encoder_input_tokens or default
        self.encoder_cache = None if model.model.visual is None else EncoderCache(config.encoder_cache_size or default)
        self.runner = ModelRunner(model, self.storage, kernels=config.kernels,
                                  max_num_tokens=config.max_num_batched_tokens
                                  + config.max_num_seqs * (1 + self.spec.num_speculative_tokens))
        self.drafter = self._make_drafter()
        self.spec_stats = SpecStats()  # summed over every verify round of this engine
        self.scheduler = Scheduler(self.allocator, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.encoder_cache, self.encoder_budget,
                                   lookahead_fn=self._num_drafts if self.spec.enabled else None)
        self._seqs: dict[str, Sequence] = {}
        self.graphs: DecodeGraphs | None = None  # decode steps replay these when they fit
        self.spec_graphs: SpecGraphs | None = None  # with speculation: steady-state rounds replay these
        if model.device.type == "cuda" and config.use_cuda_graphs:
            if self.spec.enabled:  # every decoding step is a verify round
                # the round graphs run the MTP drafter (spec/graphs.py); another drafter drafts eagerly
                self.spec_graphs = self._capture_graphs(spec=True) if self.spec.method == "mtp" else None
                # as long as a benchmark row (spec/measured_speedup.json) says speculation is slower
                warning = slower_warning(self.spec.method)
                if warning:
                    logger.warning(warning)
            else:
                self.graphs = self._capture_graphs()

    def _make_drafter(self) -> MTPDrafter | DFlash2Drafter | None:
        """The configured drafter: the checkpoint's MTP head, or a DFlash2 drafter loaded from
        speculative_config["model"] in the target's dtype on its device (its config was checked
        against the target before anything was allocated)."""
        if not self.spec.enabled:
            return None
        if not self.spec.is_dflash2:
            return MTPDrafter(self.runner, self.spec.num_speculative_tokens)
        draft = load_draft_model(self.spec.model, dtype=self.model.dtype, device=self.model.device)
        return DFlash2Drafter(self.runner, draft, self.spec.num_speculative_tokens,
                              sampled=self.spec.draft_sample_method == "probabilistic")

    def _capture_graphs(self, spec: bool = False) -> DecodeGraphs | SpecGraphs:
        cfg = self.config
        sizes = list(cfg.cudagraph_capture_sizes or default_capture_sizes(cfg.max_num_seqs))
        if max(sizes) > cfg.max_num_seqs:
            raise ValueError(f"cudagraph_capture_sizes={sizes} has sizes above max_num_seqs={cfg.max_num_seqs}; "
                             "drop them or raise max_num_seqs")
        width = -(-(cfg.max_model_len + self.plan.cache.num_speculative_tokens) // self.plan.layout.block_size)
        if spec:
            graphs = SpecGraphs(self.runner, sizes, self.spec.num_speculative_tokens, self.spec.spec_state_replay,
                                width)
            what = f"speculative round (MTP draft steps, verify of 1 + {self.spec.num_speculative_tokens} rows, commit)"
        else:
            graphs, what = DecodeGraphs(self.runner, sizes, width), "decode"
        graphs.capture()
        logger.info("CUDA graphs: captured %s batch sizes %s in %.0f MiB", what, sizes, graphs.used_bytes / 2**20)
        if cfg.kv_cache_gib is None:  # the reserve was part of the memory budget
            warning = graph_warning(graphs.used_bytes, int(cfg.resolved_cudagraph_mem_mib() * 2**20))
            if warning:
                logger.warning(warning)
        return graphs

    def _budget(self) -> MemoryBudget:
        # an FP8 PLE table on the device is not a parameter; one off the device frees its bytes for the KV pool
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters()) + ple_memory(self.model).unlisted_device_bytes
        cfg = self.config
        if self.model.device.type == "cuda" and cfg.kv_cache_gib is None:
            total = torch.cuda.get_device_properties(self.model.device).total_memory
            dtype = str(self.model.dtype).removeprefix("torch.")
            activations = estimate_activation_bytes(self.model.cfg, 1, cfg.max_num_batched_tokens, cfg.max_num_seqs,
                                                    self.spec.num_speculative_tokens, dtype=dtype)
            graphs = int(cfg.resolved_cudagraph_mem_mib() * 2**20) if cfg.use_cuda_graphs else 0
            return MemoryBudget(gpu_memory_bytes=total, gpu_memory_utilization=cfg.gpu_memory_utilization,
                                weights_bytes=weights, activation_bytes=activations, cudagraph_reserve_bytes=graphs)
        # a fixed allowance (CPU default 0.5 GiB): no graph or activation reserve
        cache = int((0.5 if self.config.kv_cache_gib is None else self.config.kv_cache_gib) * 2**30)
        return MemoryBudget(gpu_memory_bytes=cache, gpu_memory_utilization=1.0, weights_bytes=0,
                            activation_bytes=0, cudagraph_reserve_bytes=0, other_bytes=0)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request: SchedRequest) -> None:
        if request.request_id in self._seqs:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        n = len(request.prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty; pass at least one token")
        if n >= self.config.max_model_len:
            raise ValueError(f"the prompt has {n} tokens but max_model_len={self.config.max_model_len}; shorten "
                             "it or raise max_model_len")
        mm = getattr(request, "mm_prompt", None)
        if mm is not None:
            self.check_media(mm)
        seq = Sequence(request)
        self._seqs[request.request_id] = seq
        self.scheduler.add(seq)

    def check_media(self, mm: MultimodalPrompt) -> None:
        """Raise MediaError when a prompt's media can never be encoded here (no tower, item over the budgets)."""
        if self.encoder_cache is None:
            raise MediaError("this request has media but the model has no vision tower; send text only")
        check_item_fits(mm, self.encoder_budget, self.encoder_cache.capacity)

    def abort(self, request_id: str) -> None:
        """Drop a request at once: its blocks and slot go back to the pools."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq)
            if self.drafter is not None:
                self.drafter.drop(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def check_health(self) -> None:
        """Raise a FatalEngineError when a process the forward needs (the PLE worker) has died."""
        self.runner.check_health()

    # ---- one step ------------------------------------------------------------------------------
    def step(self, sample_fn: SampleFn, prompt_logits_fn: PromptLogitsFn | None = None) -> list[SchedRequest]:
        """Run one scheduled step; returns the requests that got a new token.

        Requests with a `prompt_logprobs` attribute that is not None also hand the logits of their
        prefill chunk's prompt positions to `prompt_logits_fn`.
        """
        items = self.scheduler.schedule()
        if not items:
            if self.scheduler.has_unfinished():
                raise RuntimeError("no request fits in the cache even alone; raise the cache size or lower "
                                   "max_model_len")
            return []
        self._encode([m for it in items for m in it.encode])
        if self.spec.enabled:
            return self._spec_step(items, sample_fn, prompt_logits_fn)
        self.storage.pre_forward([it.alloc for it in items], self.allocator.take_swap_outs(), self.cpu_storage)
        seqs = [self._step_sequence(it) for it in items]
        prompt_rows = [prompt_logits_fn is not None and it.seq.skip_prefix_cache
                       and it.alloc.num_computed_tokens < it.seq.num_prompt_tokens - 1 for it in items]
        if any(prompt_rows):
            logits = self._execute_with_prompt_logits(items, seqs, prompt_rows, prompt_logits_fn)
        elif self.graphs is not None and self.graphs.can_run(seqs):
            logits = self.graphs.run(seqs)  # [B, V]
        else:
            logits = self.runner.execute(seqs)  # [B, V]
        self.storage.post_forward([it.alloc for it in items])
        ready = [i for i, it in enumerate(items)  # all known tokens computed: the next token is due
                 if it.alloc.num_computed_tokens + it.num_new_tokens == len(it.seq.all_token_ids)]
        sampled = [items[i].seq.request for i in ready]
        if ready:
            sample_fn(sampled, logits[torch.tensor(ready, device=logits.device)])
        self.scheduler.update(items)
        for it in items:
            if it.seq.request.finished:
                self._seqs.pop(it.seq.request_id, None)
        return sampled

    def _execute_with_prompt_logits(self, items: list[ScheduledSeq], seqs: list[StepSequence],
                                    prompt_rows: list[bool], prompt_logits_fn: PromptLogitsFn,
                                    return_hidden: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """The forward projecting every row of the flagged chunks, not only the last rows -> [B, V]
        (and the wide hidden states [T, h*d] with return_hidden)."""
        rows, last = [], []
        start = 0
        for s, flagged in zip(seqs, prompt_rows):
            n = len(s.token_ids)
            rows.extend(range(start, start + n) if flagged else [start + n - 1])
            last.append(len(rows) - 1)
            start += n
        out = self.runner.execute(seqs, logits_rows=rows, return_hidden=return_hidden)  # [len(rows), V]
        logits, wide = out if return_hidden else (out, None)
        offset = 0
        for it, s, flagged in zip(items, seqs, prompt_rows):
            n = len(s.token_ids) if flagged else 1
            if flagged:  # row j predicts token num_computed + j + 1; keep those inside the prompt
                first = it.alloc.num_computed_tokens + 1
                keep = min(n, it.seq.num_prompt_tokens - first)
                prompt_logits_fn(it.seq.request, first, logits[offset:offset + keep])
            offset += n
        last_logits = logits[torch.tensor(last, device=logits.device)]
        return (last_logits, wide) if return_hidden else last_logits

    def _step_sequence(self, it: ScheduledSeq) -> StepSequence:
        a, seq = it.alloc, it.seq
        start = a.num_computed_tokens
        step = StepSequence(token_ids=seq.all_token_ids[start:start + a.num_new_tokens], num_computed=start,
                            block_ids=list(self.allocator.block_ids(seq)), slot=a.state_slot)
        if seq.mm is not None:
            self._attach_media(step, seq)
        return step

    # ---- media -----------------------------------------------------------------------------------
    @torch.no_grad()
    def _encode(self, items: list[MediaItem]) -> None:
        """Run the vision tower once over every item scheduled for encoding this step; store the outputs."""
        if not items:
            return
        visual = self.model.model.visual
        vcfg = self.model.cfg.vision
        pixels = torch.cat([m.pixel_values(vcfg) for m in items]).to(self.model.device)  # [sum t*h*w, patch_dim]
        embeds = visual(pixels.to(self.model.dtype), [m.grid for m in items])  # [sum tokens, d]
        for m, e in zip(items, embeds.split([m.num_tokens for m in items])):
            self.encoder_cache.put(m.content_hash, e)

    def _attach_media(self, step: StepSequence, seq: Sequence) -> None:
        """mRoPE positions of the prompt, and the encoder rows (with their places) of the chunk's pad tokens."""
        mm = seq.mm
        step.positions, step.rope_delta = mm.positions, mm.rope_delta
        start, end = step.num_computed, step.num_computed + len(step.token_ids)
        rows, places = [], []
        for item in mm.items_in(start, end):
            embeds = self.encoder_cache.get(item.content_hash)
            for row, offset, count in item.rows_in(start, end):
                rows.append(embeds[row:row + count])
                places.extend(range(offset - start, offset - start + count))
        if rows:
            step.mm_embeds = torch.cat(rows)
            step.mm_index = places

    # ---- speculative decoding (spec/): drafts with the MTP head, one verify forward -------------
    def _num_drafts(self, seq: Sequence) -> int:
        """Drafts a decoding request verifies this step: k, fewer near max_model_len or its
        max_tokens (no draft could be kept), none without pending MTP rows (just preempted)."""
        if not self.drafter.has_pending(seq.request_id, seq.num_computed_tokens, seq.num_preemptions):
            return 0
        known = len(seq.request.prompt_token_ids) + len(seq.request.token_ids)
        room = self.config.max_model_len - known - 1  # a round emits up to drafts + 1 tokens
        max_tokens = getattr(seq.request, "max_tokens", None)
        if max_tokens is not None:
            room = min(room, max_tokens - len(seq.request.token_ids) - 1)
        # the concurrency ladder (DFlash2's dflash_concurrency_drafts; all k for MTP) at the running count
        return max(0, min(self.spec.drafts_at(len(self.scheduler.running)), room))

    def _spec_step(self, items: list[ScheduledSeq], sample_fn: SampleFn,
                   prompt_logits_fn: PromptLogitsFn | None = None) -> list[SchedRequest]:
        """A step with speculation: MTP seeds and drafts, the prefill chunks run as usual and the
        decoding requests run one verify forward over their definite token and drafts; after
        sampling (sample_fn gets the drafts and every verify row) the accepted state is committed."""
        is_verify = [it.num_new_tokens == 1 and it.alloc.num_computed_tokens + 1 == len(it.seq.all_token_ids)
                     and it.alloc.num_computed_tokens > 0 for it in items]
        self.storage.pre_forward([it.alloc for it in items], self.allocator.take_swap_outs(), self.cpu_storage)
        steps = [self._step_sequence(it) for it in items]
        draft_items = [DraftItem(it.seq.request_id, st, it.seq.all_token_ids, it.seq.num_preemptions,
                                 it.alloc.num_lookahead_tokens if v else 0) for it, st, v in zip(items, steps, is_verify)]
        graphed = (self.spec_graphs is not None and all(is_verify)
                   and self.spec_graphs.can_run(steps, [d.num_drafts for d in draft_items]))
        drafts = self.drafter.propose(draft_items, self.spec_graphs) if graphed else self.drafter.propose(draft_items)
        pre = [i for i, v in enumerate(is_verify) if not v]
        ver = [i for i, v in enumerate(is_verify) if v]
        rows: dict[int, tuple[Tensor, Tensor]] = {}  # item -> (logits rows, wide rows)
        if pre:
            pre_items, pre_steps = [items[i] for i in pre], [steps[i] for i in pre]
            prompt_rows = [prompt_logits_fn is not None and it.seq.skip_prefix_cache
                           and it.alloc.num_computed_tokens < it.seq.num_prompt_tokens - 1 for it in pre_items]
            if any(prompt_rows):
                logits, wide = self._execute_with_prompt_logits(pre_items, pre_steps, prompt_rows, prompt_logits_fn,
                                                                return_hidden=True)
            else:
                logits, wide = self.runner.execute(pre_steps, return_hidden=True)
            self.storage.post_forward([it.alloc for it in pre_items])
            offset = 0
            for j, i in enumerate(pre):
                n = items[i].num_new_tokens
                rows[i] = (logits[j:j + 1], wide[offset:offset + n])
                offset += n
        paged = None
        if graphed:  # spec/graphs.py: replay the verify graph; the drafts reach the host here
            num_drafts = [d.num_drafts for d in draft_items]
            logits, wide, drafts = self.spec_graphs.verify(steps, drafts, num_drafts, self._slot_rows(items))
            R = self.spec_graphs.rows
            for i, n in enumerate(num_drafts):
                rows[i] = (logits[i * R:i * R + n + 1], wide[i * R:i * R + n + 1])
        elif ver:
            vsteps = [replace(steps[i], token_ids=steps[i].token_ids + drafts[i]) for i in ver]
            logits, wide, paged = self.runner.verify(vsteps, self._slot_rows([items[i] for i in ver]))
            cu = paged.cu_seqlens.tolist()
            for j, i in enumerate(ver):
                rows[i] = (logits[cu[j]:cu[j + 1]], wide[cu[j]:cu[j + 1]])
        # sample: the final prefill chunks' last rows, every verify row
        ready = [i for i, it in enumerate(items)
                 if is_verify[i] or it.alloc.num_computed_tokens + it.num_new_tokens == len(it.seq.all_token_ids)]
        sampled = [items[i].seq.request for i in ready]
        before = [len(r.token_ids) for r in sampled]
        if ready:
            sample_fn(sampled, torch.cat([rows[i][0] for i in ready]), [drafts[i] for i in ready])
        accepted = [0] * len(items)
        for i, r, n0 in zip(ready, sampled, before):
            new, d = r.token_ids[n0:], drafts[i]
            a = 0
            while a < min(len(d), len(new) - 1) and new[a] == d[a]:
                a += 1
            accepted[i] = a
            if d:
                stats = getattr(r, "spec_stats", None)
                if isinstance(stats, SpecStats):
                    stats.record(len(d), a)
                self.spec_stats.record(len(d), a)
        if ver:
            vitems, vaccepted = [items[i] for i in ver], [accepted[i] for i in ver]
            if graphed:
                self.spec_graphs.commit([it.alloc.state_slot for it in vitems], self._keep_slots(vitems, vaccepted),
                                        [a + 1 for a in vaccepted])
            else:
                input_ids = torch.tensor([t for i in ver for t in steps[i].token_ids + drafts[i]],
                                         device=paged.slots.device)
                self._commit_verified(paged, input_ids, vitems, vaccepted)
            self.storage.post_forward([it.alloc for it in vitems])
        for i, it in enumerate(items):
            if not it.seq.request.finished:
                keep = it.num_new_tokens + accepted[i]
                self.drafter.keep(it.seq.request_id, rows[i][1][:keep], it.alloc.num_computed_tokens,
                                  it.seq.num_preemptions)
        self.scheduler.update(items, accepted)
        for it in items:
            if it.seq.request.finished:
                self._seqs.pop(it.seq.request_id, None)
                self.drafter.drop(it.seq.request_id)
        if ver and self.spec_stats.num_rounds and self.spec_stats.num_rounds % SPEC_LOG_INTERVAL < len(ver):
            logger.info("speculative decoding: %s", self.spec_stats.summary())
        return sampled

    def _commit_verified(self, paged: PagedMeta, input_ids: Tensor, items: list[ScheduledSeq],
                         accepted: list[int]) -> None:
        """Recurrent state of the verified requests: the state after the definite token and the
        accepted drafts goes to the slot the allocator keeps as running (spec/commit.py)."""
        device = paged.slots.device
        keep = self._keep_slots(items, accepted)
        check_replay_slots([it.alloc.state_slot for it in items], keep, paged.spec.draft_slots is None)
        commit_verified(self.storage, self.runner.ops, paged.spec, paged.cu_seqlens, input_ids,
                        paged.slots, torch.tensor(keep, dtype=torch.int32, device=device),
                        torch.tensor([a + 1 for a in accepted], dtype=torch.int32, device=device))


    def _slot_rows(self, items: list[ScheduledSeq]) -> list[list[int]] | None:
        """Per verified request its running slot then its per-draft slots (None with replay)."""
        return None if self.spec.spec_state_replay else [[it.alloc.state_slot, *it.alloc.draft_slots] for it in items]

    @staticmethod
    def _keep_slots(items: list[ScheduledSeq], accepted: list[int]) -> list[int]:
        """The slot holding each request's committed state after `accepted` drafts."""
        return [it.alloc.draft_slots[a - 1] if a and it.alloc.draft_slots else it.alloc.state_slot
                for it, a in zip(items, accepted)]


SPEC_LOG_INTERVAL = 64  # verify rounds between acceptance-statistics log lines


def check_draft_kv_dtype(spec: SpeculativeConfig, kv_cache_dtype: str, kv_scales: Mapping, dtype: str) -> None:
    """An E4M3 draft KV cache needs calibrated MTP K/V scales (release note, spec/engine.md §2.8)."""
    draft = resolve_kv_dtype(spec.kv_cache_dtype or kv_cache_dtype, dtype)
    if draft == "fp8_e4m3" and MTP not in kv_scales:
        raise ValueError("the MTP draft KV cache would be fp8_e4m3, but the checkpoint has no calibrated draft K/V "
                         "scales (mtp.layers.0.self_attn.{k,v}_scale); set speculative_config "
                         "{'kv_cache_dtype': 'auto'} for a 16-bit draft cache, or use a checkpoint with MTP scales")

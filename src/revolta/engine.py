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
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from .cache.capacity import DEFAULT_CUDAGRAPH_RESERVE_MIB, CacheConfig, MemoryBudget, estimate_activation_bytes, plan_cache
from .cache.hybrid import HybridAllocator
from .cache.storage import CacheStorage, kv_scales_from_state_dict
from .cuda_graphs import DecodeGraphs, default_capture_sizes, graph_warning
from .encoder_cache import EncoderCache, check_item_fits
from .mm_processor import MediaItem, MultimodalPrompt
from .multimodal import MediaError
from .model import FlashNextModel
from .runner import ModelRunner, StepSequence
from .scheduler import SchedRequest, ScheduledSeq, Scheduler, Sequence

logger = logging.getLogger(__name__)

MIN_ENCODER_TOKENS = 4096
SampleFn = Callable[[list[SchedRequest], Tensor], None]  # (requests, logits [N, V]) -> append tokens
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
    REVOLTA_CUDAGRAPH_MEM_MIB, else 700 MiB); after capture a warning names a better value when the
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

    def resolved_cudagraph_mem_mib(self) -> float:
        if self.cudagraph_mem_mib is not None:
            return float(self.cudagraph_mem_mib)
        env = os.environ.get("REVOLTA_CUDAGRAPH_MEM_MIB")
        if env is None:
            return DEFAULT_CUDAGRAPH_RESERVE_MIB
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
        cache = CacheConfig(max_model_len=config.max_model_len, kv_cache_dtype=config.kv_cache_dtype,
                            block_size=config.block_size, max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=config.max_num_batched_tokens,
                            enable_prefix_caching=config.enable_prefix_caching,
                            kv_offload_gib=config.kv_offload_gib)
        self.plan = plan_cache(cfg, cache, self._budget(), tp=1, dtype=dtype)
        self.storage = CacheStorage(cfg, self.plan.layout, device=model.device,
                                    kv_scales=kv_scales_from_state_dict(model.kv_scales))
        cpu_layout = self.plan.cpu_layout()
        self.cpu_storage = None if cpu_layout is None else CacheStorage(cfg, cpu_layout, "cpu", pin_memory=True)
        self.allocator = HybridAllocator(self.plan.allocator_config())
        default = max(config.max_num_batched_tokens, MIN_ENCODER_TOKENS)
        self.encoder_budget = config.max_num_encoder_input_tokens or default
        self.encoder_cache = None if model.model.visual is None else EncoderCache(config.encoder_cache_size or default)
        self.scheduler = Scheduler(self.allocator, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.encoder_cache, self.encoder_budget)
        self.runner = ModelRunner(model, self.storage, kernels=config.kernels)
        self._seqs: dict[str, Sequence] = {}
        for line in self.plan.capacity_lines():
            logger.info(line)
        self.graphs: DecodeGraphs | None = None  # decode steps replay these when they fit
        if model.device.type == "cuda" and config.use_cuda_graphs:
            self.graphs = self._capture_graphs()

    def _capture_graphs(self) -> DecodeGraphs:
        cfg = self.config
        sizes = list(cfg.cudagraph_capture_sizes or default_capture_sizes(cfg.max_num_seqs))
        if max(sizes) > cfg.max_num_seqs:
            raise ValueError(f"cudagraph_capture_sizes={sizes} has sizes above max_num_seqs={cfg.max_num_seqs}; "
                             "drop them or raise max_num_seqs")
        width = -(-(cfg.max_model_len + self.plan.cache.num_speculative_tokens) // self.plan.layout.block_size)
        graphs = DecodeGraphs(self.runner, sizes, width)
        graphs.capture()
        logger.info("CUDA graphs: captured decode batch sizes %s in %.0f MiB", sizes, graphs.used_bytes / 2**20)
        if cfg.kv_cache_gib is None:  # the reserve was part of the memory budget
            warning = graph_warning(graphs.used_bytes, int(cfg.resolved_cudagraph_mem_mib() * 2**20))
            if warning:
                logger.warning(warning)
        return graphs

    def _budget(self) -> MemoryBudget:
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        cfg = self.config
        if self.model.device.type == "cuda" and cfg.kv_cache_gib is None:
            total = torch.cuda.get_device_properties(self.model.device).total_memory
            dtype = str(self.model.dtype).removeprefix("torch.")
            activations = estimate_activation_bytes(self.model.cfg, 1, cfg.max_num_batched_tokens, cfg.max_num_seqs,
                                                    dtype=dtype)
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

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

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
                                    prompt_rows: list[bool], prompt_logits_fn: PromptLogitsFn) -> Tensor:
        """The forward projecting every row of the flagged chunks, not only the last rows -> [B, V]."""
        rows, last = [], []
        start = 0
        for s, flagged in zip(seqs, prompt_rows):
            n = len(s.token_ids)
            rows.extend(range(start, start + n) if flagged else [start + n - 1])
            last.append(len(rows) - 1)
            start += n
        logits = self.runner.execute(seqs, logits_rows=rows)  # [len(rows), V]
        offset = 0
        for it, s, flagged in zip(items, seqs, prompt_rows):
            n = len(s.token_ids) if flagged else 1
            if flagged:  # row j predicts token num_computed + j + 1; keep those inside the prompt
                first = it.alloc.num_computed_tokens + 1
                keep = min(n, it.seq.num_prompt_tokens - first)
                prompt_logits_fn(it.seq.request, first, logits[offset:offset + keep])
            offset += n
        return logits[torch.tensor(last, device=logits.device)]

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

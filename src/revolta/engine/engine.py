"""Engine: add_request / step / abort over the scheduler, the hybrid cache allocator and an executor.

One `step()` = schedule (chunked prefills and decodes within the token budget, scheduler.py) ->
the executor runs it (cache copies, the vision tower, drafts, one varlen forward on the paged cache,
executor.py) -> sampling for every request whose known tokens are all computed: penalties, grammar
masks, sampling, logprobs, draft acceptance and stop rules (sample_step.py) -> the executor commits
the accepted state -> the scheduler commits the computed tokens and frees finished requests. It
returns the requests that gained a token; `LLM` and the server build their outputs from them.

Media: a request with `mm_prompt` (multimodal.processor.MultimodalPrompt) has its items encoded by the
vision tower in the step that first reaches them (encoder_cache.py decides when), and each chunk
takes the rows of its pad tokens from the encoder cache, with the prompt's mRoPE positions.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..cache.capacity import CacheConfig, MemoryBudget, default_cudagraph_reserve_mib, estimate_activation_bytes
from ..cache.capacity import CacheConfigError, CachePlan, fit_max_model_len, plan_cache, resolve_kv_dtype
from ..cache.hybrid import HybridAllocator
from ..cache.storage import MTP, kv_scales_from_state_dict
from ..model import FlashNextModel
from ..units import human_bytes
from ..multimodal.encoder_cache import EncoderCache, check_item_fits
from ..multimodal.media import MediaError
from ..multimodal.processor import MultimodalPrompt
from ..ple.load import ple_memory
from ..spec.config import SpeculativeConfig, speculative_method
from ..spec.dflash2.rank_drafter import rank_weight_bytes
from ..spec.resolve import resolve_speculative
from ..spec.stats import SpecStats
from ..tokenizer import Tokenizer
from .async_step import InFlightStep, PendingTokens, chain_blocker, plain_request
from .executor import Executor, ModelStep, StepItem, UniProcExecutor, forwarded
from .tp_executor import TPGroup
from .request import Request
from .runner import StepSequence
from .sample_step import StepSampler, record_logprob
from .sampling import device_tensor
from .scheduler import ScheduledSeq, Scheduler, SeqState
from .sleep import SLEEP_LEVELS, EngineAsleepError, check_host_memory, host_available_bytes
from .spec_policy import SpecPolicy
from .warmup import WarmupReport, warm_up

logger = logging.getLogger(__name__)

MIN_ENCODER_TOKENS = 4096


CPU_KV_CACHE_GIB = 0.5  # the KV cache allowance without kv_cache_gib where no GPU sizes it (the CPU)


GRAPH_RESERVE_ENV = ("REVOLTA_CUDAGRAPH_MEM_MIB", "VLLM_V2_CUDAGRAPH_MEM_MIB")  # the first set wins


@dataclass(frozen=True)
class EngineConfig:
    """vLLM-named knobs of the engine.

    Cache size: `kv_cache_gib` when given; else on CUDA `gpu_memory_utilization` of the device's
    memory minus the weights, the activation peak of one `max_num_batched_tokens` forward, the
    CUDA-graph reserve and a fixed allowance; on CPU 0.5 GiB.
    CUDA graphs (CUDA + Triton kernels, unless `enforce_eager`; tp = 1 only): decode steps replay graphs
    captured for `cudagraph_capture_sizes` (default 1, 2, 4, 8, 16, ... up to max_num_seqs).
    `cudagraph_mem_mib` is the memory kept for them before the cache is sized (default: env
    REVOLTA_CUDAGRAPH_MEM_MIB, else by speculative method: 1200 MiB for DFlash2, 700 MiB for MTP
    and no speculation, spec/engine.md §4.7); after capture a warning names a better value when the
    graphs took clearly more.
    """

    max_model_len: int
    # max_model_len is the checkpoint's, not the user's: when the cache cannot hold one sequence of it, lower it to
    # the longest that fits (one warning) instead of failing; an explicit length that does not fit stays an error
    fit_max_model_len: bool = False
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
    # DFlash2 rounds through the speculative verify and commit CUDA graphs, and DFlash2's drafter forward (the block
    # through its layers and the greedy walk) through one CUDA graph per captured batch size, its context store read
    # as whole rings (spec/dflash2/draft_graph.py). None (the default): on wherever the engine captures CUDA graphs
    # (tensor_parallel_size 1, the Triton kernels on a GPU, enforce_eager off); True: asked for, refused where no
    # graphs can run; False: eager rounds. On by default since the H200 measured a full-depth DFlash2 round at 21 ms
    # with both (benchmarks/RESULTS.md F1 run I; eager rounds pay every launch and compile new row counts inside the
    # round: H2); their GPU tests (rounds == eager rounds) pass from a cold cache and ran clean under
    # compute-sanitizer memcheck (S2c)
    dflash2_graph_rounds: bool | None = None
    dflash2_draft_graph: bool | None = None
    cudagraph_mem_mib: float | None = None
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    # ranks the text model is split across (vLLM's name; parallel/, engine/tp_executor.py): the engine then runs
    # rank 0's shard, given as `model` with its `tp_group`, and sizes the cache per rank
    tensor_parallel_size: int = 1
    # the trunk QSA K/V striped over this many ranks of a KV head's group (parallel/dcp.py); the cache plan counts it
    decode_context_parallel_size: int = 1
    # start-up warm-up requests (warmup.py: every row count a speculative round verifies, compiled before the first
    # request); None: on where the Triton kernels run (kernels "triton"); LLM runs it after building the engine
    warmup: bool | None = None
    # launch a plain decode step before the host reads the previous step's tokens, hiding the host's work between
    # steps (vLLM's name; async_step.py); steps it does not cover (prefill, speculation, grammars) run
    # synchronously
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        gib = self.kv_cache_gib
        if gib is not None and (not _is_number(gib) or not 0 < gib < float("inf")):
            raise ValueError(f"kv_cache_gib={gib!r} must be > 0 GiB (or None: on CUDA what gpu_memory_utilization "
                             f"leaves, on CPU {CPU_KV_CACHE_GIB})")
        if not _is_number(self.gpu_memory_utilization) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization!r} must be in (0, 1]")
        none_means = {"dflash2_graph_rounds": "on where CUDA graphs run", "dflash2_draft_graph": "on where CUDA "
                      "graphs run", "warmup": "on where the Triton kernels run"}  # the switches None may leave unset
        for name in ("enable_prefix_caching", "enforce_eager", "async_scheduling", *none_means):
            value = getattr(self, name)  # "no" would be truthy: on, silently
            if not isinstance(value, bool) and not (value is None and name in none_means):
                raise ValueError(f"{name}={value!r} must be True or False"
                                 + (f" (or None: {none_means[name]})" if name in none_means else ""))
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1 (or None for the default)")
        if self.resolved_cudagraph_mem_mib() < 0:
            raise ValueError(f"cudagraph_mem_mib={self.resolved_cudagraph_mem_mib()} must be >= 0 MiB")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None and (not sizes or any(not isinstance(b, int) or b < 1 for b in sizes)):
            raise ValueError(f"cudagraph_capture_sizes={sizes!r} must be a non-empty list of batch sizes >= 1")
        for name in ("dflash2_graph_rounds", "dflash2_draft_graph"):  # an explicit opt-in is not dropped silently
            if getattr(self, name) and self.tensor_parallel_size > 1:
                raise ValueError(f"{name}=True needs tensor_parallel_size=1: at tensor_parallel_size="
                                 f"{self.tensor_parallel_size} the ranks run eager (no CUDA graphs); leave {name} off")
            if getattr(self, name) and self.kernels != "triton":
                raise ValueError(f"{name}=True needs CUDA graphs, which run the Triton kernels on a GPU; "
                                 f"kernels={self.kernels!r} (the CPU path) runs eager: leave {name} off")

    def dflash2_graphs(self, name: str) -> bool:
        """Whether DFlash2's `name` graphs ("dflash2_graph_rounds" or "dflash2_draft_graph") are on where this
        engine captures CUDA graphs: the setting, or by default at tensor_parallel_size 1 (the ranks of a larger
        group run eager)."""
        value = getattr(self, name)
        return value if value is not None else self.tensor_parallel_size == 1

    @property
    def speculative_method(self) -> str | None:
        """"mtp", "dflash2" or None, read from speculative_config without resolving it (None: MTP or off)."""
        return speculative_method(self.speculative_config)

    def resolved_cudagraph_mem_mib(self) -> float:
        """Explicit value, else env REVOLTA_CUDAGRAPH_MEM_MIB, else the release note's VLLM_V2_CUDAGRAPH_MEM_MIB (a
        vLLM deployment's setting is honoured, not silently dropped), else the speculative method's default."""
        if self.cudagraph_mem_mib is not None:
            return float(self.cudagraph_mem_mib)
        var = next((v for v in GRAPH_RESERVE_ENV if v in os.environ), None)
        if var is None:
            return default_cudagraph_reserve_mib(self.speculative_method)
        env = os.environ[var]
        try:
            value = float(env)
        except ValueError:
            raise ValueError(f"{var}={env!r} is not a number of MiB; set it to e.g. 700") from None
        if value < 0:
            raise ValueError(f"{var}={env} must be >= 0 MiB (0 keeps no graph reserve); unset it for the default")
        return value

    @property
    def use_warmup(self) -> bool:
        """Whether LLM runs the start-up warm-up (warmup.py): the setting, else where the Triton kernels run."""
        return self.warmup if self.warmup is not None else self.kernels == "triton"

    @property
    def use_cuda_graphs(self) -> bool:
        """Graphs need the Triton path: the torch references read values on the host mid-forward. At tp > 1 the
        ranks run eager: every collective's wait is bounded (parallel/context.py), and a graph cannot hold one."""
        return not self.enforce_eager and self.kernels == "triton" and self.tensor_parallel_size == 1


@dataclass(frozen=True)
class EngineStatus:
    """What the engine reports to a server (read between steps): queue lengths, cache usage, speculation."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    block_size: int
    prefix_caching: bool
    spec: SpecStats | None  # summed over every verify round; None without speculation
    spec_paused: bool = False  # the adaptive policy decodes plainly (drafting does not pay at this batch size)
    spec_paused_steps: int = 0  # decode steps run without drafting by the policy's choice
    spec_speedup: float | None = None  # the policy's estimate: tokens/s drafting over plain (None: not measured)
    async_steps: int = 0  # decode steps launched before the previous step's tokens were read (async_scheduling)


class Engine:
    """add_request / step / abort; see the module docstring.

    tokenizer: decodes logprob entries (None: no text); eos_token_ids: tokens that end a request (default the
    model's eos_token_id); num_text_ids: embedding rows from it on are never sampled (default the vocabulary).
    """

    def __init__(self, model: FlashNextModel, config: EngineConfig, *, tokenizer: Tokenizer | None = None,
                 eos_token_ids: frozenset[int] | None = None, num_text_ids: int | None = None,
                 tp_group: TPGroup | None = None):
        self.model, self.config, self.tp = model, config, config.tensor_parallel_size
        self.dcp = config.decode_context_parallel_size
        group_size = (tp_group.tp, tp_group.dcp) if tp_group is not None else (1, 1)
        if group_size != (self.tp, self.dcp) or (tp_group and tp_group.model is not model):
            raise ValueError(f"tensor_parallel_size={self.tp}, decode_context_parallel_size={self.dcp} need the TPGroup "
                             "of those sizes whose rank-0 shard is `model` (TPGroup.start; LLM(tensor_parallel_size=N) "
                             "builds both)")
        cfg = model.cfg
        dtype = str(model.dtype).removeprefix("torch.")
        if isinstance(config.speculative_config, SpeculativeConfig):  # resolved and checked by the caller
            self.spec = config.speculative_config
        else:
            self.spec, warnings = resolve_speculative(config.speculative_config, cfg, has_mtp=model.mtp is not None,
                                                      dtype=dtype, kv_cache_dtype=config.kv_cache_dtype,
                                                      tensor_parallel_size=self.tp)
            for warning in warnings:
                logger.warning(warning)
        if self.spec.enabled and not self.spec.is_dflash2:
            check_draft_kv_dtype(self.spec, config.kv_cache_dtype, kv_scales_from_state_dict(model.kv_scales), dtype)
        self.drafter_weights_bytes = self._drafter_weights_bytes()  # loaded after the plan, so counted here
        cache = CacheConfig(max_model_len=config.max_model_len, kv_cache_dtype=config.kv_cache_dtype,
                            block_size=config.block_size, max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=config.max_num_batched_tokens,
                            enable_prefix_caching=config.enable_prefix_caching,
                            kv_offload_gib=config.kv_offload_gib,
                            **self.spec.cache_fields(config.kv_cache_dtype, dtype))
        self.max_model_len_fitted = False  # True: max_model_len was lowered to fit the cache (fit_max_model_len)
        try:
            self.plan = plan_cache(cfg, cache, self._budget(), tp=self.tp, dtype=dtype, dcp=self.dcp)
        except CacheConfigError:
            if not config.fit_max_model_len:
                raise
            self.plan = self._fit_max_model_len(cache, dtype)
            config = self.config
        logger.info("speculative decoding: %s", self.spec.describe())
        if config.async_scheduling and (self.spec.enabled or self.tp > 1):
            why = (f"speculative decoding ({self.spec.method}) verifies drafts in every decoding step (to use it, turn "
                   "speculation off: speculative_config={'method': None})" if self.spec.enabled
                   else f"tensor_parallel_size={self.tp} runs its steps on worker processes")
            logger.warning("async_scheduling covers plain decode steps on one GPU, but %s: every step runs "
                           "synchronously", why)
        if self.drafter_weights_bytes:
            sharded = self.tp > 1 and self.spec.sm70_dflash2.sharded_selector_codebook
            books = f"sharded over TP {self.tp}" if sharded else "replicated"
            logger.info("DFlash2 drafter weights: %s per GPU (selector codebooks %s)",
                        human_bytes(self.drafter_weights_bytes), books)
        for line in self.plan.capacity_lines(on_gpu=model.device.type == "cuda"):
            logger.info(line)
        logger.info("PLE table: %s", ple_memory(model).describe())
        self.allocator = HybridAllocator(self.plan.allocator_config())
        default = max(config.max_num_batched_tokens, MIN_ENCODER_TOKENS)
        self.encoder_budget = config.max_num_encoder_input_tokens or default
        self.encoder_cache = None if model.model.visual is None else EncoderCache(config.encoder_cache_size or default)
        self.executor: Executor = (UniProcExecutor(model, self.plan, self.spec, config, self.encoder_cache)
                                   if tp_group is None else tp_group.executor(self.plan, self.spec, config, self.encoder_cache))
        eos = frozenset({cfg.text.eos_token_id}) if eos_token_ids is None else eos_token_ids
        self.sampler = StepSampler(eos, num_text_ids or cfg.text.vocab_size, tokenizer)
        self.spec_stats = SpecStats()  # summed over every verify round of this engine
        # "adaptive" drafting: rounds only while they pay (spec_policy.py); tests may swap in a fake-clock policy
        self.policy = SpecPolicy() if self.spec.enabled and self.spec.draft_policy == "adaptive" else None
        self._drafting = self.spec.enabled  # this step's decoding requests verify drafts
        self.num_paused_steps = 0
        num_drafts = weakref.WeakMethod(self._num_drafts)  # not the bound method: no engine <-> scheduler cycle
        self.scheduler = Scheduler(self.allocator, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.encoder_cache, self.encoder_budget,
                                   lookahead_fn=(lambda seq: num_drafts()(seq)) if self.spec.enabled else None)
        self._seqs: dict[str, SeqState] = {}
        self._inflight: InFlightStep | None = None  # async scheduling: the launched step whose tokens are unread
        self.num_async_steps = 0  # steps launched without waiting for their tokens (async_scheduling)
        self.num_chained_steps = 0  # of those, planned before the previous step's tokens were read
        self.sleep_level: int | None = None  # None: awake (sleep.py)
        self.paused = False  # pause(): steps are refused until resume(); requests may still be added
        self.host_memory = host_available_bytes  # the sleep preflight's source; tests inject a shortage

    # the in-process executor's pieces (tests and benchmarks reach them through the engine)
    runner = forwarded("executor", "runner")
    storage = forwarded("executor", "storage")
    cpu_storage = forwarded("executor", "cpu_storage")
    drafter = forwarded("executor", "drafter")
    graphs = forwarded("executor", "graphs")
    spec_graphs = forwarded("executor", "spec_graphs")

    def _fit_max_model_len(self, cache: CacheConfig, dtype: str) -> CachePlan:
        """The plan for the longest max_model_len the cache holds one sequence of; lowers `config.max_model_len`
        and says so once. Raises the planner's error when not even one block fits."""
        cfg, budget, full = self.model.cfg, self._budget(), cache.max_model_len
        fit = fit_max_model_len(cfg, cache, budget, tp=self.tp, dtype=dtype, dcp=self.dcp)
        if fit == 0:  # raises, naming what the length needs
            return plan_cache(cfg, cache, budget, tp=self.tp, dtype=dtype, dcp=self.dcp)
        plan = plan_cache(cfg, replace(cache, max_model_len=fit), budget, tp=self.tp, dtype=dtype, dcp=self.dcp)
        self.config, self.max_model_len_fitted = replace(self.config, max_model_len=fit), True
        try:  # the planner's own shortfall: it counts what grows with the length besides blocks (a drafter's KV)
            plan_cache(cfg, cache, budget, tp=self.tp, dtype=dtype, dcp=self.dcp)
            more = 0
        except CacheConfigError as e:
            more = (e.needed_cache_bytes or budget.cache_bytes) - budget.cache_bytes
        if self.model.device.type == "cuda" and self.config.kv_cache_gib is None:
            cache_is = f"gpu_memory_utilization={self.config.gpu_memory_utilization:g} of the GPU after the weights"
            how = ("raise gpu_memory_utilization, set kv_cache_gib=G (serve: --kv-cache-gib G), use "
                   "kv_cache_dtype='fp8_e4m3' or lower max_num_seqs")
        else:
            gib = self.config.kv_cache_gib
            cache_is = f"kv_cache_gib={gib if gib is not None else CPU_KV_CACHE_GIB:g}" + \
                ("" if gib is not None else ", the CPU default")
            how = "raise kv_cache_gib (serve: --kv-cache-gib G) or lower max_num_seqs"
        logger.warning("max_model_len not given: the checkpoint's max_position_embeddings=%s does not fit the KV "
                       "cache (%s), so max_model_len=%s, the longest one sequence it holds%s. To raise it, %s; an "
                       "explicit max_model_len (serve: --max-model-len) is kept as given, or is an error when it does "
                       "not fit", f"{full:,}", cache_is, f"{fit:,}",
                       f" (the full length needs {human_bytes(more)} more)" if more > 0 else "", how)
        return plan

    def _drafter_weights_bytes(self) -> int:
        """A DFlash2 drafter's weights on rank 0 (its part of the layers; its codebook rows when sharded, by the dry
        run's rule `codebook_bytes_per_gpu`); 0 without one (the MTP layer is part of the target's weights)."""
        if not self.spec.is_dflash2:
            return 0
        sharded = self.tp > 1 and bool(self.spec.sm70_dflash2.sharded_selector_codebook)
        return rank_weight_bytes(self.spec.model, self.model.dtype.itemsize, self.tp, sharded)

    def _budget(self) -> MemoryBudget:
        # an FP8 PLE table on the device is not a parameter; one off the device frees its bytes for the KV pool.
        # At tp > 1 `model` is rank 0's shard: these are the rank's own weights, and the budget is per rank; the
        # DFlash2 drafter is loaded by the executor after the plan, so its rank's bytes are added here
        weights = (sum(p.numel() * p.element_size() for p in self.model.parameters())
                   + ple_memory(self.model).unlisted_device_bytes + self.drafter_weights_bytes)
        cfg = self.config
        if self.model.device.type == "cuda" and cfg.kv_cache_gib is None:
            total = torch.cuda.get_device_properties(self.model.device).total_memory
            dtype = str(self.model.dtype).removeprefix("torch.")
            activations = estimate_activation_bytes(self.model.cfg, self.tp, cfg.max_num_batched_tokens, cfg.max_num_seqs,
                                                    self.spec.num_speculative_tokens, dtype=dtype)
            graphs = int(cfg.resolved_cudagraph_mem_mib() * 2**20) if cfg.use_cuda_graphs else 0
            return MemoryBudget(gpu_memory_bytes=total, gpu_memory_utilization=cfg.gpu_memory_utilization,
                                weights_bytes=weights, activation_bytes=activations, cudagraph_reserve_bytes=graphs)
        # a fixed allowance (CPU default 0.5 GiB): no graph or activation reserve
        gib = CPU_KV_CACHE_GIB if cfg.kv_cache_gib is None else cfg.kv_cache_gib
        allowance = f"kv_cache_gib={gib:g}" + (" (the CPU default)" if cfg.kv_cache_gib is None else "")
        return MemoryBudget(gpu_memory_bytes=int(gib * 2**30), gpu_memory_utilization=1.0, weights_bytes=0,
                            activation_bytes=0, cudagraph_reserve_bytes=0, other_bytes=0, allowance=allowance)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; its max_tokens is capped so that prompt + output fit max_model_len."""
        if self.sleep_level is not None:
            raise EngineAsleepError(f"the engine is asleep (sleep level {self.sleep_level}); call wake_up() first")
        if request.request_id in self._seqs:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        n = len(request.prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty; pass at least one token")
        if n >= self.config.max_model_len:
            raise ValueError(f"the prompt has {n} tokens but max_model_len={self.config.max_model_len}; shorten "
                             "it or raise max_model_len")
        if request.mm_prompt is not None:
            self.check_media(request.mm_prompt)
        room = self.config.max_model_len - n
        request.max_tokens = room if request.max_tokens is None else min(request.max_tokens, room)
        if self.spec.enabled and request.spec_stats is None:
            request.spec_stats = SpecStats()
        seq = SeqState(request)
        self._seqs[request.request_id] = seq
        self.scheduler.add(seq)

    def check_media(self, mm: MultimodalPrompt) -> None:
        """Raise MediaError when a prompt's media can never be encoded here (no tower, item over the budgets)."""
        if self.encoder_cache is None:
            raise MediaError("this model has no vision tower; send text only")
        check_item_fits(mm, self.encoder_budget, self.encoder_cache.capacity)

    def abort(self, request_id: str) -> None:
        """Drop a request at once: its blocks and slot go back to the pools, its grammar matcher is closed."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            row = self._inflight.row_of(request_id) if self._inflight is not None else None
            if row is not None:  # its row's token is never read; its cache goes now (later steps run after it)
                self._inflight.dropped.add(row)
            self.scheduler.finish(seq)
            self.executor.drop(request_id)
            seq.request.release()

    def warm_up(self) -> WarmupReport:
        """Run every row count a speculative round verifies once (and a prefill), before the first request, then
        clear what that touched (warmup.py). LLM calls it at start-up where EngineConfig.use_warmup."""
        return warm_up(self)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def close(self) -> None:
        """Stop the processes the executor started (the TP ranks), bounded; the engine does not run again."""
        self.executor.close()

    def check_health(self) -> None:
        """Raise a FatalEngineError when a process the forward needs (the PLE worker) has died."""
        self.executor.check_health()

    def stats(self) -> EngineStatus:
        """Queue lengths, cache usage and speculation counters (a server's /metrics and /health read these)."""
        a = self.allocator
        return EngineStatus(num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                           kv_cache_usage=a.usage, num_free_blocks=a.num_free_blocks, block_size=a.block_size,
                           prefix_caching=a.config.enable_prefix_caching,
                           spec=self.spec_stats if self.spec.enabled else None,
                           spec_paused=self.policy is not None and self.policy.paused,
                           spec_paused_steps=self.num_paused_steps,
                           spec_speedup=self.policy.estimated_speedup() if self.policy is not None else None,
                           async_steps=self.num_chained_steps)

    # ---- sleep and pause (sleep.py; LLM.sleep / LLM.pause handle the requests in flight) -------
    def check_sleep(self, level: int) -> None:
        """The preflight: raise ValueError for a bad level, SleepRefused when the host cannot take the weights
        (or level 2 has no checkpoint to reload); nothing changes either way."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level {level!r} is not one of {SLEEP_LEVELS} (0: stop serving only, 1: weights "
                             "to host memory, 2: weights dropped and reloaded from the checkpoint)")
        if level > 0:
            memory = self.executor.plan_sleep(level)
            check_host_memory(level, memory.host_bytes(), self.host_memory())

    def sleep(self, level: int = 1) -> None:
        """Free the device memory of an idle engine (see sleep.py for the levels); refuses with requests left."""
        if self.sleep_level is not None:
            return
        if self.has_unfinished():
            raise RuntimeError(f"sleep with {len(self.scheduler.running) + len(self.scheduler.waiting)} requests "
                               "unfinished; finish or abort them first (LLM.sleep(mode=...) does)")
        if self._inflight is not None:  # only ended requests' rows are left in it: let the device finish them
            self._inflight.tokens.read()
            self._inflight = None
        self.check_sleep(level)
        if level > 0:
            memory = self.executor.plan_sleep(level)
            self.allocator.reset_prefix_cache()  # the cached blocks' contents are about to go
            self.executor.sleep(memory)
            logger.info("engine asleep, %s", memory.describe())
        self.sleep_level = level

    def wake_up(self) -> None:
        """Take the memory back (weights, a zeroed KV cache, CUDA graphs); a no-op when awake."""
        if self.sleep_level is None:
            return
        if self.sleep_level > 0:
            start = time.perf_counter()
            self.executor.wake_up()
            logger.info("engine awake after sleep level %d (%.1f s)", self.sleep_level, time.perf_counter() - start)
        self.sleep_level = None

    def pause(self, clear_cache: bool = True) -> None:
        """Stop stepping until resume(); running requests keep their cache blocks. No CPU-tier load is left in
        flight: a swap-in is issued inside the step that scheduled it (storage.pre_forward), and on CUDA the
        device is synchronized here, so a pause always lets a started load finish. clear_cache forgets the
        prefix cache (GPU and CPU tier): a waiting request whose hit was in the CPU tier then recomputes instead
        of loading it (the load is cancelled before it starts)."""
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        if clear_cache:
            self.allocator.reset_prefix_cache()
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    # ---- one step ------------------------------------------------------------------------------
    @torch.no_grad()  # LLM.step adds inference mode; tests and benchmarks touch the graphs' buffers outside it
    def step(self) -> list[Request]:
        """Run one scheduled step; returns the requests that gained a token (finished ones included:
        `request.output()` is its vLLM-shaped RequestOutput)."""
        if self.paused or self.sleep_level is not None:
            raise RuntimeError("the engine is " + ("paused; call resume() first" if self.paused else
                                                   f"asleep (level {self.sleep_level}); call wake_up() first"))
        landed: list[Request] = []
        if self._inflight is not None:  # async scheduling (async_step.py)
            if chain_blocker(self._inflight, self.scheduler, self.allocator) is None:
                return self._chain()
            landed, self._inflight = self._land(self._inflight), None
        if self.policy is not None:
            self._drafting = self.policy.should_draft(max(1, len(self.scheduler.running)))
        items = self.scheduler.schedule()
        if not items:
            if self.scheduler.has_unfinished() and not landed:
                raise RuntimeError("no request fits in the cache even alone; raise the cache size or lower "
                                   "max_model_len")
            return landed
        self._mark_scheduled(items)
        step = self._model_step(items)
        if (self.config.async_scheduling and self.executor.runs_async(step)
                and all(plain_request(it.seq.request) for it in items)):
            self._inflight = self._launch(items, step)
            return landed
        decode_only = all(s.verify or (s.sample and len(s.seq.token_ids) == 1 and s.seq.num_computed > 0
                                       and not s.prompt_logits) for s in step.items)
        result = self.executor.execute(step)
        for i, logits in result.prompt_logits.items():  # row j predicts token num_computed + j + 1
            it = items[i]
            first = it.alloc.num_computed_tokens + 1
            self.sampler.prompt_logprobs(it.seq.request, first, logits[:it.seq.num_prompt_tokens - first])
        ready = [i for i, s in enumerate(step.items) if s.sample]
        sampled = [items[i].seq.request for i in ready]
        accepted = [0] * len(items)
        if ready and self.spec.enabled:
            kept = self.sampler.verify(sampled, result.logits, result.drafts)
            for i, r, a, d in zip(ready, sampled, kept, result.drafts):
                accepted[i] = a
                if d:
                    r.spec_stats.record(len(d), a)
                    self.spec_stats.record(len(d), a)
        elif ready:
            self.sampler.sample(sampled, result.logits)
        self.executor.finish(step, accepted, [it.seq.request.finished for it in items])
        self.scheduler.update(items, accepted)
        now = time.time()
        for r in sampled:
            if r.metrics.first_token_time is None:
                r.metrics.first_token_time = now
        for it in items:
            if it.seq.request.finished:
                self._seqs.pop(it.seq.request_id, None)
        if self.policy is not None:
            self._record_policy(step, decode_only, sum(accepted) + len(sampled))
        num_verified = sum(s.verify for s in step.items)
        if num_verified and self.spec_stats.num_rounds and self.spec_stats.num_rounds % SPEC_LOG_INTERVAL < num_verified:
            logger.info("speculative decoding: %s", self.spec_stats.summary())
        if landed:  # a request may gain a token twice in one call (landed, then stepped): listed once
            seen = {id(r) for r in landed}
            return landed + [r for r in sampled if id(r) not in seen]
        return sampled

    @staticmethod
    def _mark_scheduled(items: list[ScheduledSeq]) -> None:
        now = time.time()
        for it in items:
            if it.seq.request.metrics.first_scheduled_time is None:
                it.seq.request.metrics.first_scheduled_time = now

    # ---- async scheduling (async_step.py) --------------------------------------------------------
    def _launch(self, items: list[ScheduledSeq], step: ModelStep, input_ids: torch.Tensor | None = None
                ) -> InFlightStep:
        """Run a plain decode step and sample it on the device, without reading its tokens."""
        step.input_ids = input_ids
        result = self.executor.execute(step)
        requests = [it.seq.request for it in items]
        # penalties count each row's unread token: the step's input id (the previous step's sample) when chained
        ids = self.sampler.pick(requests, result.logits, in_flight=input_ids)  # [B] on the device
        logprobs = self.sampler.logprob_values(requests, result.logits, ids)
        self.num_async_steps += 1
        if logprobs is None:
            return InFlightStep(items, PendingTokens(ids))
        return InFlightStep(items, PendingTokens(ids, logprobs[1]), logprob_rows=logprobs[0])

    def _chain(self) -> list[Request]:
        """Plan and launch the step after the in-flight one on placeholders, then land the in-flight one."""
        prev = self._inflight
        rows = prev.kept_rows()  # the rows of requests that had not ended when it launched
        kept = [prev.items[i] for i in rows]
        self.scheduler.update(kept)  # their input tokens were known; none of them ended yet as far as the host knows
        for it in kept:
            it.seq.num_placeholders = 1
        try:
            items = self.scheduler.schedule()
            step = self._model_step(items)
            if [it.seq for it in items] != [it.seq for it in kept] or not self.executor.runs_async(step):
                raise RuntimeError("async scheduling planned a step other than the in-flight one's requests "
                                   "(a bug: chain_blocker let it through); set async_scheduling=False")
            ids = prev.tokens.ids  # [len(prev.items)] on the device
            if len(rows) < len(prev.items):
                ids = ids[device_tensor(rows, torch.long, ids.device)]
            nxt = self._launch(items, step, ids)
        except BaseException:  # the caller aborts what it ran; nothing refers to the placeholders any more
            self._inflight = None
            for it in kept:
                it.seq.num_placeholders = 0
            raise
        self.num_chained_steps += 1
        self._inflight = nxt
        return self._land(prev, nxt)

    def _land(self, step: InFlightStep, successor: InFlightStep | None = None) -> list[Request]:
        """Read an in-flight step's tokens and append them (stop rules). Without `successor`: commit the step now. With
        one (planned on this step's rows that were not dropped; `_chain` committed them): a request that ended here
        leaves `successor` (its row is dropped) and its blocks and slot are freed."""
        token_ids = step.tokens.read()
        requests = [it.seq.request for it in step.items]
        entries = {} if not step.logprob_rows else \
            self.sampler.logprob_rows_entries(requests, token_ids, step.logprob_rows, step.tokens.read_extra())
        now, gained = time.time(), []
        kept = [(i, step.items[i]) for i in step.kept_rows()]
        for i, it in kept:
            r = it.seq.request
            it.seq.num_placeholders = 0
            if i in entries:
                record_logprob(r, entries[i])
            r.append(token_ids[i], self.sampler.eos_token_ids)
            if r.metrics.first_token_time is None:
                r.metrics.first_token_time = now
            gained.append(r)
        if successor is None:
            self.scheduler.update([it for _, it in kept])
        for i, it in kept:
            if it.seq.request.finished:
                if successor is not None:
                    successor.dropped.add(successor.row_of(it.seq.request_id))
                    self.scheduler.finish(it.seq)
                self._seqs.pop(it.seq.request_id, None)
        return gained

    def _record_policy(self, step: ModelStep, decode_only: bool, tokens: int) -> None:
        """Tell the adaptive policy what a pure decode step cost; count the steps it ran without drafts."""
        if decode_only:
            self.num_paused_steps += not self._drafting
            self.policy.record(len(step.items), self._drafting, tokens)

    def _model_step(self, items: list[ScheduledSeq]) -> ModelStep:
        """What the executor runs: per item its tokens, pages, slot, media and what to return."""
        out = []
        for it in items:
            a, seq = it.alloc, it.seq
            start = a.num_computed_tokens
            all_ids = seq.all_token_ids
            # a lone last prompt token that is a media pad runs as a prefill row: verify rows carry no vision rows
            verify = (self._drafting and it.num_new_tokens == 1 and start + 1 == len(all_ids) and start > 0
                      and not (seq.mm is not None and seq.mm.items_in(start, start + 1)))
            out.append(StepItem(
                request_id=seq.request_id,
                seq=StepSequence(token_ids=all_ids[start:start + a.num_new_tokens], num_computed=start,
                                 block_ids=list(self.allocator.block_ids(seq)), slot=a.state_slot),
                alloc=a, mm=seq.mm,
                sample=verify or start + it.num_new_tokens == len(all_ids),  # all known tokens computed
                prompt_logits=seq.skip_prefix_cache and start < seq.num_prompt_tokens - 1,
                verify=verify, num_drafts=a.num_lookahead_tokens if verify else 0,
                all_token_ids=all_ids if self.spec.enabled else [], num_preemptions=seq.num_preemptions))
        return ModelStep(out, self.allocator.take_swap_outs(), [m for it in items for m in it.encode])

    # ---- speculative decoding (spec/) ------------------------------------------------------------
    def _num_drafts(self, seq: SeqState) -> int:
        """Drafts a decoding request verifies this step: k, fewer near max_model_len or its
        max_tokens (no draft could be kept), none without pending drafter rows (just preempted) or
        while the adaptive policy decodes plainly."""
        if not self._drafting or not self.executor.can_draft(seq.request_id, seq.num_computed_tokens, seq.num_preemptions):
            return 0
        r = seq.request
        # a round emits up to drafts + 1 tokens, within max_model_len and the request's max_tokens
        room = min(self.config.max_model_len - r.num_tokens, r.max_tokens - len(r.token_ids)) - 1
        # the concurrency ladder (DFlash2's dflash_concurrency_drafts; all k for MTP) at the running count
        return max(0, min(self.spec.drafts_at(len(self.scheduler.running)), room))


SPEC_LOG_INTERVAL = 64  # verify rounds between acceptance-statistics log lines


def check_draft_kv_dtype(spec: SpeculativeConfig, kv_cache_dtype: str, kv_scales: Mapping, dtype: str) -> None:
    """An E4M3 draft KV cache needs calibrated MTP K/V scales (release note, spec/engine.md §2.8)."""
    draft = resolve_kv_dtype(spec.kv_cache_dtype or kv_cache_dtype, dtype)
    if draft == "fp8_e4m3" and MTP not in kv_scales:
        raise ValueError("the MTP draft KV cache would be fp8_e4m3, but the checkpoint has no calibrated draft K/V "
                         "scales (mtp.layers.0.self_attn.{k,v}_scale); set speculative_config "
                         "{'kv_cache_dtype': 'auto'} for a 16-bit draft cache, or use a checkpoint with MTP scales")


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)

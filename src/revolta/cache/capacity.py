"""Cache planning: memory budget -> block size, KV blocks, state slots -> tokens and concurrency.

Pure arithmetic on the config (no weights, no GPU), so `revolta info --gpu-memory ...` can
plan a deployment (the dry run, revolta/plan.py). Byte counts come from `cache/sizes.py` (kv_bytes_breakdown,
fixed_state_breakdown); `storage.CacheStorage` allocates exactly `CachePlan.storage_bytes`.

Method (spec/engine.md §4.1-4.2, docs/cache.md has a worked example):

    budget      = memory * gpu_memory_utilization - weights - activation peak
                  - CUDA-graph reserve - other (CUDA context, NCCL, allocator slack)
    page        = block_size * KV bytes per token (every QSA layer + MTP layer: K, V, int8
                  scales, compressed index keys); block b's page lines up in every layer
    state pages = cdiv(state bytes per slot, page)   (a slot is charged whole pages, like the
                  mamba page padded to the attention page)
    pool pages  = budget // page;  slots = 1 dummy + max_num_seqs * (1 + per-draft slots)
                  + snapshot slots;  KV blocks = pool pages - slots * state pages (block 0 = null)
    per request = cdiv(L, block_size) + (1 + per-draft slots) * state pages
    "GPU KV cache size"   = (num_blocks - 1) * block_size: what the allocated K/V blocks hold
    max concurrency       = that / (L + drafts), capped at max_num_seqs
    release-note method   = (pool pages - null block - dummy slot) / per request, printed beside it
                            (it counts state as pages of one shared pool; revolta's slots are
                            separate tensors, so it would promise more than is allocated)

DFlash2 (speculative_method "dflash2") adds no MTP layer to the pages; its drafter keeps its own
KV group (`DraftKVGroup`): per running request every full-attention draft layer holds
max_model_len tokens and every sliding-window layer its window, reserved for max_num_seqs
requests before the pool is sized (the drafter's cache is its own tensors, like a per-request
cache; a paged drafter cache would share pool pages instead). State slots per request are the
same rule as MTP: 1 running + 1 prefix snapshot + 1 per draft, i.e. 2 + 7 (the release note's
2 + 7 per GDN cache group: a revolta slot holds every GDN layer), or 2 with replay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..config import ModelConfig
from ..units import human_bytes
from .sizes import KV_DTYPES, fixed_state_breakdown, kv_bytes_breakdown

GiB, MiB = 2**30, 2**20
KERNEL_PAGE = 16  # attention / int8-scale kernels address 16-token pages inside a block
AUTO_BLOCK_SIZE = 256
DEFAULT_CUDAGRAPH_RESERVE_MIB = 700.0  # ReVolta TP4 profile for MTP and non-speculative runs (spec §4.7)
DFLASH2_CUDAGRAPH_RESERVE_MIB = 1200.0  # ReVolta 0.1.3 DFlash2 default, with tail graphs off (spec §4.7)
DEFAULT_OTHER_RESERVE_MIB = 512.0  # CUDA context, NCCL buffers, allocator slack
CPU_TIER_STATE_FRACTION = 0.25  # share of the CPU tier that holds state snapshots

_KV_ALIASES = {"fp16": "fp16", "float16": "fp16", "half": "fp16", "bf16": "bf16", "bfloat16": "bf16",
               "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "int8": "int8",
               "fp32": "fp32", "float32": "fp32"}
_ACT_DTYPES = {"float16": "fp16", "fp16": "fp16", "half": "fp16", "bfloat16": "bf16", "bf16": "bf16",
               "float32": "fp32", "fp32": "fp32"}
_TORCH_NAMES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
WEIGHT_FORMATS = {  # bits per routed-expert parameter; everything else is 16-bit
    "bf16": 16.0, "fp16": 16.0,
    "awq": 4 + 16 / 32 + 4 / 32,  # AWQ g32: 4-bit weights, fp16 scale and 4-bit zero per 32
    "fp8": 8 + 32 / (128 * 128),  # block FP8 with one fp32 scale per 128x128
    "nvfp4": 4 + 8 / 16,  # 4-bit values, fp8 scale per 16
}


class CacheConfigError(ValueError):
    """A cache configuration that cannot work; raised before any weight is loaded, says what to change.
    needed_cache_bytes: for a max_model_len that does not fit, the least cache (MemoryBudget.cache_bytes) that
    holds one sequence of it; else None."""

    def __init__(self, message: str, needed_cache_bytes: int | None = None):
        super().__init__(message)
        self.needed_cache_bytes = needed_cache_bytes


def default_cudagraph_reserve_mib(speculative_method: str | None) -> float:
    """The CUDA-graph reserve when none is given: 1200 MiB for DFlash2, else 700 MiB (spec §4.7)."""
    return DFLASH2_CUDAGRAPH_RESERVE_MIB if speculative_method == "dflash2" else DEFAULT_CUDAGRAPH_RESERVE_MIB


@dataclass(frozen=True, slots=True)
class DraftKVGroup:
    """The DFlash2 drafter's own KV cache: its attention layers (model-wide head counts)."""

    num_layers: int
    num_sliding_layers: int
    sliding_window: int | None
    num_kv_heads: int
    head_dim: int
    kv_cache_dtype: str  # resolved: fp16 | bf16 | fp32 | fp8_e4m3 | int8
    intermediate_size: int = 0  # the drafter's MLP width (0: unknown, the KV heads alone decide the split)

    def bytes_per_token(self, tp: int = 1) -> int:
        """K and V (+ int8 per-token scales) of one draft layer for one token, per GPU. A rank holds num_kv_heads / tp
        heads when tp divides the KV heads and the MLP width, else all of them: the rank drafter's rule
        (spec/dflash2/rank_drafter.py `splits_layers`), whose context store holds the layers' heads."""
        split = tp > 1 and self.num_kv_heads % tp == 0 and self.intermediate_size % tp == 0
        heads = self.num_kv_heads // tp if split else self.num_kv_heads
        elt = 4 if self.kv_cache_dtype == "fp32" else KV_DTYPES[self.kv_cache_dtype]
        return 2 * heads * self.head_dim * elt + (2 * heads * 4 if self.kv_cache_dtype == "int8" else 0)

    def bytes_per_request(self, max_model_len: int, tp: int = 1) -> int:
        """Full layers hold max_model_len tokens, sliding-window layers min(window, max_model_len)."""
        full = self.num_layers - self.num_sliding_layers
        window = min(self.sliding_window or 0, max_model_len)
        return self.bytes_per_token(tp) * (full * max_model_len + self.num_sliding_layers * window)


def resolve_kv_dtype(name: str, dtype: str = "float16") -> str:
    """`auto` -> the activation dtype; aliases -> fp16 | bf16 | fp32 | fp8_e4m3 | int8."""
    act = _act(dtype)
    if name == "auto":
        return act
    try:
        return _KV_ALIASES[name]
    except KeyError:
        raise CacheConfigError(f"kv_cache_dtype={name!r} is not supported; use one of auto, fp16, bf16, "
                               "fp8_e4m3 (alias fp8) or int8") from None


def _act(dtype: str) -> str:
    try:
        return _ACT_DTYPES[str(dtype).removeprefix("torch.")]
    except KeyError:
        raise CacheConfigError(f"activation dtype {dtype!r}; use float16, bfloat16 or float32") from None


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Engine knobs that shape the cache (vLLM names where vLLM has one)."""

    max_model_len: int
    kv_cache_dtype: str = "auto"
    block_size: int | None = None  # None: AUTO_BLOCK_SIZE (capped by max_model_len)
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 8192
    num_speculative_tokens: int = 0  # > 0: drafts per round (MTP: adds the MTP layer's K/V to every page)
    speculative_method: str = "mtp"  # with num_speculative_tokens > 0: "mtp" or "dflash2" (needs draft_kv_group)
    draft_kv_group: DraftKVGroup | None = None  # DFlash2's drafter cache
    spec_state_replay: bool = False  # True: no per-draft state slots (the replay kernel commits in place)
    draft_kv_cache_dtype: str | None = None  # None: inherit kv_cache_dtype
    enable_prefix_caching: bool = True
    num_snapshot_slots: int | None = None  # None: max_num_seqs with prefix caching, else 0
    snapshot_interval: int = 0  # extra snapshots every N tokens of prefill (multiple of block_size)
    kv_offload_gib: float = 0.0  # CPU tier, GiB in total over the TP ranks (pinned host memory)
    pending_ring: int | None = None  # QSA pending index keys per slot; None: default_pending_ring (c + drafts)

    @property
    def num_draft_slots(self) -> int:
        """Per-draft state slots per running request."""
        return 0 if self.spec_state_replay else self.num_speculative_tokens

    @property
    def with_mtp(self) -> bool:
        """The MTP layer's K/V is part of every page."""
        return self.num_speculative_tokens > 0 and self.speculative_method == "mtp"

    @property
    def spec_label(self) -> str:
        if not self.num_speculative_tokens:
            return "off"
        name = "DFlash2" if self.speculative_method == "dflash2" else "MTP"
        return f"{name} x{self.num_speculative_tokens} ({'replay' if self.spec_state_replay else 'per-draft state slots'})"


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    """Per-GPU memory and what is not cache; `cache_bytes` is what the pools may use."""

    gpu_memory_bytes: int
    gpu_memory_utilization: float = 0.9
    weights_bytes: int = 0
    activation_bytes: int = 0
    cudagraph_reserve_bytes: int = int(DEFAULT_CUDAGRAPH_RESERVE_MIB * MiB)
    other_bytes: int = int(DEFAULT_OTHER_RESERVE_MIB * MiB)
    # the cache is a fixed allowance named so (e.g. "kv_cache_gib=0.5"), not what a GPU leaves: errors name it as the fix
    allowance: str | None = None

    @property
    def usable_bytes(self) -> int:
        return int(self.gpu_memory_bytes * self.gpu_memory_utilization)

    @property
    def reserved_bytes(self) -> int:
        return self.weights_bytes + self.activation_bytes + self.cudagraph_reserve_bytes + self.other_bytes

    @property
    def cache_bytes(self) -> int:
        return self.usable_bytes - self.reserved_bytes


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """What `storage.CacheStorage` needs to build the tensors (counts include id 0)."""

    num_blocks: int
    block_size: int
    num_slots: int
    kv_cache_dtype: str  # resolved: fp16 | bf16 | fp8_e4m3 | int8
    draft_kv_cache_dtype: str  # the MTP layer's (resolved)
    dtype: str  # activation dtype of conv/PLE/pending state: float16 | bfloat16 | float32
    tp: int = 1
    with_mtp: bool = False
    pending_ring: int | None = None  # None: default_pending_ring (2 x compress ratio)
    dcp: int = 1  # decode context parallel: the trunk QSA K/V pages hold block_size / dcp tokens (a stripe)


@dataclass(frozen=True, slots=True)
class CachePlan:
    """Sizes and capacity for one configuration; see the module docstring for the method."""

    cache: CacheConfig
    budget: MemoryBudget
    layout: CacheLayout
    kv_bytes_per_token: int
    page_bytes: int
    state_bytes: int  # per slot
    state_pages: int  # per slot, rounded up
    pool_pages: int
    num_running_slots: int  # max_num_seqs * (1 + draft slots)
    num_snapshot_slots: int
    pages_per_request: int
    max_concurrency: float  # requests of max_model_len the allocated KV blocks hold at once
    kv_cache_tokens: int  # tokens the allocated KV blocks hold (block 0 excluded)
    unified_concurrency: float  # the release note's method: state as pages of one shared pool
    num_cpu_blocks: int = 0
    num_cpu_slots: int = 0
    scalar_bytes: int = 0  # per-layer fp8 scales
    draft_kv_bytes_per_request: int = 0  # DFlash2's drafter KV group, per running request

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @property
    def num_slots(self) -> int:
        return self.layout.num_slots

    @property
    def draft_kv_bytes(self) -> int:
        """The drafter KV group reserved for max_num_seqs running requests (not part of `storage_bytes`)."""
        return self.cache.max_num_seqs * self.draft_kv_bytes_per_request

    @property
    def state_slots_per_request(self) -> float:
        """Running slot + per-draft slots + this request's share of the prefix snapshots."""
        return 1 + self.cache.num_draft_slots + self.num_snapshot_slots / self.cache.max_num_seqs

    @property
    def storage_bytes(self) -> int:
        """Bytes of every GPU cache tensor `CacheStorage` allocates for this plan."""
        return self.num_blocks * self.page_bytes + self.num_slots * self.state_bytes + self.scalar_bytes

    @property
    def cpu_storage_bytes(self) -> int:
        return self.num_cpu_blocks * self.page_bytes + self.num_cpu_slots * self.state_bytes + self.scalar_bytes

    def cpu_layout(self) -> CacheLayout | None:
        if not self.num_cpu_blocks:
            return None
        return replace(self.layout, num_blocks=self.num_cpu_blocks, num_slots=self.num_cpu_slots)

    def allocator_config(self):
        from .hybrid import AllocatorConfig

        c = self.cache
        return AllocatorConfig(num_blocks=self.num_blocks, block_size=self.block_size, num_slots=self.num_slots,
                               enable_prefix_caching=c.enable_prefix_caching,
                               per_draft_state=not c.spec_state_replay, snapshot_interval=c.snapshot_interval,
                               num_cpu_blocks=self.num_cpu_blocks, num_cpu_slots=self.num_cpu_slots)

    def capacity_lines(self, on_gpu: bool = True) -> list[str]:
        """The two startup log lines (spec §8.27); a CPU run's cache is no GPU's, so it says "KV cache size"."""
        return [f"{'GPU ' if on_gpu else ''}KV cache size: {self.kv_cache_tokens:,} tokens",
                f"Maximum concurrency for {self.cache.max_model_len:,} tokens per request: "
                f"{self.max_concurrency:.2f}x"]


def choose_block_size(cfg: ModelConfig, cache: CacheConfig) -> int:
    """One block size for every group: a multiple of the 16-token kernel page and of the
    indexer compress ratio c (so index pages hold bs/c whole keys). Auto: 256, or the smallest
    such multiple >= max_model_len when that is shorter."""
    align = math.lcm(KERNEL_PAGE, cfg.text.indexer_compress_ratio)
    if cache.block_size is not None:
        if cache.block_size < 1 or cache.block_size % align:
            raise CacheConfigError(f"block_size={cache.block_size} must be a positive multiple of {align} "
                                   f"(16-token kernel pages and indexer_compress_ratio="
                                   f"{cfg.text.indexer_compress_ratio}); leave it unset for {AUTO_BLOCK_SIZE}")
        return cache.block_size
    auto = max(align, AUTO_BLOCK_SIZE // align * align)
    return min(auto, -(-cache.max_model_len // align) * align)


def kv_page_bytes_per_token(cfg: ModelConfig, kv_dtype: str, draft_dtype: str, with_mtp: bool, tp: int,
                            dcp: int = 1) -> int:
    """Bytes one token occupies across all pages of a block (trunk QSA layers + MTP layer), on one rank: at dcp > 1
    the trunk K/V pages hold block_size / dcp tokens."""

    def breakdown(dt: str, include_mtp: bool) -> dict[str, int]:
        if dt == "fp32":  # fp32 models (CPU parity runs) keep fp32 pages: twice the 16-bit bytes
            return {k: 2 * v for k, v in kv_bytes_breakdown(cfg, "bf16", "compressed", include_mtp, tp, dcp).items()}
        return kv_bytes_breakdown(cfg, dt, "compressed", include_mtp=include_mtp, tp=tp, dcp=dcp)

    trunk = breakdown(kv_dtype, False)["total"]
    if not with_mtp:
        return trunk
    m = breakdown(draft_dtype, True)
    return trunk + m["mtp_main_kv"] + m["mtp_kv_scales"] + m["mtp_index_keys"]


def default_pending_ring(cfg: ModelConfig, num_speculative_tokens: int = 0) -> int:
    """Entries of the per-slot ring of raw index keys: at least max(2c, c + k). A verify step writes the keys
    of its 1 + k rows after up to c - 1 keys of the incomplete group it still needs, so the ring must
    hold c + k of them (spec/model.md §4.6), rounded up to a power of two (the index-compress kernel
    addresses it by position mod its length): 8 for MTP4 at c = 4, 16 for DFlash2's 7 drafts."""
    c = cfg.text.indexer_compress_ratio
    need = max(2 * c, c + num_speculative_tokens)
    return 1 << (need - 1).bit_length()


def state_bytes_per_slot(cfg: ModelConfig, tp: int, dtype: str, with_mtp: bool, pending_ring: int | None = None) -> int:
    """Bytes of one state slot: fixed per-sequence state with conv/PLE/pending in `dtype`."""
    f = fixed_state_breakdown(replace(cfg, dtype=_TORCH_NAMES[_act(dtype)]), include_mtp=with_mtp, tp=tp)
    c1 = cfg.text.indexer_compress_ratio - 1  # summary counts the c-1 keys of an incomplete group
    ring = default_pending_ring(cfg) if pending_ring is None else pending_ring
    pending = f["qsa_pending"] + f["qsa_pending_positions"]
    return f["total"] - pending + pending // c1 * ring


def _scalar_bytes(cfg: ModelConfig, kv_dtype: str, draft_dtype: str, with_mtp: bool) -> int:
    n = cfg.text.num_qsa_layers * (kv_dtype == "fp8_e4m3")
    n += cfg.text.num_mtp_layers * (with_mtp and draft_dtype == "fp8_e4m3")
    return n * 2 * 4  # fp32 k_scale and v_scale per layer


def validate_cache_config(cfg: ModelConfig, cache: CacheConfig, tp: int = 1, dcp: int = 1) -> None:
    """Reject what cannot work, before anything is loaded; messages name the knob to change."""
    def fail(msg: str) -> None:
        raise CacheConfigError(msg)

    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(cache, name) < 1:
            fail(f"{name}={getattr(cache, name)} must be >= 1")
    if tp < 1:
        fail(f"tensor_parallel_size={tp} must be >= 1")
    if dcp < 1 or tp % dcp:
        fail(f"decode_context_parallel_size={dcp} must be >= 1 and divide tensor_parallel_size={tp}")
    resolve_kv_dtype(cache.kv_cache_dtype)
    if cache.draft_kv_cache_dtype is not None:
        resolve_kv_dtype(cache.draft_kv_cache_dtype)
    if cache.num_speculative_tokens < 0:
        fail(f"num_speculative_tokens={cache.num_speculative_tokens} must be >= 0")
    if cache.num_speculative_tokens and cache.speculative_method not in ("mtp", "dflash2"):
        fail(f"speculative_method={cache.speculative_method!r}; use 'mtp' or 'dflash2'")
    if cache.num_speculative_tokens and cache.speculative_method == "dflash2" and cache.draft_kv_group is None:
        fail("speculative_method='dflash2' needs the drafter's KV group (draft_kv_group); plan it from the drafter's "
             "config.json")
    if cache.with_mtp and not cfg.text.num_mtp_layers:
        fail(f"num_speculative_tokens={cache.num_speculative_tokens} needs the checkpoint's MTP layer, and this "
             "config has none (mtp_num_hidden_layers = 0); turn speculative decoding off")
    if cache.kv_offload_gib < 0:
        fail(f"kv_offload_gib={cache.kv_offload_gib} must be >= 0")
    if cache.num_snapshot_slots is not None and cache.num_snapshot_slots < 0:
        fail(f"num_snapshot_slots={cache.num_snapshot_slots} must be >= 0")
    if cache.pending_ring is not None and cache.pending_ring < cfg.text.indexer_compress_ratio - 1:
        fail(f"pending_ring={cache.pending_ring} must hold at least indexer_compress_ratio - 1 = "
             f"{cfg.text.indexer_compress_ratio - 1} keys")
    bs = choose_block_size(cfg, cache)
    if bs % dcp:
        fail(f"block_size={bs} must be a multiple of decode_context_parallel_size={dcp} (each rank holds a stripe of "
             "every block)")
    if cache.snapshot_interval < 0 or cache.snapshot_interval % bs:
        fail(f"snapshot_interval={cache.snapshot_interval} must be a non-negative multiple of block_size={bs}")
    try:
        kv_bytes_breakdown(cfg, "fp16", tp=tp)
        fixed_state_breakdown(cfg, tp=tp)
    except ValueError as e:
        fail(f"tensor_parallel_size={tp}: {e}")


def plan_cache(cfg: ModelConfig, cache: CacheConfig, budget: MemoryBudget, tp: int = 1,
               dtype: str = "float16", dcp: int = 1) -> CachePlan:
    """Size the pools for `budget` (per GPU) and compute the capacity figures; raises
    CacheConfigError when the configuration cannot serve one request of max_model_len. At dcp > 1 a block's trunk
    K/V is split over the dcp ranks sharing a KV head: each rank's page holds 1/dcp of it, so more blocks fit."""
    validate_cache_config(cfg, cache, tp, dcp)
    if not 0 < budget.gpu_memory_utilization <= 1:
        raise CacheConfigError(f"gpu_memory_utilization={budget.gpu_memory_utilization} must be in (0, 1]")
    if budget.cudagraph_reserve_bytes < 0:
        raise CacheConfigError("the CUDA-graph reserve must be >= 0 MiB (0 disables it)")
    kv = resolve_kv_dtype(cache.kv_cache_dtype, dtype)
    draft = resolve_kv_dtype(cache.draft_kv_cache_dtype, dtype) if cache.draft_kv_cache_dtype else kv
    with_mtp = cache.with_mtp
    group = cache.draft_kv_group if cache.num_speculative_tokens and not with_mtp else None
    draft_per_request = 0 if group is None else group.bytes_per_request(cache.max_model_len, tp)
    bs = choose_block_size(cfg, cache)
    kvpt = kv_page_bytes_per_token(cfg, kv, draft, with_mtp, tp, dcp)
    page = bs * kvpt
    if page == 0:  # the paged pool's unit is a KV block: a config without attention layers has none to size
        raise CacheConfigError(f"the config has no full-attention layer (layer_types: {sorted(set(cfg.text.layer_types))}); "
                               "the cache planner needs at least one: add a full_attention layer to layer_types")
    ring = default_pending_ring(cfg, cache.num_speculative_tokens) if cache.pending_ring is None else cache.pending_ring
    state = state_bytes_per_slot(cfg, tp, dtype, with_mtp, ring)
    state_pages = -(-state // page)
    scalars = _scalar_bytes(cfg, kv, draft, with_mtp)
    avail = budget.cache_bytes - scalars - cache.max_num_seqs * draft_per_request
    if avail <= 0 and budget.allowance is None:  # a fixed allowance gets its own error below: the size that works
        drafter = f" + DFlash2 drafter KV {human_bytes(cache.max_num_seqs * draft_per_request)}" if group else ""
        raise CacheConfigError(
            f"no memory left for the KV cache: weights {human_bytes(budget.weights_bytes)} + activations "
            f"{human_bytes(budget.activation_bytes)} + CUDA graphs {human_bytes(budget.cudagraph_reserve_bytes)} + "
            f"other {human_bytes(budget.other_bytes)}{drafter} exceed gpu_memory_utilization x memory = "
            f"{human_bytes(budget.usable_bytes)} by {human_bytes(-avail)}; raise --gpu-memory-utilization, use more "
            "GPUs (--tp), a smaller weight format, or lower --max-num-batched-tokens")
    pool_pages = max(avail, 0) // page
    slots_per_request = 1 + cache.num_draft_slots
    running = cache.max_num_seqs * slots_per_request
    snapshots = cache.num_snapshot_slots
    if snapshots is None:
        snapshots = cache.max_num_seqs if cache.enable_prefix_caching else 0
    num_slots = 1 + running + snapshots
    num_blocks = pool_pages - num_slots * state_pages
    L = cache.max_model_len
    need = -(-(L + cache.num_speculative_tokens) // bs)
    if num_blocks - 1 < need:
        fit = max(0, (num_blocks - 1) * bs - cache.num_speculative_tokens)
        least = budget.cache_bytes - avail + (need + 1 + num_slots * state_pages) * page
        if budget.allowance is not None:  # the fix is the allowance: name the size that holds one sequence
            lower = f", lower max_model_len to {fit:,}" if fit else ""
            raise CacheConfigError(
                f"max_model_len={L:,} needs {need:,} KV blocks of {bs} tokens ({human_bytes(need * page)}) beside "
                f"{num_slots} state slots ({human_bytes(num_slots * state)}), but the KV cache allowance "
                f"{budget.allowance} holds {max(0, num_blocks - 1):,} blocks; raise kv_cache_gib to at least "
                f"{-(-least * 1000 // GiB) / 1000:.3f} (serve: --kv-cache-gib G){lower} or lower max_num_seqs", least)
        raise CacheConfigError(
            f"max_model_len={L:,} needs {need:,} KV blocks of {bs} tokens ({human_bytes(need * page)} per GPU), "
            f"but after {num_slots} state slots ({human_bytes(num_slots * state)}) the pool holds "
            f"{max(0, num_blocks - 1):,} blocks ({human_bytes(max(0, num_blocks - 1) * page)}), i.e. "
            f"{fit:,} tokens; {f'lower --max-model-len to {fit:,} or less, ' if fit else ''}use --kv-cache-dtype "
            "fp8_e4m3, raise --gpu-memory-utilization, use more GPUs (--tp) or lower --max-num-seqs", least)
    per_request = -(-L // bs) + slots_per_request * state_pages + -(-draft_per_request // page)
    # Reported capacity is what the allocated tensors physically hold: the KV blocks (state
    # slots are separate tensors sized for max_num_seqs), capped by the running slots.
    kv_tokens = (num_blocks - 1) * bs
    conc = min(kv_tokens / (L + cache.num_speculative_tokens), float(cache.max_num_seqs))
    # The release note's method counts state as pages of one shared pool; kept for comparison.
    unified = (pool_pages - 1 - state_pages) / per_request
    cpu_blocks = cpu_slots = 0
    if cache.kv_offload_gib > 0:
        host = cache.kv_offload_gib * GiB / tp
        cpu_slots = int(host * CPU_TIER_STATE_FRACTION // state)
        cpu_blocks = int(host * (1 - CPU_TIER_STATE_FRACTION) // page)
        if cpu_slots < 2 or cpu_blocks < 2:  # id 0 is reserved in the CPU pools too
            raise CacheConfigError(f"kv_offload_gib={cache.kv_offload_gib} is too small for one state snapshot "
                                   f"({human_bytes(state)} per rank) and one block; raise it or set 0")
    layout = CacheLayout(num_blocks=num_blocks, block_size=bs, num_slots=num_slots, kv_cache_dtype=kv,
                         draft_kv_cache_dtype=draft, dtype=_TORCH_NAMES[_act(dtype)], tp=tp, with_mtp=with_mtp,
                         pending_ring=ring, dcp=dcp)
    return CachePlan(cache=cache, budget=budget, layout=layout, kv_bytes_per_token=kvpt, page_bytes=page,
                     state_bytes=state, state_pages=state_pages, pool_pages=pool_pages, num_running_slots=running,
                     num_snapshot_slots=snapshots, pages_per_request=per_request, max_concurrency=conc,
                     kv_cache_tokens=kv_tokens, unified_concurrency=unified, num_cpu_blocks=cpu_blocks,
                     num_cpu_slots=cpu_slots, scalar_bytes=scalars, draft_kv_bytes_per_request=draft_per_request)


def fit_max_model_len(cfg: ModelConfig, cache: CacheConfig, budget: MemoryBudget, tp: int = 1,
                      dtype: str = "float16", dcp: int = 1) -> int:
    """The largest max_model_len, up to `cache.max_model_len` and a whole number of the blocks planned for it, whose
    plan fits `budget`; 0 when not even one block does. For a length the user did not choose (the checkpoint's)."""
    bs = choose_block_size(cfg, cache)

    def fits(blocks: int) -> bool:
        try:
            plan_cache(cfg, replace(cache, max_model_len=blocks * bs, block_size=bs), budget, tp, dtype, dcp)
            return True
        except CacheConfigError:
            return False

    lo, hi = 0, cache.max_model_len // bs  # fits(lo) (0 blocks: trivially), the answer is in [lo, hi]
    while lo < hi:  # the cache a length needs grows with it: bisect on the block count
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo * bs


def estimate_activation_bytes(cfg: ModelConfig, tp: int, max_num_batched_tokens: int, max_num_seqs: int,
                              num_speculative_tokens: int = 0, dtype: str = "float16") -> int:
    """Peak transient memory of one forward of `max_num_batched_tokens` tokens on one GPU: the
    HC residual streams (3 live copies) + the largest mixer/MoE workspace + fp32 logits of the
    sampled rows. Attention/indexer scores are assumed tiled by the kernels. An estimate; a real
    run profiles one forward."""
    t, T = cfg.text, max_num_batched_tokens
    ab = 4 if _act(dtype) == "fp32" else 2
    hv = t.linear_num_value_heads // tp
    residual = 3 * T * t.wide_size * ab
    gdn_in = (t.gdn_conv_dim + t.gdn_value_dim) // tp + 2 * hv
    gdn = 2 * T * gdn_in * ab + 2 * T * hv * 4 + -(-T // 64) * hv * t.linear_key_head_dim * t.linear_value_head_dim * 4
    qsa = T * (2 * t.num_attention_heads * t.head_dim + 4 * t.num_key_value_heads * t.head_dim) // tp * ab
    moe = T * t.num_experts_per_tok * (3 * t.moe_intermediate_size // tp + t.hidden_size) * ab + T * t.num_experts * 4
    logits = max_num_seqs * (1 + num_speculative_tokens) * (t.vocab_size // tp) * 4
    return residual + max(gdn, qsa, moe) + logits

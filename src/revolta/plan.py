"""The dry-run planner: what `revolta info DIR --gpu-memory GiB --tp N ...` prints, without weights or a GPU.

It estimates the weights from exact parameter counts (summary.py instantiates the model on the meta device)
and the activation peak from the config, then plans the cache (cache/capacity.py) for that budget:

    print(dry_run_report(cfg, gpu_memory_gib=32, tp=4, max_model_len=524_288, kv_cache_dtype="fp8_e4m3"))

It lives at the CLI level because it needs the model's parameter counts; cache/ itself reads only the config.
"""

from __future__ import annotations

from .cache.capacity import (DEFAULT_OTHER_RESERVE_MIB, WEIGHT_FORMATS, CacheConfig, CacheConfigError, CachePlan,
                             GiB, MemoryBudget, MiB, default_cudagraph_reserve_mib, estimate_activation_bytes,
                             plan_cache, validate_cache_config)
from .units import human_bytes
from .config import ModelConfig
from .summary import parameter_counts


def estimate_weight_bytes(cfg: ModelConfig, tp: int = 1, weight_format: str = "awq",
                          ple_on_gpu: bool = False) -> dict[str, int]:
    """Per-GPU weight bytes from exact parameter counts. Routed experts (trunk + MTP) use the
    format's bits; everything else is 16-bit. Split by TP: experts, embedding/lm_head (vocab
    parallel), GDN/QSA mixers, shared experts, vision, MTP dense. Replicated: hyper-connections,
    final mixer, PLE projections. The PLE table stays off the GPU unless `ple_on_gpu` (then
    stored at 1 byte per value, as the AWQ release ships it, and vocab-parallel split by TP like
    an embedding). An estimate: a real run measures the loaded weights."""
    if weight_format not in WEIGHT_FORMATS:
        raise CacheConfigError(f"weight_format={weight_format!r}; use one of {', '.join(WEIGHT_FORMATS)} "
                               "or pass the measured weights bytes")
    c = parameter_counts(cfg)
    experts = c["routed_experts"] + c["mtp_routed_experts"]
    split = (c["embed_tokens"] + c["lm_head"] + c["gdn_mixers"] + c["qsa_mixers"] + c["moe_shared"] + c["vision"]
             + c["mtp"] - c["mtp_routed_experts"])
    replicated = c["hyper_connections"] + c["final_mixer"] + c["ple_modules"]
    out = {
        "routed_experts": int(experts * WEIGHT_FORMATS[weight_format] / 8) // tp,
        "dense_split": split * 2 // tp,
        "dense_replicated": replicated * 2,
        "ple_table": c["ple_table"] // tp if ple_on_gpu else 0,
    }
    out["total"] = sum(out.values())
    return out


def dry_run_report(cfg: ModelConfig, gpu_memory_gib: float, tp: int, max_model_len: int,
                   kv_cache_dtype: str = "auto", gpu_memory_utilization: float = 0.9,
                   weights_bytes: int | None = None, *, weight_format: str = "awq", dtype: str = "float16",
                   activation_bytes: int | None = None, cudagraph_reserve_mib: float | None = None,
                   other_reserve_mib: float = DEFAULT_OTHER_RESERVE_MIB, drafter_weights_bytes: int = 0,
                   ple_placement: str = "host", ple_source: str = "argument", weights_measured: bool | None = None,
                   dcp: int = 1, **cache_options) -> str:
    """What `revolta info DIR --gpu-memory GiB --tp N --max-model-len L --kv-cache-dtype D` prints:
    the budget, the pool layout and the two capacity lines, computed without weights or a GPU.

    gpu_memory_gib: memory of one GPU. weights_bytes: per-GPU weights when known (else estimated
    for `weight_format`). drafter_weights_bytes: per-GPU weights of a separate drafter, added to
    estimated weights (not to measured ones). ple_placement: where the PLE table lives ("device"
    counts it in the estimated weights; "host" and "disk" leave it out of the GPU budget), ple_source
    where that setting came from; weights_measured: weights_bytes is a measurement, which may or may not
    hold the table (default: whenever weights_bytes is given). dcp: decode-context-parallel size (each rank holds
    1/dcp of its KV head's trunk K/V; the weights are TP's). cache_options: further `CacheConfig` fields (max_num_seqs,
    num_speculative_tokens, enable_prefix_caching, kv_offload_gib, ...).
    Raises CacheConfigError for configurations that cannot work.
    """
    plan = dry_run_plan(cfg, gpu_memory_gib, tp, max_model_len, kv_cache_dtype, gpu_memory_utilization,
                        weights_bytes, weight_format=weight_format, dtype=dtype, activation_bytes=activation_bytes,
                        cudagraph_reserve_mib=cudagraph_reserve_mib, other_reserve_mib=other_reserve_mib,
                        drafter_weights_bytes=drafter_weights_bytes, ple_placement=ple_placement, dcp=dcp,
                        **cache_options)
    measured = weights_bytes is not None if weights_measured is None else weights_measured
    return format_plan(plan, cfg) + ple_plan_line(cfg, tp, ple_placement, ple_source, not measured)


def ple_plan_line(cfg: ModelConfig, tp: int, placement: str, source: str, estimated: bool) -> str:
    """Where the dry run puts the PLE table (spec/engine.md §6.2), at 1 byte per value as the FP8 releases ship it."""
    table = parameter_counts(cfg)["ple_table"]
    if not table:
        return ""
    size = f"{human_bytes(table)} ({human_bytes(table // tp)} per TP rank)"
    if placement == "device":
        where = "in the GPU weights above" + ("" if estimated else " only if --weights-gib counts it")
    elif placement == "host":
        where = ("in pinned host memory, read by the GPU through a mapped view; not in the GPU budget, "
                 "so the KV pool above has that memory")
    else:
        worker = "a PLE worker process" if tp == 1 else "each rank's PLE worker process, which maps only its rows"
        where = (f"left in the checkpoint files, read by {worker} (page cache only); not in the GPU "
                 "budget, so the KV pool above has that memory")
    return f"  PLE table: placement {placement} [{source}]: {size} {where}\n"


def dry_run_plan(cfg: ModelConfig, gpu_memory_gib: float, tp: int, max_model_len: int,
                 kv_cache_dtype: str = "auto", gpu_memory_utilization: float = 0.9,
                 weights_bytes: int | None = None, *, weight_format: str = "awq", dtype: str = "float16",
                 activation_bytes: int | None = None, cudagraph_reserve_mib: float | None = None,
                 other_reserve_mib: float = DEFAULT_OTHER_RESERVE_MIB, drafter_weights_bytes: int = 0,
                 ple_placement: str = "host", dcp: int = 1, **cache_options) -> CachePlan:
    """The `CachePlan` behind `dry_run_report` (same arguments)."""
    if gpu_memory_gib <= 0:
        raise CacheConfigError(f"--gpu-memory={gpu_memory_gib} GiB must be > 0")
    cache = CacheConfig(max_model_len=max_model_len, kv_cache_dtype=kv_cache_dtype, **cache_options)
    validate_cache_config(cfg, cache, tp, dcp)
    if weights_bytes is None:
        weights_bytes = (estimate_weight_bytes(cfg, tp, weight_format, ple_on_gpu=ple_placement == "device")["total"]
                         + drafter_weights_bytes)
    if activation_bytes is None:
        activation_bytes = estimate_activation_bytes(cfg, tp, cache.max_num_batched_tokens, cache.max_num_seqs,
                                                     cache.num_speculative_tokens, dtype)
    method = cache.speculative_method if cache.num_speculative_tokens else None
    graphs = default_cudagraph_reserve_mib(method) if cudagraph_reserve_mib is None else cudagraph_reserve_mib
    if graphs < 0:
        raise CacheConfigError(f"cudagraph reserve {graphs} MiB must be >= 0 (0 disables it)")
    budget = MemoryBudget(gpu_memory_bytes=int(gpu_memory_gib * GiB), gpu_memory_utilization=gpu_memory_utilization,
                          weights_bytes=int(weights_bytes), activation_bytes=int(activation_bytes),
                          cudagraph_reserve_bytes=int(graphs * MiB), other_bytes=int(other_reserve_mib * MiB))
    return plan_cache(cfg, cache, budget, tp, dtype, dcp)


def format_plan(plan: CachePlan, cfg: ModelConfig | None = None) -> str:
    """Human-readable budget, layout and capacity of a plan (the dry-run text)."""
    c, b, lay = plan.cache, plan.budget, plan.layout
    spec = c.spec_label
    kv_dt = lay.kv_cache_dtype + (f" (MTP draft {lay.draft_kv_cache_dtype})"
                                  if lay.with_mtp and lay.draft_kv_cache_dtype != lay.kv_cache_dtype else "")
    g = c.draft_kv_group if plan.draft_kv_bytes_per_request else None
    if g is not None:
        kv_dt += f" (DFlash2 draft {g.kv_cache_dtype})"
    usable_blocks = plan.num_blocks - 1
    kv_tokens = usable_blocks * plan.block_size
    full_len = kv_tokens // c.max_model_len if c.max_model_len else 0
    lines = [
        f"cache plan per GPU (TP {lay.tp}{f', DCP {lay.dcp}' if lay.dcp > 1 else ''}, KV {kv_dt}, activations {lay.dtype}, speculative decoding {spec}, "
        f"prefix caching {'on' if c.enable_prefix_caching else 'off'}):",
        f"  memory: {human_bytes(b.gpu_memory_bytes)} x {b.gpu_memory_utilization:g} = {human_bytes(b.usable_bytes)}",
        f"    - weights {human_bytes(b.weights_bytes)} - activation peak {human_bytes(b.activation_bytes)}"
        f" ({c.max_num_batched_tokens:,}-token batch) - CUDA graphs {human_bytes(b.cudagraph_reserve_bytes)}"
        f" - other {human_bytes(b.other_bytes)}",
        f"    = cache budget {human_bytes(b.cache_bytes)} ({b.cache_bytes:,} B)",
        *([f"  DFlash2 draft KV group: {g.num_layers} layers ({g.num_sliding_layers} sliding, window "
           f"{g.sliding_window}) x {g.bytes_per_token(lay.tp):,} B/token = "
           f"{human_bytes(plan.draft_kv_bytes_per_request)} per request, x {c.max_num_seqs} seqs = "
           f"{human_bytes(plan.draft_kv_bytes)} taken from the budget"] if g is not None else []),
        f"  block: {plan.block_size} tokens x {plan.kv_bytes_per_token:,} B/token = {plan.page_bytes:,} B page "
        f"(every QSA layer{' + MTP layer' if lay.with_mtp else ''}: K, V, compressed index keys"
        f"{', int8 scales' if lay.kv_cache_dtype == 'int8' else ''}"
        f"{f'; this rank holds 1/{lay.dcp} of the trunk K/V' if lay.dcp > 1 else ''})",
        f"  state slot: {plan.state_bytes:,} B ({human_bytes(plan.state_bytes)}: GDN + PLE + QSA pending keys)"
        f" = {plan.state_pages} pages",
        f"  pool: {plan.pool_pages:,} pages = {plan.num_blocks:,} KV blocks (block 0 null) + {plan.num_slots} state "
        f"slots x {plan.state_pages} pages (1 dummy + {plan.num_running_slots} running"
        f"{' and per-draft' if c.num_draft_slots else ''} for {c.max_num_seqs} seqs + {plan.num_snapshot_slots} "
        f"snapshots)",
        f"  allocated: {human_bytes(plan.storage_bytes)} ({plan.storage_bytes:,} B); KV blocks hold "
        f"{kv_tokens:,} tokens = {full_len} full {c.max_model_len:,}-token requests",
        f"  per {c.max_model_len:,}-token request: {-(-c.max_model_len // plan.block_size):,} KV pages + "
        f"{1 + c.num_draft_slots} state slots x {plan.state_pages}"
        f"{f' + {-(-plan.draft_kv_bytes_per_request // plan.page_bytes)} draft KV pages' if g is not None else ''}"
        f" = {plan.pages_per_request:,} pages",
        f"  release-note method (state pages drawn from one shared pool): ({plan.pool_pages:,} - 1 null - "
        f"{plan.state_pages} dummy) / {plan.pages_per_request:,} = {plan.unified_concurrency:.2f}x, i.e. "
        f"{int(plan.unified_concurrency * c.max_model_len):,} tokens; revolta's state slots are separate tensors, "
        "so it reports what its KV blocks hold:",
    ]
    if plan.num_cpu_blocks:
        lines.append(f"  CPU tier: {c.kv_offload_gib:g} GiB / {lay.tp} ranks: {plan.num_cpu_blocks - 1:,} blocks "
                     f"({(plan.num_cpu_blocks - 1) * plan.block_size:,} tokens) + {plan.num_cpu_slots - 1} snapshots "
                     "per rank, pinned host memory")
    if c.num_speculative_tokens:
        snap = plan.num_snapshot_slots / c.max_num_seqs
        lines.append(f"  state slots per request: {plan.state_slots_per_request:g} = 1 running + {snap:g} prefix "
                     f"snapshot + {c.num_draft_slots} per-draft ({'replay' if c.spec_state_replay else 'no replay'}; "
                     "one slot holds every GDN layer, vLLM counts the same per GDN cache group)")
    lines += ["  " + x for x in plan.capacity_lines()]
    return "\n".join(lines) + "\n"

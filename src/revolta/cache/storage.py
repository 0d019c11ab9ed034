"""The cache tensors (GPU, or a pinned-host mirror for the CPU tier) and the copies between them.

Layout, per GPU (one TP rank), sized by `capacity.CachePlan.layout`; kernels are written
against it, keep it exact. Block 0 and slot 0 are the reserved null block / dummy slot.

    per QSA layer i (storage.qsa[i]) and the MTP layer (storage.mtp, when speculating):
      k_cache, v_cache  [num_blocks, block_size, KVH, D]   fp16/bf16 | uint8 (fp8 e4m3 bits) | int8; at DCP the
                        trunk layers' pages hold block_size / dcp tokens (this rank's stripe, parallel/dcp.py)
      k_scale, v_scale  fp8: [] fp32, one per layer (checkpoint `*.self_attn.{k,v}_scale`, else 1.0)
                        int8: [num_blocks, block_size, KVH] fp32, per token and head
                        fp16/bf16: None
      index_cache       [num_blocks, block_size // c, Di]  compressed index keys; the KV dtype for
                        fp16/bf16, e4m3 bits (uint8) for both 1-byte formats
    per GDN layer i (storage.gdn[i]):
      ssm_state         [num_slots, HV, K, V]               fp32
      conv_state        [num_slots, W-1, conv_dim]          activation dtype
    per PLE layer i (storage.ple[i]):
      conv              [num_slots, (W-1)*ngram, h*d]       activation dtype (the last 9 conv inputs)
      context_ids       [num_slots, ngram_size-1]           int64 (EOS-filled for a new sequence)
    QSA pending raw index keys of the incomplete compress block:
      pending_keys[i]   [num_slots, ring, Di]                activation dtype, per QSA layer (+ "mtp")
      pending_positions [num_slots, ring, 3]                 int64 mRoPE positions, shared by the layers

    block_table [B, max_blocks] int32 (null-padded), slot_mapping [T] int64 = block * block_size + offset

KVH, HV and conv_dim are per rank (KV heads replicated when fewer than TP ranks).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import GDN, QSA, ModelConfig
from .capacity import CacheLayout, default_pending_ring
from .sizes import qsa_kv_heads_per_rank
from .hybrid import Allocation, SwapOuts

logger = logging.getLogger(__name__)

_KV_TORCH = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp8_e4m3": torch.uint8,
             "int8": torch.int8}
_INDEX_TORCH = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp8_e4m3": torch.uint8,
                "int8": torch.uint8}
_SCALE_NAME = re.compile(r"(?:model\.language_model\.layers\.(\d+)|mtp\.layers\.\d+)\.self_attn\.([kv])_scale$")

MTP = "mtp"


@dataclass
class QSACache:
    k_cache: Tensor
    v_cache: Tensor
    index_cache: Tensor
    k_scale: Tensor | None = None
    v_scale: Tensor | None = None


@dataclass
class GDNCache:
    ssm_state: Tensor
    conv_state: Tensor


@dataclass
class PLECache:
    conv: Tensor
    context_ids: Tensor


def kv_scales_from_state_dict(tensors: Mapping[str, Tensor]) -> dict[int | str, tuple[float, float]]:
    """Per-layer fp8 K/V scales from checkpoint names (`model.language_model.layers.{i}.self_attn.k_scale`,
    `mtp.layers.0.self_attn.v_scale`, ...) -> {layer index | "mtp": (k_scale, v_scale)}."""
    found: dict[int | str, dict[str, float]] = {}
    for name, t in tensors.items():
        m = _SCALE_NAME.search(name)
        if m:
            key: int | str = int(m.group(1)) if m.group(1) is not None else MTP
            found.setdefault(key, {})[m.group(2)] = float(t.float().reshape(-1)[0])
    return {k: (v.get("k", 1.0), v.get("v", 1.0)) for k, v in found.items()}


class CacheStorage:
    """All cache tensors of one rank for `layout` (see the module docstring for shapes)."""

    def __init__(self, cfg: ModelConfig, layout: CacheLayout, device: str | torch.device = "cpu", *,
                 kv_scales: Mapping[int | str, tuple[float, float]] | None = None, pin_memory: bool = False):
        t, L = cfg.text, layout
        self.layout, self.device, self.eos = layout, torch.device(device), t.eos_token_id
        act = getattr(torch, L.dtype)
        kvh, c = qsa_kv_heads_per_rank(cfg, L.tp), t.indexer_compress_ratio
        if L.block_size % c:
            raise ValueError(f"block_size={L.block_size} is not a multiple of indexer_compress_ratio={c}")
        ring = default_pending_ring(cfg) if L.pending_ring is None else L.pending_ring
        nb, ns, bs = L.num_blocks, L.num_slots, L.block_size
        pin = pin_memory and self.device.type == "cpu" and torch.cuda.is_available()

        def new(shape: Sequence[int], dtype: torch.dtype) -> Tensor:
            return torch.zeros(tuple(shape), dtype=dtype, device=self.device, pin_memory=pin)

        scales = dict(kv_scales or {})
        missing: list[str] = []

        if bs % L.dcp:
            raise ValueError(f"block_size={bs} is not a multiple of decode_context_parallel_size={L.dcp}")

        def qsa(key: int | str, kv_dtype: str) -> QSACache:
            kd = _KV_TORCH[kv_dtype]
            rows = bs if key == MTP else bs // L.dcp  # DCP: a trunk page holds this rank's stripe of the block
            cache = QSACache(new((nb, rows, kvh, t.head_dim), kd), new((nb, rows, kvh, t.head_dim), kd),
                             new((nb, bs // c, t.indexer_head_dim), _INDEX_TORCH[kv_dtype]))
            if kv_dtype == "int8":
                cache.k_scale, cache.v_scale = new((nb, rows, kvh), torch.float32), new((nb, rows, kvh), torch.float32)
            elif kv_dtype == "fp8_e4m3":
                if key not in scales:
                    missing.append(str(key))
                ks, vs = scales.get(key, (1.0, 1.0))
                cache.k_scale = torch.tensor(float(ks), dtype=torch.float32, device=self.device)
                cache.v_scale = torch.tensor(float(vs), dtype=torch.float32, device=self.device)
            return cache

        self.qsa = {i: qsa(i, L.kv_cache_dtype) for i, lt in enumerate(t.layer_types) if lt == QSA}
        self.mtp = qsa(MTP, L.draft_kv_cache_dtype) if L.with_mtp else None
        hv, conv_dim = t.linear_num_value_heads // L.tp, t.gdn_conv_dim // L.tp
        self.gdn = {i: GDNCache(new((ns, hv, t.linear_key_head_dim, t.linear_value_head_dim), torch.float32),
                                new((ns, t.linear_conv_kernel_dim - 1, conv_dim), act))
                    for i, lt in enumerate(t.layer_types) if lt == GDN}
        self.ple = {i: PLECache(new((ns, t.ple_conv_history, t.wide_size), act),
                                new((ns, t.ngram_size - 1), torch.int64))
                    for i in t.ple_layer_indices}
        keys: list[int | str] = list(self.qsa) + ([MTP] if self.mtp is not None else [])
        self.pending_keys = {k: new((ns, ring, t.indexer_head_dim), act) for k in keys}
        self.pending_positions = new((ns, ring, 3), torch.int64)
        if missing:
            logger.warning("fp8_e4m3 KV cache: no k/v scales in the checkpoint for layers %s; using 1.0 "
                           "(values beyond +-448 saturate; calibrated scales give better accuracy)", ", ".join(missing))
        for p in self.ple.values():
            p.context_ids.fill_(self.eos)

    # ---- tensor groups ----------------------------------------------------------------------

    def block_tensors(self) -> list[Tensor]:
        """Every tensor indexed by block id (dim 0), in a fixed order."""
        out = []
        for q in (*self.qsa.values(), *([self.mtp] if self.mtp is not None else [])):
            out += [q.k_cache, q.v_cache, q.index_cache]
            if q.k_scale is not None and q.k_scale.dim() > 0:
                out += [q.k_scale, q.v_scale]
        return out

    def slot_tensors(self, skip_gdn_state: bool = False) -> list[Tensor]:
        """Every tensor indexed by state slot (dim 0), in a fixed order (without the GDN recurrent
        states when `skip_gdn_state`: a speculative commit carries the rest to a per-draft slot)."""
        out = []
        for g in self.gdn.values():
            out += [g.conv_state] if skip_gdn_state else [g.ssm_state, g.conv_state]
        for p in self.ple.values():
            out += [p.conv, p.context_ids]
        return out + list(self.pending_keys.values()) + [self.pending_positions]

    def scalar_tensors(self) -> list[Tensor]:
        qs = (*self.qsa.values(), *([self.mtp] if self.mtp is not None else []))
        return [s for q in qs for s in (q.k_scale, q.v_scale) if s is not None and s.dim() == 0]

    def nbytes(self) -> int:
        """Bytes of all tensors (equals `CachePlan.storage_bytes` for the plan's layout)."""
        return sum(x.numel() * x.element_size()
                   for x in self.block_tensors() + self.slot_tensors() + self.scalar_tensors())

    # ---- copies -------------------------------------------------------------------------------

    def copy_blocks(self, pairs: Iterable[tuple[int, int]], dst: CacheStorage | None = None) -> None:
        """Copy block src (here) -> block dst (in `dst`, default here) for each (src, dst) pair."""
        _copy(self.block_tensors(), (dst or self).block_tensors(), pairs)

    def copy_slots(self, pairs: Iterable[tuple[int, int]], dst: CacheStorage | None = None,
                   skip_gdn_state: bool = False) -> None:
        """Copy state slot src (here) -> slot dst (in `dst`, default here): snapshots, restores, swaps."""
        _copy(self.slot_tensors(skip_gdn_state), (dst or self).slot_tensors(skip_gdn_state), pairs)

    def reset_slots(self, slots: Sequence[int]) -> None:
        """Fresh-sequence state: zeros, and EOS n-gram context ids (spec §5.3)."""
        if not slots:
            return
        idx = torch.tensor(list(slots), dtype=torch.long, device=self.device)
        for x in self.slot_tensors():
            x.index_fill_(0, idx, 0)
        for p in self.ple.values():
            p.context_ids.index_fill_(0, idx, self.eos)

    def pre_forward(self, allocations: Sequence[Allocation], swap_outs: SwapOuts | None = None,
                    cpu: CacheStorage | None = None) -> None:
        """The copies a step needs before its forward, in the only safe order: GPU -> CPU swap-outs
        (their sources may be reused this step), CPU -> GPU swap-ins, prefix-hit slot restores,
        then zeroing the running slots of requests that start from token 0."""
        if swap_outs is not None and (swap_outs.blocks or swap_outs.slots):
            if cpu is None:
                raise ValueError("swap-outs without a CPU tier storage")
            self.copy_blocks(swap_outs.blocks, dst=cpu)
            self.copy_slots(swap_outs.slots, dst=cpu)
        for a in allocations:
            if a.swap_in_blocks or a.swap_in_slots:
                if cpu is None:
                    raise ValueError("swap-ins without a CPU tier storage")
                cpu.copy_blocks(a.swap_in_blocks, dst=self)
                cpu.copy_slots(a.swap_in_slots, dst=self)
        self.copy_slots([p for a in allocations for p in a.slot_copies])
        self.reset_slots([a.state_slot for a in allocations if a.num_computed_tokens == 0])

    def post_forward(self, allocations: Sequence[Allocation]) -> None:
        """Take the snapshots: running state (after the step's definite tokens) -> snapshot slot."""
        self.copy_slots([(a.state_slot, a.snapshot_slot) for a in allocations if a.snapshot_slot])


def _copy(src: list[Tensor], dst: list[Tensor], pairs: Iterable[tuple[int, int]]) -> None:
    pairs = list(dict((d, s) for s, d in pairs).items())  # one copy per destination, the last one wins
    pairs = [(s, d) for d, s in pairs]
    if not pairs:
        return
    ids: dict[tuple[int, torch.device], Tensor] = {}  # one index copy per (side, device), not per tensor

    def index(side: int, device: torch.device) -> Tensor:
        if (side, device) not in ids:
            ids[side, device] = torch.tensor([p[side] for p in pairs], dtype=torch.long, device=device)
        return ids[side, device]

    for s, d in zip(src, dst, strict=True):
        d.index_copy_(0, index(1, d.device), s.index_select(0, index(0, s.device)).to(d.device, non_blocking=True))


def make_block_table(rows: Sequence[Sequence[int]], max_blocks: int, device: str | torch.device = "cpu") -> Tensor:
    """[B, max_blocks] int32 block ids per request, padded with the null block 0."""
    table = torch.zeros(len(rows), max_blocks, dtype=torch.int32)
    for b, ids in enumerate(rows):
        table[b, : len(ids)] = torch.tensor(list(ids), dtype=torch.int32)
    return table.to(device)


def make_slot_mapping(block_ids: Sequence[int], start: int, end: int, block_size: int,
                      device: str | torch.device = "cpu") -> Tensor:
    """[end - start] int64 KV write addresses: block_ids[p // block_size] * block_size + p % block_size."""
    pos = torch.arange(start, end)
    blocks = torch.tensor(list(block_ids), dtype=torch.int64)[pos // block_size]
    return (blocks * block_size + pos % block_size).to(device)

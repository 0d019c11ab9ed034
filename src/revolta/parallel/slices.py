"""Which part of each full checkpoint tensor a rank holds: `tensor_slices(name, ...)` (docs/parallel.md).

A dim and a list of [start, end) ranges along it, concatenated in order (a fused q ‖ k ‖ v projection takes
one range from each part); None: the tensor is replicated. Used by parallel/shard.py (slicing a state dict,
building a rank's model), parallel/load.py (reading only those ranges of a memory-mapped checkpoint) and
parallel/packed.py (a packed tensor follows its 16-bit weight's split in its stored layout).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..config import TextConfig
from .layers import vocab_range


@dataclass(frozen=True)
class Slices:
    """Rank's tensor = cat(full.narrow(dim, s, e - s) for s, e in ranges), zero-padded along `dim` to `size`
    rows when the ranges fall short (the vocabulary's last rank)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    size: int

    def take(self, full: Tensor) -> Tensor:
        parts = [full.narrow(self.dim, s, e - s) for s, e in self.ranges]
        got = sum(e - s for s, e in self.ranges)
        if got < self.size:
            pad = list(full.shape)
            pad[self.dim] = self.size - got
            parts.append(full.new_zeros(pad))
        return torch.cat(parts, dim=self.dim)


def local_text_config(t: TextConfig, tp: int) -> TextConfig:
    """The per-rank text geometry: query / GDN heads and expert widths divided by tp; KV heads divided, or
    one per rank (replicated) when tp > kv_heads. The indexer is replicated (its top-k needs every head's
    score), as are HC, norms and the PLE layer."""
    return replace(t, num_attention_heads=t.num_attention_heads // tp,
                   num_key_value_heads=max(1, t.num_key_value_heads // tp),
                   linear_num_key_heads=t.linear_num_key_heads // tp,
                   linear_num_value_heads=t.linear_num_value_heads // tp,
                   moe_intermediate_size=t.moe_intermediate_size // tp,
                   shared_expert_intermediate_size=t.shared_expert_intermediate_size // tp)


def _rows(r: int, n: int, tp: int, offset: int = 0, unit: int = 1) -> tuple[int, int]:
    """Rank r's equal part of n items (each `unit` wide) starting at `offset`."""
    per = n // tp * unit
    return offset + r * per, offset + (r + 1) * per


_GDN = re.compile(r"\.linear_attn\.(in_proj_qkv\.weight|conv1d\.weight|in_proj_z\.weight|in_proj_[ab]\.weight|"
                  r"A_log|dt_bias|out_proj\.weight)$")
_QSA = re.compile(r"\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)$")
_MOE = re.compile(r"\.mlp\.(experts\.gate_up_proj|experts\.down_proj|shared_expert\.(gate_proj|up_proj|down_proj)"
                  r"\.weight)$")
_VOCAB = ("model.language_model.embed_tokens.weight", "lm_head.weight")


def tensor_slices(name: str, t: TextConfig, rank: int, tp: int) -> Slices | None:
    """Rank `rank`'s pieces of the full tensor `name` of text geometry `t` (module docstring); None: replicated."""
    if tp == 1:
        return None
    if name in _VOCAB:
        start, end, rows = vocab_range(t.vocab_size, rank, tp)
        return Slices(0, ((start, end),), rows)
    if m := _GDN.search(name):
        what = m.group(1)
        kd, vd, hv = t.linear_key_head_dim, t.linear_value_head_dim, t.linear_num_value_heads
        q = _rows(rank, t.linear_num_key_heads, tp, 0, kd)
        k = _rows(rank, t.linear_num_key_heads, tp, t.gdn_key_dim, kd)
        v = _rows(rank, hv, tp, 2 * t.gdn_key_dim, vd)
        if what in ("in_proj_qkv.weight", "conv1d.weight"):  # q ‖ k ‖ v, each split by its own heads
            return Slices(0, (q, k, v), t.gdn_conv_dim // tp)
        if what == "in_proj_z.weight":
            return Slices(0, (_rows(rank, hv, tp, 0, vd),), t.gdn_value_dim // tp)
        if what == "out_proj.weight":
            return Slices(1, (_rows(rank, hv, tp, 0, vd),), t.gdn_value_dim // tp)
        return Slices(0, (_rows(rank, hv, tp),), hv // tp)  # in_proj_a/b, A_log, dt_bias: one per value head
    if m := _QSA.search(name):
        proj, d, h, kv = m.group(1), t.head_dim, t.num_attention_heads, t.num_key_value_heads
        if proj == "q_proj":  # per head [query | gate]: 2 * head_dim rows per head
            return Slices(0, (_rows(rank, h, tp, 0, 2 * d),), 2 * h * d // tp)
        if proj == "o_proj":
            return Slices(1, (_rows(rank, h, tp, 0, d),), h * d // tp)
        if tp <= kv:
            return Slices(0, (_rows(rank, kv, tp, 0, d),), kv * d // tp)
        head = rank // (tp // kv)  # the KV head this rank's query heads read, shared with tp / kv ranks
        return Slices(0, ((head * d, (head + 1) * d),), d)
    if m := _MOE.search(name):
        what = m.group(1)
        i, s = t.moe_intermediate_size, t.shared_expert_intermediate_size
        if what == "experts.gate_up_proj":  # [E, 2I, H]: gate rows then up rows, each split
            return Slices(1, (_rows(rank, i, tp), _rows(rank, i, tp, i)), 2 * i // tp)
        if what == "experts.down_proj":  # [E, H, I]
            return Slices(2, (_rows(rank, i, tp),), i // tp)
        if what == "shared_expert.down_proj.weight":
            return Slices(1, (_rows(rank, s, tp),), s // tp)
        return Slices(0, (_rows(rank, s, tp),), s // tp)
    return None

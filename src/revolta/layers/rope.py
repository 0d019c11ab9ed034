"""Rotary position embedding: partial rotary, interleaved mRoPE sections, YaRN (spec §2.7)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..config import RopeConfig
from ..kernels.rope import apply_rope_ref as apply_rope  # the torch reference lives beside its kernel


def rope_inv_freq(rope: RopeConfig, rotary_dim: int) -> tuple[Tensor, float]:
    """Inverse frequencies [rotary_dim // 2] (fp32) and the cos/sin scale (YaRN attention factor)."""
    base = rope.rope_theta
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    if rope.rope_type != "yarn":
        return inv_freq.float(), 1.0
    factor = rope.factor
    orig = rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (rotary_dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1.0 - ramp  # 1 for high-frequency dims (kept), 0 for low ones (interpolated)
    inv_freq = (inv_freq / factor) * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
    scale = rope.attention_factor if rope.attention_factor is not None else (
        0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv_freq.float(), float(scale)


def mrope_row_index(num_freqs: int, section: tuple[int, ...], interleaved: bool) -> Tensor:
    """For each frequency j, which position row (0=T, 1=H, 2=W) drives it. [num_freqs] long."""
    rows = torch.zeros(num_freqs, dtype=torch.long)
    if interleaved:
        for row, offset in ((1, 1), (2, 2)):
            rows[offset : section[row] * 3 : 3] = row
    else:
        rows[section[0] : section[0] + section[1]] = 1
        rows[section[0] + section[1] :] = 2
    return rows


class RotaryEmbedding(nn.Module):
    """cos/sin tables for 3-row mRoPE positions. Text tokens carry the same value on all rows."""

    def __init__(self, rope: RopeConfig, rotary_dim: int):
        super().__init__()
        self.rope, self.rotary_dim = rope, rotary_dim
        self.register_buffer("inv_freq", torch.empty(rotary_dim // 2), persistent=False)
        self.register_buffer("rows", torch.empty(rotary_dim // 2, dtype=torch.long), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)compute the derived tables, e.g. after materialising a meta-device model."""
        inv_freq, self.scale = rope_inv_freq(self.rope, self.rotary_dim)
        rows = mrope_row_index(self.rotary_dim // 2, self.rope.mrope_section, self.rope.mrope_interleaved)
        if self.inv_freq.device.type != "meta":
            self.inv_freq.copy_(inv_freq)
            self.rows.copy_(rows)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions: [3, T] long -> (cos, sin), each [T, rotary_dim] fp32."""
        # angle_j(t) = P[row(j), t] * inv_freq_j
        pos = positions.to(self.inv_freq.device).float()  # [3, T]
        picked = pos.index_select(0, self.rows)  # [F, T]: row(j) of each frequency
        angles = picked.t() * self.inv_freq  # [T, F]
        angles = torch.cat([angles, angles], dim=-1)  # [T, rotary_dim]
        return angles.cos() * self.scale, angles.sin() * self.scale

"""Rotary embedding kernels: rotate-half (NeoX) on the first R dims of a head, interleaved mRoPE tables
(spec/model.md §2.7).

  * `apply_rope(x [T, H, D], cos [T, R], sin [T, R], inplace=False)`: fp32 math, one rounding; the
    pass-through dims R..D are copied (out of place) or left alone (in place). x may be a strided view
    (e.g. the query half of the interleaved [query | gate] q_proj output); the last dim is contiguous.
  * `mrope_cos_sin(positions [3, T], inv_freq [R/2], rows [R/2], scale)`: angle_j(t) =
    P[rows_j, t] · inv_freq_j, tables [cos(angles) ‖ cos(angles)]·scale (and sin), fp32 [T, R].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

def apply_rope_ref(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half (NeoX) RoPE on the first rotary_dim features of every head.

    x: [T, H, D]; cos/sin: [T, R] fp32, R <= D. Computed in fp32, rounded once to x.dtype.
    """
    r = cos.shape[-1]
    xf = x.float()
    rot, rest = xf[..., :r], xf[..., r:]
    x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = rot * c + torch.cat([-x2, x1], dim=-1) * s
    return torch.cat([rotated, rest], dim=-1).to(x.dtype)


@triton.jit
def _rope_kernel(x, cos, sin, y, H, D, R2, stride_xt, stride_xh, stride_yt, stride_yh, stride_c,
                 BLOCK_H: tl.constexpr, BLOCK_R2: tl.constexpr, BLOCK_REST: tl.constexpr,
                 COPY_REST: tl.constexpr):
    i_t = tl.program_id(0).to(tl.int64)
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    o_j = tl.arange(0, BLOCK_R2)
    m_j = o_j < R2
    m = m_h[:, None] & m_j[None, :]
    p_x = x + i_t * stride_xt + o_h[:, None].to(tl.int64) * stride_xh
    p_y = y + i_t * stride_yt + o_h[:, None].to(tl.int64) * stride_yh
    b_x1 = tl.load(p_x + o_j[None, :], mask=m, other=0.0).to(tl.float32)  # [BH, R/2]
    b_x2 = tl.load(p_x + R2 + o_j[None, :], mask=m, other=0.0).to(tl.float32)
    b_c1 = tl.load(cos + i_t * stride_c + o_j, mask=m_j, other=0.0)[None, :]
    b_c2 = tl.load(cos + i_t * stride_c + R2 + o_j, mask=m_j, other=0.0)[None, :]
    b_s1 = tl.load(sin + i_t * stride_c + o_j, mask=m_j, other=0.0)[None, :]
    b_s2 = tl.load(sin + i_t * stride_c + R2 + o_j, mask=m_j, other=0.0)[None, :]
    tl.store(p_y + o_j[None, :], (b_x1 * b_c1 - b_x2 * b_s1).to(y.dtype.element_ty), mask=m)
    tl.store(p_y + R2 + o_j[None, :], (b_x2 * b_c2 + b_x1 * b_s2).to(y.dtype.element_ty), mask=m)
    if COPY_REST:
        for d0 in range(2 * R2, D, BLOCK_REST):
            o_d = d0 + tl.arange(0, BLOCK_REST)
            m_r = m_h[:, None] & (o_d < D)[None, :]
            tl.store(p_y + o_d[None, :], tl.load(p_x + o_d[None, :], mask=m_r), mask=m_r)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, inplace: bool = False) -> Tensor:
    """Triton version of `apply_rope_ref`. With `inplace`, x is rotated in place and returned."""
    assert x.dim() == 3 and x.stride(-1) == 1, (x.shape, x.stride())
    T, H, D = x.shape
    R = cos.shape[-1]
    assert cos.shape == sin.shape == (T, R) and R % 2 == 0 and R <= D, (x.shape, cos.shape, sin.shape)
    assert cos.dtype == sin.dtype == torch.float32 and cos.stride(-1) == 1 and cos.stride() == sin.stride()
    y = x if inplace else torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    if T == 0 or H == 0:
        return y
    block_h = min(triton.next_power_of_2(H), 16)
    copy_rest = (not inplace) and D > R
    _rope_kernel[(T, triton.cdiv(H, block_h))](
        x, cos, sin, y, H, D, R // 2, x.stride(0), x.stride(1), y.stride(0), y.stride(1), cos.stride(0),
        BLOCK_H=block_h, BLOCK_R2=triton.next_power_of_2(R // 2),
        BLOCK_REST=triton.next_power_of_2(max(D - R, 1)) if copy_rest else 1, COPY_REST=copy_rest,
        num_warps=4 if block_h * D >= 2048 else 1)
    return y


def mrope_cos_sin_ref(positions: Tensor, inv_freq: Tensor, rows: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """positions: [3, T] int; inv_freq: [F] fp32; rows: [F] int (0 = T, 1 = H, 2 = W). -> cos, sin [T, 2F] fp32.

    The math of RotaryEmbedding.forward.
    """
    pos = positions.to(inv_freq.device).float()
    angles = pos.index_select(0, rows.long()).t() * inv_freq  # [T, F]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * scale, angles.sin() * scale


@triton.jit
def _mrope_kernel(positions, inv_freq, rows, cos, sin, T, F, stride_p, scale,
                  BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr):
    o_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    m_t = o_t < T
    o_f = tl.arange(0, BLOCK_F)
    m_f = o_f < F
    b_row = tl.load(rows + o_f, mask=m_f, other=0).to(tl.int64)
    b_inv = tl.load(inv_freq + o_f, mask=m_f, other=0.0)
    m = m_t[:, None] & m_f[None, :]
    b_pos = tl.load(positions + b_row[None, :] * stride_p + o_t[:, None], mask=m, other=0).to(tl.float32)
    b_ang = b_pos * b_inv[None, :]  # [BT, F]
    b_c = tl.cos(b_ang) * scale
    b_s = tl.sin(b_ang) * scale
    p = o_t[:, None].to(tl.int64) * (2 * F) + o_f[None, :]
    tl.store(cos + p, b_c, mask=m)
    tl.store(cos + p + F, b_c, mask=m)
    tl.store(sin + p, b_s, mask=m)
    tl.store(sin + p + F, b_s, mask=m)


def mrope_cos_sin(positions: Tensor, inv_freq: Tensor, rows: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Triton version of `mrope_cos_sin_ref`."""
    assert positions.dim() == 2 and positions.shape[0] == 3 and positions.stride(-1) == 1, positions.shape
    F = inv_freq.shape[0]
    assert rows.shape == (F,) and inv_freq.dtype == torch.float32 and inv_freq.is_contiguous() and rows.is_contiguous()
    T = positions.shape[1]
    cos = torch.empty(T, 2 * F, dtype=torch.float32, device=inv_freq.device)
    sin = torch.empty_like(cos)
    if T == 0:
        return cos, sin
    block_t = 16
    _mrope_kernel[(triton.cdiv(T, block_t),)](positions, inv_freq, rows, cos, sin, T, F, positions.stride(0),
                                              float(scale), BLOCK_T=block_t, BLOCK_F=triton.next_power_of_2(F))
    return cos, sin

"""Zero-centred RMSNorm then RoPE in one launch: QSA's q/k norms and the indexer's query norm (spec §4.2).

At decode each of these is a per-head norm over a handful of heads followed by a rotation: as torch ops the
norm alone is ~10 kernels (cast, pow, mean, add, rsqrt, mul, cast, add, mul, cast) plus the RoPE kernel, so
the three of a QSA layer were 33 launches moving a few KB. Here: one program per (token, head tile) loads
the head row once, normalises it, rounds to x.dtype (the layer's rounding between norm and RoPE) and rotates
the first R features in fp32 with one more rounding, as `apply_rope` does.

  * `zc_norm_rope(x [T, H, D], w [D], eps, cos [T, R], sin [T, R])` -> [T, H, D] contiguous;
    x may be a strided view (the query half of the interleaved [query | gate] q_proj output), its last
    dimension contiguous.

Numerics: equal to `zc_norm_rope_ref` (= `apply_rope_ref(zc_rms_norm_ref(x))`) up to the order of the
sum of squares and the hardware rsqrt (an ulp of the rounded norm), not bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .norm import zc_rms_norm_ref
from .rope import apply_rope_ref


def zc_norm_rope_ref(x: Tensor, w: Tensor, eps: float, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, H, D]; w: [D] (scale 1 + w); cos/sin: [T, R] fp32 -> RoPE(ZCRMSNorm(x)) [T, H, D] in x.dtype."""
    return apply_rope_ref(zc_rms_norm_ref(x, w, eps), cos, sin)


@triton.jit
def _normed(p_x, w, o, m, b_r, dtype):
    """(x·rstd·(1 + w)) at offsets o, rounded to the output dtype (the layer's norm output), as fp32."""
    b_x = tl.load(p_x + o, mask=m, other=0.0).to(tl.float32)
    b_w = tl.load(w + o, mask=m, other=0.0).to(tl.float32)
    return (b_x * b_r * (1.0 + b_w)).to(dtype).to(tl.float32)


@triton.jit
def _zc_norm_rope_kernel(x, w, cos, sin, y, H, D, R2, stride_xt, stride_xh, stride_yt, stride_yh, stride_c, eps,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R2: tl.constexpr):
    i_t = tl.program_id(0).to(tl.int64)
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    o_d = tl.arange(0, BLOCK_D)
    p_x = x + i_t * stride_xt + o_h[:, None].to(tl.int64) * stride_xh  # [BH, 1]
    p_y = y + i_t * stride_yt + o_h[:, None].to(tl.int64) * stride_yh
    m = m_h[:, None] & (o_d < D)[None, :]
    b_x = tl.load(p_x + o_d[None, :], mask=m, other=0.0).to(tl.float32)  # [BH, BD]
    b_r = tl.rsqrt(tl.sum(b_x * b_x, 1) / D + eps)[:, None]  # [BH, 1]
    dtype = y.dtype.element_ty
    # features past the rotary part: the norm's output as it is
    b_n = _normed(p_x, w, o_d[None, :], m, b_r, dtype)
    tl.store(p_y + o_d[None, :], b_n.to(dtype), mask=m & (o_d >= 2 * R2)[None, :])
    # rotary halves: the same elementwise norm at offsets j and R/2 + j, then apply_rope's arithmetic
    o_j = tl.arange(0, BLOCK_R2)
    m_j = o_j < R2
    mr = m_h[:, None] & m_j[None, :]
    b_x1 = _normed(p_x, w, o_j[None, :], mr, b_r, dtype)
    b_x2 = _normed(p_x, w, R2 + o_j[None, :], mr, b_r, dtype)
    b_c1 = tl.load(cos + i_t * stride_c + o_j, mask=m_j, other=0.0)[None, :]
    b_c2 = tl.load(cos + i_t * stride_c + R2 + o_j, mask=m_j, other=0.0)[None, :]
    b_s1 = tl.load(sin + i_t * stride_c + o_j, mask=m_j, other=0.0)[None, :]
    b_s2 = tl.load(sin + i_t * stride_c + R2 + o_j, mask=m_j, other=0.0)[None, :]
    tl.store(p_y + o_j[None, :], (b_x1 * b_c1 - b_x2 * b_s1).to(dtype), mask=mr)
    tl.store(p_y + R2 + o_j[None, :], (b_x2 * b_c2 + b_x1 * b_s2).to(dtype), mask=mr)


def norm_rope_block_h(H: int, D: int) -> int:
    """Heads per program: up to ~2K elements. Depends only on H and D, so a token's result does not
    depend on the batch."""
    return min(triton.next_power_of_2(H), max(1, 2048 // triton.next_power_of_2(D)))


def zc_norm_rope(x: Tensor, w: Tensor, eps: float, cos: Tensor, sin: Tensor) -> Tensor:
    """Triton version of `zc_norm_rope_ref` (one launch)."""
    assert x.dim() == 3 and x.stride(-1) == 1, (x.shape, x.stride())
    T, H, D = x.shape
    R = cos.shape[-1]
    assert w.shape == (D,) and w.is_contiguous(), (w.shape, D)
    assert cos.shape == sin.shape == (T, R) and R % 2 == 0 and R <= D, (x.shape, cos.shape, sin.shape)
    assert cos.dtype == sin.dtype == torch.float32 and cos.stride(-1) == 1 and cos.stride() == sin.stride()
    y = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    if T == 0 or H == 0:
        return y
    block_h = norm_rope_block_h(H, D)
    block_d = triton.next_power_of_2(D)
    _zc_norm_rope_kernel[(T, triton.cdiv(H, block_h))](
        x, w, cos, sin, y, H, D, R // 2, x.stride(0), x.stride(1), y.stride(0), y.stride(1), cos.stride(0), eps,
        BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_R2=triton.next_power_of_2(R // 2),
        num_warps=4 if block_h * block_d >= 2048 else 1)
    return y

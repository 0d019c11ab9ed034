"""HyperConnection write: x_b <- x_b + inj_b · u for every branch b (spec/model.md §2.3), in x.dtype exactly as
the layer (the product rounded, then the sum). `hc_combine` is one launch and bitwise equal to `hc_combine_ref`;
`kernels.hc.hc_combine_read` applies the same arithmetic inside the next HC read's down pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


def hc_combine_ref(x: Tensor, inject: Tensor, out: Tensor) -> Tensor:
    """HyperConnection.combine: x_b + inject_b · out. x: [M, h·d], inject: [M, h], out: [M, d]."""
    return x + (inject.unsqueeze(-1) * out.unsqueeze(-2)).flatten(-2)


def hc_combine_once_ref(x: Tensor, inject: Tensor, out: Tensor) -> Tensor:
    """x_b + inject_b · out in fp32, rounded once to x.dtype: what `kernels.hc.hc_combine_read` stores (for 16-bit
    inputs the fp32 product is exact, so the result does not depend on FMA contraction)."""
    y = x.float() + (inject.float().unsqueeze(-1) * out.float().unsqueeze(-2)).flatten(-2)
    return y.to(x.dtype)


@triton.jit
def _hc_combine_kernel(x, inject, u, y, D, stride_x, stride_i, stride_u, stride_y,
                       NH: tl.constexpr, BLOCK: tl.constexpr):
    i_m = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1)
    o_c = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    m_c = o_c < D
    b_x = tl.load(x + i_m * stride_x + i_b * D + o_c, mask=m_c, other=0.0)
    b_u = tl.load(u + i_m * stride_u + o_c, mask=m_c, other=0.0)
    b_w = tl.load(inject + i_m * stride_i + i_b)
    # the layer's rounding: product in x.dtype, then the sum in x.dtype
    b_p = (b_w.to(tl.float32) * b_u.to(tl.float32)).to(b_x.dtype)
    tl.store(y + i_m * stride_y + i_b * D + o_c, (b_x.to(tl.float32) + b_p.to(tl.float32)).to(y.dtype.element_ty), mask=m_c)


def hc_combine(x: Tensor, inject: Tensor, out: Tensor, inplace: bool = False) -> Tensor:
    """Triton version of `hc_combine_ref`; bitwise equal to it. `inplace` writes into x."""
    M, wide = x.shape
    h = inject.shape[-1]
    d = wide // h
    assert inject.shape == (M, h) and out.shape == (M, d) and wide == h * d, (x.shape, inject.shape, out.shape)
    assert x.stride(-1) == 1 and out.stride(-1) == 1 and inject.stride(-1) == 1
    assert x.dtype == inject.dtype == out.dtype, (x.dtype, inject.dtype, out.dtype)
    y = x if inplace else torch.empty_like(x)
    if M == 0:
        return y
    block = min(1024, triton.next_power_of_2(d))
    # no FMA contraction: with fp fusion on (Triton's default) the product and the sum fuse into one
    # FMA, which skips the product's rounding to x.dtype and breaks bitwise equality with the layer
    # (measured on an H200: 23% of elements differed by an ulp)
    _hc_combine_kernel[(M, h, triton.cdiv(d, block))](x, inject, out, y, d, x.stride(0), inject.stride(0),
                                                      out.stride(0), y.stride(0), NH=h, BLOCK=block,
                                                      enable_fp_fusion=False)
    return y

"""The GDN decay and write gates in one launch (spec/model.md §3.4):

    beta = σ(b)                               [T, HV] fp32
    g    = -exp(A_log) · softplus(a + dt_bias)  [T, HV] fp32

from the in-projections' outputs a, b [T, HV] (model dtype) and the fp32 A_log, dt_bias [HV]. As torch ops
this was 8 kernels per GDN layer (two casts, sigmoid, exp, neg, add, softplus, mul) on a few dozen values;
one program per token row here.

Numerics: fp32 throughout like the reference; softplus keeps torch's threshold (x > 20: x) and computes
log1p(exp(x)) without cancellation, so the result is within a few fp32 ulps of `gdn_gates_ref`, not bitwise
(exp / log are the hardware's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor


def gdn_gates_ref(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """a, b: [T, HV]; A_log, dt_bias: [HV] -> (g [T, HV], beta [T, HV]), fp32 (GatedDeltaNet.forward)."""
    beta = torch.sigmoid(b.float())
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, beta


@triton.jit
def gate_values(b_a, b_b, b_A, b_dt):
    """fp32 (g, beta) from fp32 a, b, A_log, dt_bias (elementwise; also run inside the recurrent decode kernel,
    kernels/gdn/recurrent.py, so both give the same bits)."""
    b_x = b_a + b_dt
    # log1p(e) = log(u) · e / (u - 1) with u = 1 + e (exact to an ulp; e itself where u rounds to 1)
    b_e = tl.exp(tl.minimum(b_x, 20.0))
    b_u = 1.0 + b_e
    b_lp = tl.where(b_u == 1.0, b_e, tl.log(b_u) * (b_e / tl.where(b_u == 1.0, 1.0, b_u - 1.0)))
    b_sp = tl.where(b_x > 20.0, b_x, b_lp)  # torch's softplus threshold
    return -tl.exp(b_A) * b_sp, tl.sigmoid(b_b)


@triton.jit
def _gdn_gates_kernel(a, b, A_log, dt_bias, g, beta, HV, stride_a, stride_b, BLOCK: tl.constexpr):
    i_t = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BLOCK)
    m = o < HV
    b_a = tl.load(a + i_t * stride_a + o, mask=m, other=0.0).to(tl.float32)
    b_b = tl.load(b + i_t * stride_b + o, mask=m, other=0.0).to(tl.float32)
    b_A = tl.load(A_log + o, mask=m, other=0.0).to(tl.float32)
    b_dt = tl.load(dt_bias + o, mask=m, other=0.0).to(tl.float32)
    b_g, b_beta = gate_values(b_a, b_b, b_A, b_dt)
    tl.store(g + i_t * HV + o, b_g, mask=m)
    tl.store(beta + i_t * HV + o, b_beta, mask=m)


def gdn_gates(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """Triton version of `gdn_gates_ref`; a, b may be row-strided views (last dim contiguous)."""
    assert a.dim() == 2 and a.shape == b.shape and a.stride(-1) == 1 and b.stride(-1) == 1, (a.shape, b.shape)
    T, HV = a.shape
    assert A_log.shape == dt_bias.shape == (HV,) and A_log.is_contiguous() and dt_bias.is_contiguous()
    g = torch.empty(T, HV, dtype=torch.float32, device=a.device)
    beta = torch.empty(T, HV, dtype=torch.float32, device=a.device)
    if T == 0:
        return g, beta
    _gdn_gates_kernel[(T,)](a, b, A_log, dt_bias, g, beta, HV, a.stride(0), b.stride(0),
                            BLOCK=triton.next_power_of_2(HV), num_warps=1)
    return g, beta

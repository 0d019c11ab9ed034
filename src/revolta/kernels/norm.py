"""RMSNorm kernels (spec/model.md §2.1, §3.6): fp32 statistics, one rounding to the input dtype.

  * `zc_rms_norm(x, w, eps, group_size)`: zero-centred (1 + w) RMSNorm, one statistic per group of
    `group_size` features (the grouped form of the wide HyperConnection tensors, the PLE norms;
    q/k norms with group_size = head_dim on a flattened [T, heads·head_dim] view).
  * `gated_rms_norm(o, w, z, eps, activation)`: the GDN output norm RMS(o)·w·act(z), fp32 chain.

One program per (row, group); the group is loaded once (BLOCK = next power of two of the group,
up to 16384 features). Rows may be strided (views into a larger projection output); the last
dimension must be contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

def zc_rms_norm_ref(x: Tensor, weight: Tensor, eps: float, group_size: int | None = None) -> Tensor:
    """Zero-centred RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), per group of `group_size` features.

    x: [..., N]; weight: [N]; group_size divides N (None = one group). Returns x.dtype.
    """
    shape = x.shape
    xf = x.float()
    if group_size is not None and group_size != shape[-1]:
        xf = xf.unflatten(-1, (shape[-1] // group_size, group_size))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf.reshape(shape) * (1.0 + weight.float())).to(x.dtype)


@triton.jit
def _zc_rms_norm_kernel(x, w, y, N, G, stride_x, stride_y, eps,
                        BLOCK: tl.constexpr):
    i_m = tl.program_id(0).to(tl.int64)
    i_g = tl.program_id(1)
    o = i_g * G + tl.arange(0, BLOCK)
    m = tl.arange(0, BLOCK) < G
    b_x = tl.load(x + i_m * stride_x + o, mask=m, other=0.0).to(tl.float32)
    b_r = tl.rsqrt(tl.sum(b_x * b_x, 0) / G + eps)
    b_w = tl.load(w + o, mask=m, other=0.0).to(tl.float32)
    tl.store(y + i_m * stride_y + o, (b_x * b_r * (1.0 + b_w)).to(y.dtype.element_ty), mask=m)


def _rows(x: Tensor) -> Tensor:
    """[..., N] -> [rows, N] without a copy when possible; last dim must be contiguous."""
    assert x.stride(-1) == 1, ("last dimension must be contiguous", x.stride())
    return x.reshape(-1, x.shape[-1])


def zc_rms_norm(x: Tensor, w: Tensor, eps: float, group_size: int | None = None, out: Tensor | None = None) -> Tensor:
    """Triton version of `zc_rms_norm_ref`. `out` (same shape, any row stride) may alias x."""
    N = x.shape[-1]
    G = N if group_size is None else group_size
    assert N % G == 0 and w.shape == (N,) and w.is_contiguous(), (x.shape, w.shape, group_size)
    assert G <= 16384, G
    x2 = _rows(x)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    assert out.shape == x.shape and out.stride(-1) == 1, (out.shape, x.shape)
    y2 = out.view(-1, N)  # raises when `out` cannot be viewed as rows
    if x2.shape[0] == 0:
        return out
    block = triton.next_power_of_2(G)
    _zc_rms_norm_kernel[(x2.shape[0], N // G)](x2, w, y2, N, G, x2.stride(0), y2.stride(0), eps,
                                               BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out


def gated_rms_norm_ref(o: Tensor, w: Tensor, z: Tensor, eps: float, activation: str = "sigmoid") -> Tensor:
    """RMS(o)·w·act(z) over the last dim (GatedRMSNorm.forward), fp32 chain, one rounding to o.dtype.

    o, z: [..., D]; w: [D]; activation "sigmoid" (the real model) or "silu".
    """
    of = o.float()
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    zf = z.float()
    gate = torch.sigmoid(zf) if activation == "sigmoid" else torch.nn.functional.silu(zf)
    return (of * w.float() * gate).to(o.dtype)


@triton.jit
def _gated_rms_norm_kernel(o, w, z, y, M, D, HZ, stride_o, stride_zt, stride_zh, stride_y, eps,
                           ROWS: tl.constexpr, BLOCK: tl.constexpr, SILU: tl.constexpr):
    # ROWS rows per program: the GDN output norm runs over 128-wide head rows, and one tiny
    # program per row leaves the GPU idle between launches of the row loop (30% of copy at 8K tokens)
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    c = tl.arange(0, BLOCK)
    m = (r[:, None] < M) & (c[None, :] < D)  # [ROWS, BLOCK]
    b_o = tl.load(o + r[:, None] * stride_o + c[None, :], mask=m, other=0.0).to(tl.float32)
    # z row r is (token r // HZ, head r % HZ): z may be head columns of a wider projection output
    p_z = z + (r // HZ)[:, None] * stride_zt + (r % HZ)[:, None] * stride_zh + c[None, :]
    b_z = tl.load(p_z, mask=m, other=0.0).to(tl.float32)
    b_w = tl.load(w + c, mask=c < D, other=0.0).to(tl.float32)
    b_r = tl.rsqrt(tl.sum(b_o * b_o, 1) / D + eps)  # [ROWS]
    b_gate = tl.sigmoid(b_z)
    if SILU:
        b_gate = b_z * b_gate
    tl.store(y + r[:, None] * stride_y + c[None, :], (b_o * b_r[:, None] * b_w[None, :] * b_gate).to(y.dtype.element_ty),
             mask=m)


def gated_norm_rows(D: int) -> int:
    """Rows per program of the gated norm: ~2K elements per program. Depends only on D, so a
    row's arithmetic is the same whatever the number of rows (batch invariance)."""
    return max(1, 2048 // triton.next_power_of_2(D))


def gated_rms_norm(o: Tensor, w: Tensor, z: Tensor, eps: float, activation: str = "sigmoid") -> Tensor:
    """Triton version of `gated_rms_norm_ref`; o and z: [..., D] with a contiguous last dim. z [T, H, D] may
    have any token and head strides (GDN's z: head columns of the merged input projection's output, no copy)."""
    assert activation in ("sigmoid", "silu"), activation
    D = o.shape[-1]
    assert z.shape == o.shape and w.shape == (D,) and w.is_contiguous(), (o.shape, z.shape, w.shape)
    o2 = _rows(o)
    # z as [tokens, HZ heads, D]: the leading dims but the last head dim flattened (a view for GDN's z)
    z3 = z.reshape(-1, z.shape[-2] if z.dim() > 2 else 1, D) if z.stride(-1) == 1 else z.contiguous().view(-1, 1, D)
    y = torch.empty(o.shape, dtype=o.dtype, device=o.device)
    y2 = y.view(-1, D)
    if o2.shape[0] == 0:
        return y
    block = triton.next_power_of_2(D)
    rows = gated_norm_rows(D)
    M = o2.shape[0]
    _gated_rms_norm_kernel[(triton.cdiv(M, rows),)](o2, w, z3, y2, M, D, z3.shape[1], o2.stride(0), z3.stride(0),
                                                   z3.stride(1), y2.stride(0), eps,
                                                   ROWS=rows, BLOCK=block, SILU=activation == "silu",
                                                   num_warps=min(8, max(1, rows * block // 256)))
    return y

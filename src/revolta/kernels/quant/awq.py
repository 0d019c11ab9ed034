"""AutoAWQ GEMM layout (int4, asymmetric, group G): dequantize and packed GEMV.

Layout, for a linear of K inputs and N outputs (w = (q - z) * s, q and z unsigned 4-bit):
  qweight int32 [K, N/8]: packed along N; nibble i of a word holds column (0, 2, 4, 6, 1, 3, 5, 7)[i]
                          of its 8, so column j of the 8 sits at bits 4 * (0, 4, 1, 5, 2, 6, 3, 7)[j];
  qzeros  int32 [K/G, N/8], same packing; scales fp16 [K/G, N].
Results are [out, in] = [N, K] (the nn.Linear orientation) or x @ W.T.

* `awq_dequantize_ref` / `awq_dequantize`: W [N, K] in `dtype`. Exact in fp32: (q - z) is a small
  integer and s an fp16, so the product needs at most 15 significant bits.
* `awq_gemv_ref` / `awq_gemv`: x [M, K] @ W.T + bias -> [M, N] in x.dtype, fp32 accumulation, for
  M <= MAX_GEMV_ROWS; each packed word is read once per call whatever M is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import launch_gemv, load_x_tile, nibbles_f32, store_partial, tile_product
from .gemv_nibble import gemv_config_for, nibble_gemv
from .gemv_wordcol import awq_wordcol_gemv

PACK = 8  # 4-bit values per int32 word
AWQ_SHIFTS = (0, 16, 4, 20, 8, 24, 12, 28)  # bit offset of column j (of each 8) inside its word


def _unpack_columns(packed: Tensor) -> Tensor:
    """int32 [R, C/8] (AWQ order) -> int32 [R, C] of values 0..15 in column order."""
    shifts = torch.tensor(AWQ_SHIFTS, dtype=torch.int32, device=packed.device)
    return ((packed[..., None] >> shifts) & 15).flatten(-2)


def awq_dequantize_ref(qweight: Tensor, qzeros: Tensor, scales: Tensor, group_size: int,
                       dtype: torch.dtype = torch.float32) -> Tensor:
    """qweight [K, N/8], qzeros [K/G, N/8] int32; scales [K/G, N] -> W [N, K] in `dtype`."""
    q = _unpack_columns(qweight)  # [K, N]
    z = _unpack_columns(qzeros).repeat_interleave(group_size, dim=0)  # [K, N]
    s = scales.float().repeat_interleave(group_size, dim=0)
    return ((q - z).float() * s).t().to(dtype)


def awq_gemv_ref(x: Tensor, qweight: Tensor, qzeros: Tensor, scales: Tensor, group_size: int,
                 bias: Tensor | None = None) -> Tensor:
    """x [M, K] -> x @ W.T (+ bias) [M, N] in x.dtype, computed in fp32."""
    y = x.float() @ awq_dequantize_ref(qweight, qzeros, scales, group_size).t()
    return (y if bias is None else y + bias.float()).to(x.dtype)


@triton.jit
def _awq_tile(qw, qz, sc, k, n, N, K, G: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Dequantized fp32 tile [BLOCK_K, BLOCK_N] of W.T: rows k.. of K (k a multiple of min(G, BLOCK_K): one
    group, or BLOCK_K // G whole groups), features n.. (n % 8 == 0)."""
    NW = N // 8
    NG: tl.constexpr = BLOCK_K // G if BLOCK_K > G else 1  # groups in the tile
    o_k = k + tl.arange(0, BLOCK_K)
    o_w = n // 8 + tl.arange(0, BLOCK_N // 8)
    o_n = n + tl.arange(0, BLOCK_N)
    o_g = k // G + tl.arange(0, NG)
    j = tl.arange(0, 8)
    shifts = (j & 1) * 16 + (j >> 1) * 4  # AWQ_SHIFTS: (0, 16, 4, 20, 8, 24, 12, 28)
    mask_w = o_w < NW
    mask_g = o_g < K // G
    b_q = tl.load(qw + o_k[:, None].to(tl.int64) * NW + o_w[None, :], mask=(o_k[:, None] < K) & mask_w[None, :],
                  other=0)  # [BK, BN/8]
    b_z = tl.load(qz + o_g[:, None] * NW + o_w[None, :], mask=mask_g[:, None] & mask_w[None, :], other=0)  # [NG, BN/8]
    b_q = tl.reshape(nibbles_f32(b_q, shifts), (NG, BLOCK_K // NG, BLOCK_N))
    b_z = tl.reshape(nibbles_f32(b_z, shifts), (NG, 1, BLOCK_N))
    b_s = tl.load(sc + o_g[:, None] * N + o_n[None, :], mask=mask_g[:, None] & (o_n[None, :] < N),
                  other=0.0).to(tl.float32)  # [NG, BN]
    return tl.reshape((b_q - b_z) * b_s[:, None, :], (BLOCK_K, BLOCK_N))


@triton.jit
def _awq_gemv_kernel(x, qw, qz, sc, ws, out, bias, M, N, K, stride_xm, stride_om, k_per_split,
                     G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr, HAS_BIAS: tl.constexpr):
    i_n, i_s, i_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k0 = i_s * k_per_split
    for k in range(k0, tl.minimum(k0 + k_per_split, K), BLOCK_K):
        b_w = _awq_tile(qw, qz, sc, k, i_n * BLOCK_N, N, K, G, BLOCK_K, BLOCK_N)
        b_x = load_x_tile(x, stride_xm, o_m, k + tl.arange(0, BLOCK_K), M, K)
        acc = tile_product(acc, b_x, b_w, False, USE_DOT)
    store_partial(ws, out, bias, acc, o_m, o_n, M, N, stride_om, i_s, SPLIT_K, HAS_BIAS)


@triton.jit
def _awq_dequant_kernel(qw, qz, sc, w, N, K, n0, n_rows, G: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """w [n_rows, K] = W[n0:n0 + n_rows] in w's dtype; one program per (BLOCK_K of K, BLOCK_N features)."""
    i_k, i_n = tl.program_id(0), tl.program_id(1)
    b_w = _awq_tile(qw, qz, sc, i_k * BLOCK_K, n0 + i_n * BLOCK_N, N, K, G, BLOCK_K, BLOCK_N)  # [BK, BN]
    o_k = i_k * BLOCK_K + tl.arange(0, BLOCK_K)
    o_r = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # row of the output slice
    tl.store(w + o_r[None, :].to(tl.int64) * K + o_k[:, None], b_w.to(w.dtype.element_ty),
             mask=(o_r[None, :] < n_rows) & (o_k[:, None] < K))


def _check(qweight: Tensor, qzeros: Tensor, scales: Tensor, group_size: int) -> tuple[int, int]:
    K, NW = qweight.shape
    N = NW * PACK
    assert qweight.dtype == qzeros.dtype == torch.int32 and qweight.is_contiguous(), (qweight.dtype, qzeros.dtype)
    assert K % group_size == 0 and group_size % 32 == 0, (K, group_size)
    assert qzeros.shape == (K // group_size, NW) and scales.shape == (K // group_size, N), (qzeros.shape, scales.shape)
    assert qzeros.is_contiguous() and scales.is_contiguous()
    return N, K


def awq_dequantize(qweight: Tensor, qzeros: Tensor, scales: Tensor, group_size: int,
                   dtype: torch.dtype = torch.float32, rows: tuple[int, int] | None = None) -> Tensor:
    """Triton version of `awq_dequantize_ref`; `rows` = (n0, n1) dequantizes W[n0:n1] only (n0 % 64 == 0)."""
    N, K = _check(qweight, qzeros, scales, group_size)
    n0, n1 = rows if rows is not None else (0, N)
    assert 0 <= n0 < n1 <= N and n0 % 64 == 0, (n0, n1, N)
    w = torch.empty(n1 - n0, K, dtype=dtype, device=qweight.device)
    block_k, block_n = 32, 64
    _awq_dequant_kernel[(triton.cdiv(K, block_k), triton.cdiv(n1 - n0, block_n))](
        qweight, qzeros, scales, w, N, K, n0, n1 - n0, G=group_size, BLOCK_K=block_k, BLOCK_N=block_n, num_warps=4)
    return w


def awq_gemv(x: Tensor, qweight: Tensor, qzeros: Tensor, scales: Tensor, group_size: int,
             bias: Tensor | None = None, config: dict | None = None, nibble: bool | None = None,
             counters: Tensor | None = None) -> Tensor:
    """Triton version of `awq_gemv_ref` (M <= MAX_GEMV_ROWS rows; x's last dim contiguous). nibble: the
    group-factored path (gemv_nibble.py) or the tile path; None: the default there; `config` decides when given.
    counters: int32 zeros the word-column and nibble paths' fused split-K reduce may count on
    (common.splitk_counters)."""
    N, K = _check(qweight, qzeros, scales, group_size)
    assert x.dim() == 2 and x.shape[1] == K and x.stride(-1) == 1, (x.shape, K)
    cfg = config or gemv_config_for(x, N, K, group_size, "awq", PACK, nibble)
    if cfg.get("NIBBLE_DOT"):
        return nibble_gemv(x, N, bias, cfg, "awq", (qweight, qzeros, scales), group_size, counters=counters)
    if cfg.get("WORDCOL"):
        return awq_wordcol_gemv(x, qweight, qzeros, scales, group_size, bias, cfg, counters)
    return launch_gemv(_awq_gemv_kernel, x, N, bias, cfg, qweight, qzeros, scales, G=group_size)

"""compressed-tensors `pack-quantized` int4 (W4A16, group G, symmetric or asymmetric): dequantize, packed GEMV.

Layout, for a linear of K inputs and N outputs:
  weight_packed     int32 [N, K/8]: packed along K, value i of a word at bits 4i, stored as q + 8 (q in -8..7);
  weight_scale      [N, K/G] (fp16 / bf16 / fp32);
  weight_zero_point int32 [N/8, K/G] (asymmetric only): packed along N the same way, stored as z + 8.
w = (q - z) * s, z = 0 when symmetric. In stored nibbles: w = (nibble - zero nibble) * s, zero nibble 8
when symmetric. Exact in fp32 (a small integer times a 16-bit scale; fp32 scales are rounded once).

* `ct_int4_dequantize_ref` / `ct_int4_dequantize`: W [N, K] in `dtype`.
* `ct_int4_gemv_ref` / `ct_int4_gemv`: x [M, K] @ W.T + bias -> [M, N] in x.dtype (M <= MAX_GEMV_ROWS).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import MAGIC, launch_gemv, load_x_tile, nibbles_f32, store_partial, tile_product
from .gemv_nibble import gemv_config_for, nibble_gemv

PACK = 8


def _unpack_along_last(packed: Tensor) -> Tensor:
    """int32 [..., C/8] -> int32 [..., C] nibbles 0..15, value i of each word at bits 4i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return ((packed[..., None] >> shifts) & 15).flatten(-2)


def ct_int4_dequantize_ref(weight_packed: Tensor, weight_scale: Tensor, weight_zero_point: Tensor | None,
                           group_size: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """weight_packed [N, K/8], weight_scale [N, K/G], weight_zero_point [N/8, K/G] or None -> W [N, K]."""
    q = _unpack_along_last(weight_packed)  # [N, K]
    if weight_zero_point is None:
        z = torch.full((), 8, dtype=torch.int32, device=q.device)
    else:
        z = _unpack_along_last(weight_zero_point.t().contiguous()).t()  # [N, K/G]
        z = z.repeat_interleave(group_size, dim=1)
    s = weight_scale.float().repeat_interleave(group_size, dim=1)
    return ((q - z).float() * s).to(dtype)


def ct_int4_gemv_ref(x: Tensor, weight_packed: Tensor, weight_scale: Tensor, weight_zero_point: Tensor | None,
                     group_size: int, bias: Tensor | None = None) -> Tensor:
    """x [M, K] -> x @ W.T (+ bias) [M, N] in x.dtype, computed in fp32."""
    y = x.float() @ ct_int4_dequantize_ref(weight_packed, weight_scale, weight_zero_point, group_size).t()
    return (y if bias is None else y + bias.float()).to(x.dtype)


@triton.jit
def _ct_tile(wp, sc, zp, n, k, N, K, G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             HAS_ZP: tl.constexpr):
    """Dequantized fp32 tile [BLOCK_N, BLOCK_K] of W: features n.., inputs k.. (k a multiple of
    min(G, BLOCK_K): one group, or BLOCK_K // G whole groups)."""
    KW = K // 8
    KG = K // G
    NG: tl.constexpr = BLOCK_K // G if BLOCK_K > G else 1  # groups in the tile
    o_n = n + tl.arange(0, BLOCK_N)
    o_w = k // 8 + tl.arange(0, BLOCK_K // 8)
    o_g = k // G + tl.arange(0, NG)
    mask_n = o_n < N
    mask_s = mask_n[:, None] & (o_g[None, :] < KG)
    b_q = tl.load(wp + o_n[:, None].to(tl.int64) * KW + o_w[None, :], mask=mask_n[:, None] & (o_w[None, :] < KW),
                  other=0)  # [BN, BK/8]
    b_q = tl.reshape(nibbles_f32(b_q, tl.arange(0, 8) * 4), (BLOCK_N, NG, BLOCK_K // NG))
    b_s = tl.load(sc + o_n[:, None].to(tl.int64) * KG + o_g[None, :], mask=mask_s, other=0.0).to(tl.float32)  # [BN, NG]
    if HAS_ZP:
        b_z = tl.load(zp + (o_n[:, None] // 8).to(tl.int64) * KG + o_g[None, :], mask=mask_s, other=0)
        b_z = (((b_z >> ((o_n[:, None] % 8) * 4)) & 15) | MAGIC).to(tl.float32, bitcast=True)
    else:
        b_z = tl.full([BLOCK_N, NG], 8 + 8388608.0, tl.float32)
    return tl.reshape((b_q - b_z[:, :, None]) * b_s[:, :, None], (BLOCK_N, BLOCK_K))


@triton.jit
def _ct_gemv_kernel(x, wp, sc, zp, ws, out, bias, M, N, K, stride_xm, stride_om, k_per_split,
                    G: tl.constexpr, HAS_ZP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr, HAS_BIAS: tl.constexpr):
    i_n, i_s, i_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k0 = i_s * k_per_split
    for k in range(k0, tl.minimum(k0 + k_per_split, K), BLOCK_K):
        b_w = _ct_tile(wp, sc, zp, i_n * BLOCK_N, k, N, K, G, BLOCK_N, BLOCK_K, HAS_ZP)
        b_x = load_x_tile(x, stride_xm, o_m, k + tl.arange(0, BLOCK_K), M, K)
        acc = tile_product(acc, b_x, b_w, True, USE_DOT)
    store_partial(ws, out, bias, acc, o_m, o_n, M, N, stride_om, i_s, SPLIT_K, HAS_BIAS)


@triton.jit
def _ct_dequant_kernel(wp, sc, zp, w, N, K, n0, n_rows, G: tl.constexpr, HAS_ZP: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    i_n, i_k = tl.program_id(0), tl.program_id(1)
    b_w = _ct_tile(wp, sc, zp, n0 + i_n * BLOCK_N, i_k * BLOCK_K, N, K, G, BLOCK_N, BLOCK_K, HAS_ZP)
    o_r = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = i_k * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(w + o_r[:, None].to(tl.int64) * K + o_k[None, :], b_w.to(w.dtype.element_ty),
             mask=(o_r[:, None] < n_rows) & (o_k[None, :] < K))


def _check(weight_packed: Tensor, weight_scale: Tensor, weight_zero_point: Tensor | None,
           group_size: int) -> tuple[int, int]:
    N, KW = weight_packed.shape
    K = KW * PACK
    assert weight_packed.dtype == torch.int32 and weight_packed.is_contiguous(), weight_packed.dtype
    assert K % group_size == 0 and group_size % 32 == 0, (K, group_size)
    assert weight_scale.shape == (N, K // group_size) and weight_scale.is_contiguous(), weight_scale.shape
    if weight_zero_point is not None:
        assert N % PACK == 0 and weight_zero_point.shape == (N // PACK, K // group_size), weight_zero_point.shape
        assert weight_zero_point.dtype == torch.int32 and weight_zero_point.is_contiguous()
    return N, K


def ct_int4_dequantize(weight_packed: Tensor, weight_scale: Tensor, weight_zero_point: Tensor | None,
                       group_size: int, dtype: torch.dtype = torch.float32,
                       rows: tuple[int, int] | None = None) -> Tensor:
    """Triton version of `ct_int4_dequantize_ref`; `rows` = (n0, n1) dequantizes W[n0:n1] only."""
    N, K = _check(weight_packed, weight_scale, weight_zero_point, group_size)
    n0, n1 = rows if rows is not None else (0, N)
    assert 0 <= n0 < n1 <= N, (n0, n1, N)
    w = torch.empty(n1 - n0, K, dtype=dtype, device=weight_packed.device)
    block_n, block_k = 32, 32
    zp = weight_zero_point if weight_zero_point is not None else weight_packed
    _ct_dequant_kernel[(triton.cdiv(n1 - n0, block_n), triton.cdiv(K, block_k))](
        weight_packed, weight_scale, zp, w, N, K, n0, n1 - n0, G=group_size, HAS_ZP=weight_zero_point is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return w


def ct_int4_gemv(x: Tensor, weight_packed: Tensor, weight_scale: Tensor, weight_zero_point: Tensor | None,
                 group_size: int, bias: Tensor | None = None, config: dict | None = None,
                 nibble: bool | None = None, counters: Tensor | None = None) -> Tensor:
    """Triton version of `ct_int4_gemv_ref` (M <= MAX_GEMV_ROWS rows; x's last dim contiguous); nibble, counters: as
    awq.awq_gemv (the nibble path's fused split-K reduce)."""
    N, K = _check(weight_packed, weight_scale, weight_zero_point, group_size)
    assert x.dim() == 2 and x.shape[1] == K and x.stride(-1) == 1, (x.shape, K)
    cfg = config or gemv_config_for(x, N, K, group_size, "ct_int4", 1, nibble)
    zp = weight_zero_point if weight_zero_point is not None else weight_packed
    if cfg.get("NIBBLE_DOT"):
        return nibble_gemv(x, N, bias, cfg, "ct_int4", (weight_packed, weight_scale, zp), group_size,
                           has_zp=weight_zero_point is not None, counters=counters)
    return launch_gemv(_ct_gemv_kernel, x, N, bias, cfg, weight_packed, weight_scale, zp, G=group_size,
                       HAS_ZP=weight_zero_point is not None)

"""NVFP4 (E2M1 values, E4M3 scales per 16 inputs, fp32 global scale): dequantize and packed GEMV.

Layout, for a linear of K inputs and N outputs, as ModelOpt exports it:
  weight         uint8 [N, K/2]: two E2M1 codes per byte, the lower-index input in the low nibble;
  weight_scale   float8_e4m3fn [N, K/16] (passed to the kernels as its bytes, uint8);
  weight_scale_2 fp32 [S]: the global scale of each of S equal row shards (S = 1 for one linear,
                 2 for fused gate/up experts: the checkpoint's per-projection scales, kept apart).
compressed-tensors stores the same codes and scales (`weight_packed`, `weight_scale`) and the global scale
inverted (`weight_global_scale` = 1 / weight_scale_2): pass `inverted=True`.

Dequantisation, fixed in this order so the Triton and torch paths agree bit for bit:
  group scale = e4m3 * global (or e4m3 / global when inverted; one fp32 rounding),
  w = code * group scale   (fp32).

* `nvfp4_dequantize_ref` / `nvfp4_dequantize`: W [N, K] in `dtype`.
* `nvfp4_gemv_ref` / `nvfp4_gemv`: x [M, K] @ W.T + bias -> [M, N] in x.dtype (M <= MAX_GEMV_ROWS).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import e2m1_to_f32, e4m3_to_f32, launch_gemv, load_x_tile, store_partial, tile_product
from .gemv_nibble import gemv_config_for, nibble_gemv

GROUP = 16  # inputs per E4M3 scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_codes_to_float(codes: Tensor) -> Tensor:
    """uint8/int codes 0..15 -> fp32 values (bit 3 is the sign)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    c = codes.to(torch.int64)
    return torch.where((c & 8) != 0, -table[c & 7], table[c & 7])


def group_scales_ref(weight_scale: Tensor, global_scale: Tensor, inverted: bool) -> Tensor:
    """[N, K/16] fp32 effective scales: e4m3 * global per row shard (or / global when inverted)."""
    s = weight_scale.view(torch.float8_e4m3fn).float() if weight_scale.dtype == torch.uint8 else weight_scale.float()
    shards = global_scale.numel()
    g = global_scale.float().reshape(-1).repeat_interleave(s.shape[0] // shards)[:, None]
    return s / g if inverted else s * g


def nvfp4_dequantize_ref(weight: Tensor, weight_scale: Tensor, global_scale: Tensor, inverted: bool = False,
                         dtype: torch.dtype = torch.float32) -> Tensor:
    """weight uint8 [N, K/2], weight_scale e4m3 (or its bytes) [N, K/16], global_scale fp32 [S] -> W [N, K]."""
    codes = torch.stack([weight & 15, weight >> 4], dim=-1).flatten(-2)  # [N, K], low nibble first
    s = group_scales_ref(weight_scale, global_scale, inverted).repeat_interleave(GROUP, dim=1)
    return (e2m1_codes_to_float(codes) * s).to(dtype)


def nvfp4_gemv_ref(x: Tensor, weight: Tensor, weight_scale: Tensor, global_scale: Tensor, inverted: bool = False,
                   bias: Tensor | None = None) -> Tensor:
    """x [M, K] -> x @ W.T (+ bias) [M, N] in x.dtype, computed in fp32."""
    y = x.float() @ nvfp4_dequantize_ref(weight, weight_scale, global_scale, inverted).t()
    return (y if bias is None else y + bias.float()).to(x.dtype)


@triton.jit
def _nvfp4_tile(wt, sc, gs, n, k, N, K, rows_per_shard, INVERTED: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """Dequantized fp32 tile [BLOCK_N, BLOCK_K] of W: features n.., inputs k.. (k % 16 == 0)."""
    KB, KS = K // 2, K // 16
    NS: tl.constexpr = BLOCK_K // 16
    o_n = n + tl.arange(0, BLOCK_N)
    mask_n = o_n < N
    o_b = k // 2 + tl.arange(0, NS)[:, None] * 8 + tl.arange(0, 8)[None, :]  # [NS, 8] bytes of NS groups
    b_b = tl.load(wt + o_n[:, None, None].to(tl.int64) * KB + o_b[None, :, :],
                  mask=mask_n[:, None, None] & (o_b[None, :, :] < KB), other=0).to(tl.int32)  # [BN, NS, 8]
    b_c = tl.reshape(tl.join(b_b & 15, b_b >> 4), (BLOCK_N, NS, 16))  # low nibble first
    o_s = k // 16 + tl.arange(0, NS)
    b_s = e4m3_to_f32(tl.load(sc + o_n[:, None].to(tl.int64) * KS + o_s[None, :],
                              mask=mask_n[:, None] & (o_s[None, :] < KS), other=0))  # [BN, NS]
    b_g = tl.load(gs + o_n // rows_per_shard, mask=mask_n, other=1.0).to(tl.float32)  # [BN]
    if INVERTED:
        b_s = b_s / b_g[:, None]
    else:
        b_s = b_s * b_g[:, None]
    return tl.reshape(e2m1_to_f32(b_c) * b_s[:, :, None], (BLOCK_N, BLOCK_K))


@triton.jit
def _nvfp4_gemv_kernel(x, wt, sc, gs, rows_per_shard, ws, out, bias, M, N, K, stride_xm, stride_om, k_per_split,
                       INVERTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr, HAS_BIAS: tl.constexpr):
    i_n, i_s, i_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k0 = i_s * k_per_split
    for k in range(k0, tl.minimum(k0 + k_per_split, K), BLOCK_K):
        b_w = _nvfp4_tile(wt, sc, gs, i_n * BLOCK_N, k, N, K, rows_per_shard, INVERTED, BLOCK_N, BLOCK_K)
        b_x = load_x_tile(x, stride_xm, o_m, k + tl.arange(0, BLOCK_K), M, K)
        acc = tile_product(acc, b_x, b_w, True, USE_DOT)
    store_partial(ws, out, bias, acc, o_m, o_n, M, N, stride_om, i_s, SPLIT_K, HAS_BIAS)


@triton.jit
def _nvfp4_dequant_kernel(wt, sc, gs, w, N, K, n0, n_rows, rows_per_shard, INVERTED: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    i_n, i_k = tl.program_id(0), tl.program_id(1)
    b_w = _nvfp4_tile(wt, sc, gs, n0 + i_n * BLOCK_N, i_k * BLOCK_K, N, K, rows_per_shard, INVERTED, BLOCK_N,
                      BLOCK_K)
    o_r = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = i_k * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(w + o_r[:, None].to(tl.int64) * K + o_k[None, :], b_w.to(w.dtype.element_ty),
             mask=(o_r[:, None] < n_rows) & (o_k[None, :] < K))


def _check(weight: Tensor, weight_scale: Tensor, global_scale: Tensor) -> tuple[int, int, Tensor, int]:
    """-> (N, K, scale bytes, rows per global-scale shard)."""
    N, KB = weight.shape
    K = KB * 2
    assert weight.dtype == torch.uint8 and weight.is_contiguous(), weight.dtype
    assert K % GROUP == 0 and weight_scale.shape == (N, K // GROUP) and weight_scale.is_contiguous(), weight_scale.shape
    assert weight_scale.element_size() == 1, weight_scale.dtype
    shards = global_scale.numel()
    assert shards >= 1 and N % shards == 0 and global_scale.dtype == torch.float32, (global_scale.shape, N)
    return N, K, weight_scale.view(torch.uint8), N // shards


def nvfp4_dequantize(weight: Tensor, weight_scale: Tensor, global_scale: Tensor, inverted: bool = False,
                     dtype: torch.dtype = torch.float32, rows: tuple[int, int] | None = None) -> Tensor:
    """Triton version of `nvfp4_dequantize_ref`; `rows` = (n0, n1) dequantizes W[n0:n1] only."""
    N, K, scale_bytes, per_shard = _check(weight, weight_scale, global_scale)
    n0, n1 = rows if rows is not None else (0, N)
    assert 0 <= n0 < n1 <= N, (n0, n1, N)
    w = torch.empty(n1 - n0, K, dtype=dtype, device=weight.device)
    block_n, block_k = 32, 64
    _nvfp4_dequant_kernel[(triton.cdiv(n1 - n0, block_n), triton.cdiv(K, block_k))](
        weight, scale_bytes, global_scale.contiguous(), w, N, K, n0, n1 - n0, per_shard, INVERTED=inverted,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return w


def nvfp4_gemv(x: Tensor, weight: Tensor, weight_scale: Tensor, global_scale: Tensor, inverted: bool = False,
               bias: Tensor | None = None, config: dict | None = None, nibble: bool | None = None,
               counters: Tensor | None = None) -> Tensor:
    """Triton version of `nvfp4_gemv_ref` (M <= MAX_GEMV_ROWS rows; x's last dim contiguous); nibble, counters: as
    awq.awq_gemv (the nibble path's fused split-K reduce)."""
    N, K, scale_bytes, per_shard = _check(weight, weight_scale, global_scale)
    assert x.dim() == 2 and x.shape[1] == K and x.stride(-1) == 1, (x.shape, K)
    cfg = config or gemv_config_for(x, N, K, GROUP, "nvfp4", 1, nibble)
    if cfg.get("NIBBLE_DOT"):
        return nibble_gemv(x, N, bias, cfg, "nvfp4", (weight, scale_bytes, global_scale.contiguous()), GROUP,
                           inverted=inverted, rows_per_shard=per_shard, counters=counters)
    return launch_gemv(_nvfp4_gemv_kernel, x, N, bias, cfg, weight, scale_bytes, global_scale.contiguous(),
                       per_shard, INVERTED=inverted)

"""The dense packed GEMV / skinny GEMM (M <= MAX_GEMV_ROWS) on the group-factored nibble decode (nibble.py), and the
one switch that picks it over the tile path (common.py's kernels in awq.py / ct_int4.py / nvfp4.py).

A program owns BLOCK_N output features, BLOCK_M (16, 32 or 64) activation rows and one K slice (split-K), and runs
nibble.py's K loop: per quantization group, tl.dot of x [BLOCK_M, G] with the group's unscaled codes (q - z) in
x.dtype, then one fp32 multiply-add applies the group scale to the partial. Rows past M are masked (zeros in, never
stored). The K slices' fp32 partials are added in slice order by common.py's `_splitk_reduce_kernel` (no atomics,
bitwise reproducible, CUDA-graph safe), which adds the bias and rounds once to x.dtype.

Why a wide split at M = 1: the tile path there (benchmarks/RESULTS.md K6) ran ~2 programs per SM, each with one
2 KB K step of loads in flight: too few bytes in flight to cover the memory latency (Little's law: ~4 MB at the
H200's bandwidth). Here a program's K step is one group of 32 inputs x BLOCK_N features, and the split aims at
NIBBLE_PROGRAMS_PER_SM programs per SM, each with num_stages - 1 steps of loads ahead, with slices of at least
2 K steps. Measured (benchmarks/sweep_nibble_gemv.py on an H100, RESULTS.md K6b: BLOCK_N 64 / 128 / 256 x split
1-32 x 4 / 8 warps x 3 / 4 stages at four real shapes, M = 1 and 8): 64-feature tiles, 3 stages and this split came
within 4% of the best config of every shape at both M, where the earlier 128-feature tiles with 4 stages took
1.02-1.70x the best. Up to 16 rows (swept at 1 and 8; 9-16 rows run the same 16-row tiles) the split does not
shrink with M (at M = 8 the best configs kept M = 1's split: the partials, 8 B per row, feature and split, cost
less than the programs they buy); from 17 rows (64-row tiles, not swept) the partials are held to
1/NIBBLE_WS_SHARE of the packed bytes (or NIBBLE_WS_FLOOR) and the tiles stay 128 wide. The config depends on
(M, N, K, device) only.
Row invariance: a row's output does not depend on the other rows of its call (their dot rows are independent, and
masked rows load zeros), so two calls with the same config (BLOCK_M, SPLIT_K) give a row bitwise the same result;
calls of 1-16 rows share one config (one AWQ row of a wide projection takes the word-column path by default:
gemv_wordcol.py); from 17 rows a call may get another SPLIT_K (the partials budget) or BLOCK_M and then differ in
the last bits.

Selection: `gemv_config_for(..., nibble=None)` -> NIBBLE_DOT in the config; None means the formats in
`NIBBLE_GEMV_SM80` on sm80+ with fp16 / bf16 activations (from 17 rows only from NIBBLE_WIDE_MIN_N outputs). sm70
always keeps the tile path by default (tl.dot is FMA on 16 padded rows there), and fp32 activations too (the fp32
models; the nibble path computes them exactly with fp32 dots when asked).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..pdl import pdl_start
from .common import device_facts, fixup_default, gemv_config, launch_gemv, splitk_fixup, store_partial
from .gemv_wordcol import default_wordcol_config, use_wordcol
from .nibble import LAYOUTS, _nibble_rows_matmul, nibble_block_k, nibble_min_rows, split_len

# THE default: the formats whose dense packed GEMV takes the nibble path on sm80+ (fp16 / bf16 activations).
# Measured on an H100 (RESULTS.md K6b): AWQ 2.2-4.9x the tile path at 1-16 rows on the large projections (second
# run), even where its 64-feature tiles cost 9.2 SASS instructions per weight against the tile path's 10.4-13.1
# (benchmarks/quant_gemv_instructions.py, aligned builds): more programs in flight, not fewer instructions, is what
# it buys; compressed-tensors int4 2.1-2.4x at M = 1, 1.5-1.7x at 8; NVFP4, in the 64-row tiles it needs on sm_90
# (`nibble_min_rows`), 1.5-1.7x at M = 1 and 1.4x at 8 (both runs; q_proj and in_proj_qkv).
NIBBLE_GEMV_SM80 = ("awq", "ct_int4", "nvfp4")
# From 17 rows (the MTP4 verify at C8: 40) the nibble path's 64-row tiles beat the tile path only on the widest
# projections: on an H100 (RESULTS.md K6b, AWQ, 40 rows) q_proj (N 12288) 70.6 vs 98.9 us, in_proj_qkv (10240)
# 69.7 vs 97.5, and lost at every N <= 6144 (0.44-0.73x: k_proj, o_proj, in_proj_z, out_proj, the expert-sized
# linears). Compressed-tensors int4 and NVFP4 follow the same rule (not timed at 40 rows).
NIBBLE_WIDE_MIN_N = 8192
NIBBLE_SKINNY_ROWS = 16  # up to this many rows one 16-row tile (tl.dot's least) runs the swept skinny config
NIBBLE_PROGRAMS_PER_SM = 4  # split-K target: this many programs per SM (bytes in flight)
NIBBLE_MAX_SPLIT = 16  # 32 was never the fastest in the sweep
NIBBLE_WS_SHARE = 4  # split-K partials cost at most 1/4 of the packed bytes (~K/2 B per feature) ...
NIBBLE_WS_FLOOR = 1 << 20  # ... or 1 MiB (~0.3 us at the H200's bandwidth: less than a serial K loop of small N)


def use_nibble(arch: int | None, dtype: torch.dtype, layout: str, nibble: bool | None = None, M: int = 1,
               N: int | None = None) -> bool:
    """Whether a GEMV of M rows over a `layout` weight (nibble.LAYOUTS) with N outputs and `dtype` activations on
    compute capability `arch` (None: the interpreter) takes the nibble path: `nibble` when given, else the default
    above, for 1-16 rows (its swept 16-row tiles) and from 17 rows only from NIBBLE_WIDE_MIN_N outputs."""
    if nibble is not None:
        return nibble
    sixteen_bit = dtype in (torch.float16, torch.bfloat16)
    if not (layout in NIBBLE_GEMV_SM80 and arch is not None and arch >= 80 and sixteen_bit):
        return False
    return M <= NIBBLE_SKINNY_ROWS or N is None or N >= NIBBLE_WIDE_MIN_N


def nibble_gemv_config(M: int, N: int, K: int, group: int, layout: str, num_sms: int,
                       arch: int | None = None) -> dict:
    """Launch config of the nibble GEMV of M rows (1..MAX_GEMV_ROWS) over W [N, K] in `layout` (nibble.LAYOUTS).

    sm80+ (and the interpreter): BLOCK_M 16 up to 16 rows, else 32 / 64 (one M tile); BLOCK_N 64 up to 16 rows and
    3 stages (measured: module docstring; 9.2 SASS instructions per weight in the sm_90 loop against 6.3 at 128
    features, benchmarks/quant_gemv_instructions.py: the programs in flight matter more), 128 beyond (8.3 per
    weight at 64 rows; not swept); NVFP4 128 (27 per weight at 128, more narrower; not swept). sm70 (only when
    asked): 16-row tiles (M tiles on the grid) of 32 features, narrow enough not to spill
    (tests/kernels/test_quant_aot.py); at least `nibble_min_rows` (NVFP4 on sm80+: 64). One group per K step
    (`nibble_block_k`: 32 for group 32, 16 for NVFP4). SPLIT_K: module docstring; FIXUP (the reduce inside the
    kernel): common.fixup_default(); PDL (the GEMV and its reduce chained where the device has it, sm_90: K6j).
    """
    wide = arch is None or arch >= 80
    skinny_rows = M <= NIBBLE_SKINNY_ROWS or not wide
    bm = max(NIBBLE_SKINNY_ROWS if skinny_rows else triton.next_power_of_2(M), nibble_min_rows(layout, arch))
    skinny = wide and bm == NIBBLE_SKINNY_ROWS  # the swept case (NVFP4's 64-row tiles are not)
    bn = max(16, min((64 if skinny else 128) if wide else 32, triton.next_power_of_2(N)))  # tl.dot: >= 16 columns
    bk = nibble_block_k(32, group, layout)
    steps = triton.cdiv(K, bk)
    budget = max(N * K // 2 // NIBBLE_WS_SHARE, NIBBLE_WS_FLOOR)  # bytes of partials allowed from 17 rows
    programs = triton.cdiv(N, bn) * triton.cdiv(M, bm)
    split = 1
    while (split < NIBBLE_MAX_SPLIT and programs * split < NIBBLE_PROGRAMS_PER_SM * num_sms
           and steps // (2 * split) >= 2 and (skinny or 2 * split * M * N * 8 <= budget)):
        split *= 2
    stages = 3 if skinny or arch is None or arch < 90 else 4
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, USE_DOT=True, NIBBLE_DOT=True, SCALE_AHEAD=True,
                k_per_split=split_len(K, split, bk), num_warps=4, num_stages=stages, FIXUP=fixup_default(), PDL=True)


def gemv_config_for(x: Tensor, N: int, K: int, group: int, layout: str, n_align: int = 1,
                    nibble: bool | None = None) -> dict:
    """The GEMV config for the rows of x on x's device: when `nibble` is None and `use_wordcol` picks it, the
    one-row word-column path's (gemv_wordcol.py, WORDCOL); else the nibble path's (NIBBLE_DOT) or the tile path's
    (common.gemv_config), as `use_nibble` picks (`nibble` given: that path)."""
    sms, arch = device_facts(x.device)
    if nibble is None and use_wordcol(arch, x.dtype, layout, x.shape[0], N, K):
        return default_wordcol_config(N, K, group, sms, x.dtype)
    if use_nibble(arch, x.dtype, layout, nibble, x.shape[0], N):
        return nibble_gemv_config(x.shape[0], N, K, group, layout, sms, arch)
    return gemv_config(x.shape[0], N, K, group, sms, n_align, arch)


@triton.jit
def _nibble_gemv_kernel(x, w0, w1, w2, rows_per_shard, ws, out, bias, M, N, K, stride_xm, stride_om, k_per_split,
                        FMT: tl.constexpr, G: tl.constexpr, HAS_ZP: tl.constexpr, INVERTED: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                        USE_DOT: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_AHEAD: tl.constexpr, counters=None,
                        FIXUP: tl.constexpr = False, PDL: tl.constexpr = False):
    """out [M, N] (SPLIT_K == 1) or ws [SPLIT_K, M, N] fp32 (K slice program_id(1)) of x [M, K] @ Wᵀ; w0..w2: the
    format's three tensors (nibble._group). USE_DOT: always True (launch_gemv's argument list); SCALE_AHEAD:
    nibble._nibble_rows_matmul. FIXUP (SPLIT_K > 1): the last K slice of each (row block, N tile) adds the partials
    and writes out (common.splitk_fixup over int32 `counters`) instead of a reduce launch. PDL: pdl.pdl_start."""
    pdl_start(PDL)
    i_n, i_s, i_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = i_n * BLOCK_N
    k_lo = i_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc, _ = _nibble_rows_matmul(x + o_m.to(tl.int64) * stride_xm, o_m < M, w0, w1, w2, n, w0, w1, w2, n, N, K, k_lo,
                                 k_hi, rows_per_shard, FMT, G, HAS_ZP, INVERTED, BLOCK_N, BLOCK_M, BLOCK_K,
                                 False, SCALE_AHEAD)  # [BM, BN] fp32
    store_partial(ws, out, bias, acc, o_m, n + tl.arange(0, BLOCK_N), M, N, stride_om, i_s, SPLIT_K, HAS_BIAS)
    if FIXUP:
        splitk_fixup(ws, out, bias, counters, i_m * tl.num_programs(0) + i_n, o_m, n + tl.arange(0, BLOCK_N), M, N,
                     stride_om, SPLIT_K, HAS_BIAS)


def nibble_gemv(x: Tensor, N: int, bias: Tensor | None, cfg: dict, layout: str, tensors: tuple[Tensor, Tensor, Tensor],
                group: int, has_zp: bool = False, inverted: bool = False, rows_per_shard: int = 1,
                counters: Tensor | None = None) -> Tensor:
    """x [M, K] @ Wᵀ (+ bias) -> [M, N] in x.dtype on the nibble path; `tensors` as nibble._group takes them
    (awq: qweight, qzeros, scales; ct_int4: weight_packed, weight_scale, zero points or any int32 tensor;
    nvfp4: codes, E4M3 scale bytes, global scales [S] with `rows_per_shard` rows each)."""
    assert cfg.get("NIBBLE_DOT") and cfg["BLOCK_M"] >= 16, f"the nibble path is tl.dot only (BLOCK_M >= 16): {cfg}"
    return launch_gemv(_nibble_gemv_kernel, x, N, bias, cfg, *tensors, rows_per_shard, FMT=LAYOUTS.index(layout),
                       G=group, HAS_ZP=has_zp, INVERTED=inverted, SCALE_AHEAD=cfg.get("SCALE_AHEAD", False),
                       counters=counters)

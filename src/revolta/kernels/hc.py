"""HyperConnection read and combine kernels (spec/model.md §2.3, §11.4).

Read, on the wide residual x = [x_0 .. x_{h-1}] ([M, h·d], branch-major):

    N    = GroupedZCRMSNorm(x)               rstd_b = rsqrt(mean(x_b²) + eps), n_b = x_b·rstd_b·(1 + w_b)
    a    = SiLU((W_dn N) / h)                 [M, r]
    inj  = 2·σ((W_inj N) / h)                 [M, h]      (absent in the final mixer)
    G    = σ(W_up a)                          [M, h·d]
    u_in = (1/h) Σ_b g_b ⊙ n_b                [M, d]

Because the norm is linear per branch, W·N = Σ_b rstd_b · W_b (x_b ⊙ (1 + w_b)): both paths accumulate
the unnormalised products per K split of one branch together with the split's Σx², so the statistics
cost no extra pass, and apply rstd after the K reduction (in fp32). W_dn and W_inj share their input,
so they share the pass (rows [0, r) and [r, r + h) of one virtual matrix; nothing is concatenated).

Small M (decode / verify, M <= 8 by default; `hc_config`), the "rows" kernels, built to stream the
13 MB of weights per module at bandwidth:
  1. `_hc_down_rows_kernel`, grid (M tiles, row tiles of r + h, K splits): each program loads its
     [BLOCK_R, d / splits] slice of [W_dn; W_inj] once (vector loads, no tl.dot) and applies it to its
     rows one at a time; fp32 partials [S, M, r + h] and Σx² [S, M] to a workspace.
  2. `_hc_mix_rows_kernel`, grid (M, column tiles of r + h): rstd per branch, the split reduction,
     `a` = SiLU, the inject sigmoid. (FUSED_MIX: no such launch; every up program redoes this tiny
     reduction for its rows, worth it only with few splits.)
  3. `_hc_up_rows_kernel`, grid (M tiles, column tiles c of d): the rows b·d + c of W_up for all
     branches in two power-of-two K pieces (320 = 256 + 64), G = σ(W_up a), the normalised branch
     recomputed from x, the mean over branches.
  On sm90 the later launches use programmatic dependent launch: they start while the down pass
  streams, issue their W_up loads, then wait (`gdc_wait`) for the previous grid, which hides a
  launch latency and overlaps the two weight streams.
  Row invariance: the config is the same for every M <= MAX_M apart from BLOCK_M, and each row is
  computed by the same instructions on the same tiles whatever rows share its program, so a row's
  result does not depend on the batch (checked bitwise under the interpreter; the benchmark checks
  it on the GPU).
MIN_M <= M <= MAX_M of `hc_dot_default` (4-16 on sm90+, where it is on: ENABLED), the "dot" variant of the same
three launches (kernels/hc_dot.py): the down and up passes multiply each weight tile once against a 16-row tile
with tl.dot (keys DOWN / UP pick "rows" or "dot" per pass). A row rounds one way at M <= 3 and another at 4-16:
a 1-row decode and a 5-row MTP4 verify can differ at near-ties there (as cuBLAS already lets them).
Larger M, the "tiles" kernels (`hc_config_tiles`), three launches: `_hc_down_kernel` (tl.dot tiles
over (M, rows, K splits)), `_hc_mix_kernel` (one program per row), `_hc_up_kernel` (tl.dot over
(M, columns c of d) for all branches). They also have GEMV tiles for M <= 8, the kernel measured in
benchmarks/RESULTS.md K7 (kept so the benchmark can time it). The "torch" path (cuBLAS matmuls) is
`hc_read_ref` itself.
Numerics against the layer (`HyperConnection.read`), both paths: the layer rounds N, the matmul
outputs and the gates to x.dtype; here N is never materialised (rstd is applied after the K reduction,
in fp32), only `a` (the input of the second matmul) is rounded to x.dtype, and u_in and the inject
gates are rounded once, at the end.

Combine: x_b ← x_b + inj_b · u as the layer rounds it (`hc_combine`). `hc_combine_read` (decode / verify, 16-bit): the
rows or dot down pass applies a block's write (rounded once) to each slice of x it loads and stores y for the later passes.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import hc_dot
from .hc_combine import _hc_combine_kernel, hc_combine, hc_combine_once_ref, hc_combine_ref  # noqa: F401
from .norm import zc_rms_norm_ref as zc_rms_norm
from .pdl import pdl_allowed, pdl_launch


def hc_read_ref(x: Tensor, norm_w: Tensor, w_down: Tensor, w_up: Tensor, w_inject: Tensor | None,
                hc_count: int, eps: float) -> tuple[Tensor, Tensor | None]:
    """HyperConnection.read with explicit weights.

    x: [M, h·d]; norm_w: [h·d]; w_down: [r, h·d]; w_up: [h·d, r]; w_inject: [h, h·d] or None.
    Returns (block_input [M, d], inject [M, h] in (0, 2) or None), both x.dtype.
    """
    h = hc_count
    d = x.shape[-1] // h
    normed = zc_rms_norm(x, norm_w, eps, d)
    mix = F.silu(F.linear(normed, w_down) / h)
    gates = torch.sigmoid(F.linear(mix, w_up))
    block_input = (gates.unflatten(-1, (h, d)) * normed.unflatten(-1, (h, d))).mean(dim=-2)
    if w_inject is None:
        return block_input, None
    return block_input, 2 * torch.sigmoid(F.linear(normed, w_inject) / h)


@triton.jit
def _hc_down_kernel(x, norm_w, w_down, w_inject, partial, sumsq, M, R, RH, WIDE, KSPLIT,
                    stride_x, stride_wd, stride_wi,
                    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                    HAS_INJECT: tl.constexpr, USE_DOT: tl.constexpr):
    i_m = tl.program_id(0)
    i_r = tl.program_id(1)
    i_s = tl.program_id(2)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < M
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    # rows [0, R) come from W_dn, rows [R, R + h) from W_inj
    m_dn = o_r < R
    m_inj = (o_r >= R) & (o_r < RH)
    p_x = x + o_m[:, None].to(tl.int64) * stride_x
    p_dn = w_down + o_r[:, None].to(tl.int64) * stride_wd
    p_inj = w_inject + (o_r[:, None] - R).to(tl.int64) * stride_wi
    b_acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    b_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_start = i_s * KSPLIT
    for k0 in range(0, KSPLIT, BLOCK_K):
        o_k = k_start + k0 + tl.arange(0, BLOCK_K)
        m_k = (k0 + tl.arange(0, BLOCK_K)) < KSPLIT
        b_x = tl.load(p_x + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0).to(tl.float32)  # [BM, BK]
        b_nw = tl.load(norm_w + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_sq += tl.sum(b_x * b_x, 1)
        b_xw = b_x * (1.0 + b_nw)[None, :]
        b_w = tl.load(p_dn + o_k[None, :], mask=m_dn[:, None] & m_k[None, :], other=0.0)  # [BR, BK]
        if HAS_INJECT:
            b_w += tl.load(p_inj + o_k[None, :], mask=m_inj[:, None] & m_k[None, :], other=0.0)
        if USE_DOT:
            b_acc = tl.dot(b_xw.to(b_w.dtype), tl.trans(b_w), b_acc, input_precision="ieee")
        else:
            b_acc += tl.sum(b_xw[:, None, :] * b_w.to(tl.float32)[None, :, :], 2)
    # partial: [S, M, RH] fp32, sumsq: [S, M] fp32
    p_p = partial + (i_s * M + o_m[:, None]).to(tl.int64) * RH + o_r[None, :]
    tl.store(p_p, b_acc, mask=m_m[:, None] & (o_r < RH)[None, :])
    if i_r == 0:
        tl.store(sumsq + i_s * M + o_m, b_sq, mask=m_m)


@triton.jit
def _hc_mix_kernel(partial, sumsq, mix, rstd, inject, M, R, RH, D, S, eps,
                   NH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, HAS_INJECT: tl.constexpr):
    i_m = tl.program_id(0).to(tl.int64)
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < S
    b_sq = tl.load(sumsq + o_s * M + i_m, mask=m_s, other=0.0)
    # splits are equal-sized and consecutive: split s belongs to branch s // (S / NH)
    spb = S // NH
    o_b = tl.arange(0, NH)
    in_b = ((o_s[None, :] // spb) == o_b[:, None]) & m_s[None, :]
    b_rb = tl.rsqrt(tl.sum(tl.where(in_b, b_sq[None, :], 0.0), 1) / D + eps)  # [NH]
    tl.store(rstd + i_m * NH + o_b, b_rb)
    o_r = tl.arange(0, BLOCK_R)
    m_r = o_r < RH
    b_v = tl.zeros([BLOCK_R], dtype=tl.float32)
    for i_s in range(0, S):
        r_s = tl.sum(tl.where(o_b == i_s // spb, b_rb, 0.0), 0)
        b_v += r_s * tl.load(partial + (i_s * M + i_m) * RH + o_r, mask=m_r, other=0.0)
    b_v = b_v / NH
    b_a = b_v * tl.sigmoid(b_v)
    tl.store(mix + i_m * R + o_r, b_a.to(mix.dtype.element_ty), mask=o_r < R)
    if HAS_INJECT:
        b_i = 2.0 * tl.sigmoid(b_v)
        tl.store(inject + i_m * NH + (o_r - R), b_i.to(inject.dtype.element_ty), mask=(o_r >= R) & m_r)


@triton.jit
def _hc_up_kernel(x, norm_w, mix, w_up, rstd, out, M, R, D,
                  stride_x, stride_wu, stride_o,
                  NH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
                  USE_DOT: tl.constexpr):
    i_m = tl.program_id(0)
    i_c = tl.program_id(1)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < M
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_c = o_c < D
    b_u = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    for b in tl.static_range(NH):
        b_g = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
        p_w = w_up + (b * D + o_c[:, None]).to(tl.int64) * stride_wu
        for k0 in range(0, R, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < R
            b_a = tl.load(mix + o_m[:, None].to(tl.int64) * R + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
            b_w = tl.load(p_w + o_k[None, :], mask=m_c[:, None] & m_k[None, :], other=0.0)  # [BC, BK]
            if USE_DOT:
                b_g = tl.dot(b_a, tl.trans(b_w), b_g, input_precision="ieee")
            else:
                b_g += tl.sum(b_a.to(tl.float32)[:, None, :] * b_w.to(tl.float32)[None, :, :], 2)
        b_x = tl.load(x + o_m[:, None].to(tl.int64) * stride_x + b * D + o_c[None, :],
                      mask=m_m[:, None] & m_c[None, :], other=0.0).to(tl.float32)
        b_nw = tl.load(norm_w + b * D + o_c, mask=m_c, other=0.0).to(tl.float32)
        b_r = tl.load(rstd + o_m * NH + b, mask=m_m, other=0.0)
        b_n = b_x * b_r[:, None] * (1.0 + b_nw)[None, :]
        b_u += tl.sigmoid(b_g) * b_n
    tl.store(out + o_m[:, None].to(tl.int64) * stride_o + o_c[None, :], (b_u / NH).to(out.dtype.element_ty),
             mask=m_m[:, None] & m_c[None, :])


@triton.jit
def _hc_down_rows_chunk(x, norm_w, w_down, w_inject, comb_inj, comb_u, comb_y, b_acc, b_sq, k0, i_m, i_r, i_s, o_r, o_i,
                        M, R, RH, D, stride_x, stride_wd, stride_wi, stride_ci, stride_cu, stride_cy,
                        KSPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, COMBINE: tl.constexpr):
    """One K chunk of `_hc_down_rows_kernel` for its BLOCK_M rows -> (b_acc, b_sq)."""
    o_kk = k0 + tl.arange(0, BLOCK_K)
    m_k = o_kk < KSPLIT
    o_k = i_s * KSPLIT + o_kk
    # rows [0, R) of W_dn, [R, RH) of W_inj (RH = R without it)
    b_w = hc_dot.load_w_tile(w_down, w_inject, o_r, o_k, m_k, R, RH, stride_wd, stride_wi).to(tl.float32)
    b_nw = 1.0 + tl.load(norm_w + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
    # one row at a time with the same [BR, BK] tile: a row's sums do not depend on how many rows
    # share the program (the where() selects, it adds nothing to other rows)
    for i in tl.static_range(BLOCK_M):
        m = i_m * BLOCK_M + i
        # rows past M load nothing: their K limit is 0 (a scalar-and-vector mask, one compare)
        m_x = o_kk < tl.where(m < M, KSPLIT, 0)
        b_x = tl.load(x + m.to(tl.int64) * stride_x + o_k, mask=m_x, other=0.0)
        if COMBINE:
            i_b = (i_s * KSPLIT) // D  # this split's branch
            b_u = tl.load(comb_u + m.to(tl.int64) * stride_cu + (o_k - i_b * D), mask=m_x, other=0.0).to(tl.float32)
            b_wi = tl.load(comb_inj + m.to(tl.int64) * stride_ci + i_b, mask=m < M, other=0.0).to(tl.float32)
            # x + inj·u rounded once: the fp32 product of 16-bit values is exact, so FMA contraction cannot change it
            b_x = (b_x.to(tl.float32) + b_wi * b_u).to(b_x.dtype)
            if i_r == 0:
                tl.store(comb_y + m.to(tl.int64) * stride_cy + o_k, b_x, mask=m_x)
        b_x = b_x.to(tl.float32)
        b_p = tl.sum(b_w * (b_x * b_nw)[None, :], 1)  # [BR]
        b_acc = tl.where((o_i == i)[:, None], b_acc + b_p[None, :], b_acc)
        b_sq = tl.where(o_i == i, b_sq + tl.sum(b_x * b_x, 0), b_sq)
    return b_acc, b_sq


@triton.jit
def _hc_down_rows_kernel(x, norm_w, w_down, w_inject, partial, sumsq, M, R, RH,
                         stride_x, stride_wd, stride_wi, stride_p, comb_inj, comb_u, comb_y, D, stride_ci, stride_cu,
                         stride_cy, KSPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_K: tl.constexpr, PDL: tl.constexpr, COMBINE: tl.constexpr):
    # grid (M tiles, row tiles of r + h, K splits): a program streams its [BLOCK_R, KSPLIT] slice of [W_dn; W_inj]
    # once and applies it to each of its BLOCK_M rows in turn (no tl.dot). COMBINE: x is the residual before a
    # block's write, applied here to each loaded slice (a split lies in one branch) and stored to comb_y
    if PDL:
        gdc_launch_dependents()  # the up kernel may start now: it loads W_up, then waits for this grid
    i_m = tl.program_id(0)
    i_r = tl.program_id(1)
    i_s = tl.program_id(2)
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    o_i = tl.arange(0, BLOCK_M)
    b_acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    b_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    if COMBINE:  # one chunk at a time (same sums in the same order): the write's loads spill on sm_70 unrolled
        for k0 in range(0, KSPLIT, BLOCK_K):
            b_acc, b_sq = _hc_down_rows_chunk(
                x, norm_w, w_down, w_inject, comb_inj, comb_u, comb_y, b_acc, b_sq, k0, i_m, i_r, i_s, o_r, o_i, M, R,
                RH, D, stride_x, stride_wd, stride_wi, stride_ci, stride_cu, stride_cy, KSPLIT, BLOCK_M, BLOCK_K, True)
    else:
        for k0 in tl.static_range(0, KSPLIT, BLOCK_K):  # unrolled: every chunk's loads can be in flight at once
            b_acc, b_sq = _hc_down_rows_chunk(
                x, norm_w, w_down, w_inject, comb_inj, comb_u, comb_y, b_acc, b_sq, k0, i_m, i_r, i_s, o_r, o_i, M, R,
                RH, D, stride_x, stride_wd, stride_wi, stride_ci, stride_cu, stride_cy, KSPLIT, BLOCK_M, BLOCK_K, False)
    o_m = i_m * BLOCK_M + o_i
    m_m = o_m < M
    # partial: [S, M, RH] fp32 (row stride stride_p), sumsq: [S, M] fp32
    tl.store(partial + (i_s * M + o_m[:, None]).to(tl.int64) * stride_p + o_r[None, :], b_acc,
             mask=m_m[:, None] & (o_r < RH)[None, :])
    if i_r == 0:
        tl.store(sumsq + i_s * M + o_m, b_sq, mask=m_m)


@triton.jit
def _hc_mix_row(partial, sumsq, m, M, RH, D, eps, stride_p, o_k, o_b, NH: tl.constexpr, S: tl.constexpr,
                BLOCK_S: tl.constexpr):
    """Row m's split-K reduction: (rstd per branch [NH], v = (W N) / h over the columns o_k)."""
    o_s = tl.arange(0, BLOCK_S)
    # splits are equal-sized and consecutive: split s belongs to branch s // (S / NH)
    in_b = ((o_s[None, :] // (S // NH)) == o_b[:, None]) & (o_s < S)[None, :]  # [NH, BS]
    n_s = tl.where(m < M, S, 0)  # rows past M load nothing
    b_sq = tl.load(sumsq + o_s * M + m, mask=o_s < n_s, other=0.0)  # [BS]
    b_rb = tl.rsqrt(tl.sum(tl.where(in_b, b_sq[None, :], 0.0), 1) / D + eps)  # [NH]
    b_rs = tl.sum(tl.where(in_b, b_rb[:, None], 0.0), 0)  # [BS] rstd of each split's branch
    b_p = tl.load(partial + (o_s[:, None] * M + m).to(tl.int64) * stride_p + o_k[None, :],
                  mask=(o_s < n_s)[:, None] & (o_k < RH)[None, :], other=0.0)  # [BS, BK]
    return b_rb, tl.sum(b_p * b_rs[:, None], 0) / NH


@triton.jit
def _hc_mix_rows_kernel(partial, sumsq, mix, rstd, inject, M, R, RH, D, eps, stride_p,
                        NH: tl.constexpr, S: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
                        HAS_INJECT: tl.constexpr, PDL: tl.constexpr):
    # grid (M, column tiles of r + h): the split-K reduction, SiLU, the inject sigmoid, rstd
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    m = tl.program_id(0)
    o_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    o_b = tl.arange(0, NH)
    b_rb, b_v = _hc_mix_row(partial, sumsq, m, M, RH, D, eps, stride_p, o_k, o_b, NH, S, BLOCK_S)
    tl.store(mix + m.to(tl.int64) * R + o_k, (b_v * tl.sigmoid(b_v)).to(mix.dtype.element_ty), mask=o_k < R)
    if HAS_INJECT:
        tl.store(inject + m * NH + (o_k - R), (2.0 * tl.sigmoid(b_v)).to(inject.dtype.element_ty),
                 mask=(o_k >= R) & (o_k < RH))
    if tl.program_id(1) == 0:
        tl.store(rstd + m * NH + o_b, b_rb)


@triton.jit
def _hc_up_rows_a(partial, sumsq, mix, m, M, R, D, eps, stride_p, o_k, o_b, dtype, NH: tl.constexpr,
                  S: tl.constexpr, BLOCK_S: tl.constexpr, FUSED_MIX: tl.constexpr):
    """`a` of row m over the columns o_k (0 past r and for rows past M), fp32 holding x.dtype values."""
    n_k = tl.where(m < M, R, 0)
    if FUSED_MIX:
        _, b_v = _hc_mix_row(partial, sumsq, m, M, R, D, eps, stride_p, o_k, o_b, NH, S, BLOCK_S)
        # `a` is the second matmul's input: rounded to x.dtype as the layer rounds it
        return tl.where(o_k < n_k, (b_v * tl.sigmoid(b_v)).to(dtype).to(tl.float32), 0.0)
    return tl.load(mix + m.to(tl.int64) * R + o_k, mask=o_k < n_k, other=0.0).to(tl.float32)


@triton.jit
def _hc_up_rows_kernel(x, norm_w, w_up, partial, sumsq, mix, rstd, out, inject, M, R, RH, D, eps,
                       stride_x, stride_wu, stride_p, stride_o,
                       NH: tl.constexpr, S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
                       BLOCK_K1: tl.constexpr, BLOCK_K2: tl.constexpr, BLOCK_S: tl.constexpr,
                       FUSED_MIX: tl.constexpr, HAS_INJECT: tl.constexpr, PDL: tl.constexpr):
    # grid (M tiles, column tiles c of d): the rows b·d + c of W_up for every branch b, loaded once in
    # two K pieces (r = 320 = 256 + 64: no padding to 512) and applied to each row in turn; per row
    # `a` comes from the mix launch or (FUSED_MIX) from the split-K reduction redone by every program
    i_m = tl.program_id(0)
    i_c = tl.program_id(1)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_c = o_c < D
    o_b = tl.arange(0, NH)
    o_bc = o_b[:, None] * D + o_c[None, :]  # [NH, BC] feature index in the wide residual
    m_bc = m_c[None, :] & (o_b < NH)[:, None]
    p_w = w_up + o_bc[:, :, None].to(tl.int64) * stride_wu
    o_k1 = tl.arange(0, BLOCK_K1)
    b_w1 = tl.load(p_w + o_k1[None, None, :], mask=m_bc[:, :, None] & (o_k1 < R)[None, None, :], other=0.0)
    if BLOCK_K2 > 0:
        o_k2 = BLOCK_K1 + tl.arange(0, BLOCK_K2)
        b_w2 = tl.load(p_w + o_k2[None, None, :], mask=m_bc[:, :, None] & (o_k2 < R)[None, None, :], other=0.0)
    b_nw = 1.0 + tl.load(norm_w + o_bc, mask=m_bc, other=0.0).to(tl.float32)  # [NH, BC]
    if PDL:
        gdc_wait()  # the previous grid's results are complete and visible from here on; W_up is in flight
    for i in tl.static_range(BLOCK_M):
        m = i_m * BLOCK_M + i
        n_c = tl.where(m < M, D, 0)  # rows past M load and store nothing
        b_a = _hc_up_rows_a(partial, sumsq, mix, m, M, R, D, eps, stride_p, o_k1, o_b, x.dtype.element_ty, NH, S,
                            BLOCK_S, FUSED_MIX)
        b_g = tl.sum(b_w1.to(tl.float32) * b_a[None, None, :], 2)  # [NH, BC]
        if BLOCK_K2 > 0:
            b_a = _hc_up_rows_a(partial, sumsq, mix, m, M, R, D, eps, stride_p, o_k2, o_b, x.dtype.element_ty, NH,
                                S, BLOCK_S, FUSED_MIX)
            b_g += tl.sum(b_w2.to(tl.float32) * b_a[None, None, :], 2)
        if FUSED_MIX:
            b_rb, b_v = _hc_mix_row(partial, sumsq, m, M, RH, D, eps, stride_p, R + o_b, o_b, NH, S, BLOCK_S)
            if HAS_INJECT:
                if i_c == 0:
                    tl.store(inject + m * NH + o_b, (2.0 * tl.sigmoid(b_v)).to(inject.dtype.element_ty),
                             mask=o_b < tl.where(m < M, NH, 0))
        else:
            b_rb = tl.load(rstd + m * NH + o_b, mask=o_b < tl.where(m < M, NH, 0), other=0.0)
        b_x = tl.load(x + m.to(tl.int64) * stride_x + o_bc, mask=m_bc & (o_c < n_c)[None, :], other=0.0).to(tl.float32)
        b_u = tl.sum(tl.sigmoid(b_g) * (b_x * b_rb[:, None] * b_nw), 0) / NH  # [BC]
        tl.store(out + m.to(tl.int64) * stride_o + o_c, b_u.to(out.dtype.element_ty), mask=o_c < n_c)


def hc_config(M: int, d: int, r: int, hc_count: int, arch: int | None = None, dot: bool | None = None) -> dict:
    """Launch config for M tokens (also used by the AOT compile tests and the benchmark).

    M <= MAX_M of `hc_rows_default()` (decode / verify): the rows kernels, one config for every such M
    apart from BLOCK_M, so a row's arithmetic does not depend on the batch. Above: the tl.dot tiles.
    dot: the dot passes for MIN_M..MAX_M of `hc_dot_default()` (None: its ENABLED; rows 1-3 round differently)
    """
    small = hc_dot_default(arch)
    if (small["ENABLED"] if dot is None else dot) and small["MIN_M"] <= M <= small["MAX_M"]:
        return rows_config(small, M, d, r, hc_count)
    rows = hc_rows_default(arch)
    if M <= rows["MAX_M"]:
        return rows_config(rows, M, d, r, hc_count)
    return hc_config_tiles(M, d, r, hc_count, arch)


def hc_rows_default(arch: int | None = None) -> dict:
    """The small-M default, in one place (benchmarks/bench_moe_hc.py times variants of it beside the
    tiled kernels and the torch reference).

    MAX_M: the largest M it serves; BLOCK_M: rows per program (a loop, not a tile); BLOCK_R: rows of
    [W_dn; W_inj] per down program; SPLITS_PER_BRANCH: K splits of each branch's d columns; BLOCK_K:
    the down pass's K chunk; FUSED_MIX: no mix launch (the up programs reduce the splits themselves);
    BLOCK_C: columns of d (times h branches of W_up rows) per up program; WARPS_*: warps per launch;
    PDL: programmatic dependent launch of the mix and up kernels (sm90+ only); DOWN / UP: "rows" (these
    kernels) or "dot" (kernels/hc_dot.py, `hc_dot_default`); UP_BLOCK_K: the dot up pass's K chunk (0: two
    pieces loaded at once).
    """
    # H200, 2026-12-04 (RESULTS.md K7c): BLOCK_C=4 with 4 warps beat 8/8 by 12% at M=5 and 11% at M=8 (tied
    # at M=1); from M=16 the tiled kernels win (27 vs 41 us), so the rows kernels stop at 8
    rows = dict(KIND="rows", MAX_M=8, BLOCK_M=8, BLOCK_R=16, SPLITS_PER_BRANCH=5, BLOCK_K=512, WARPS_DOWN=4,
                FUSED_MIX=False, BLOCK_C=4, WARPS_UP=4, PDL=True, DOWN="rows", UP="rows",
                UP_BLOCK_K=0)
    if arch == 70:  # ptxas for sm_70 holds the down kernel's 512-wide chunk in 80 registers and spills
        rows["BLOCK_K"] = 256
    return rows


def hc_dot_default(arch: int | None = None) -> dict:
    """The tl.dot passes for MIN_M <= M <= MAX_M (kernels/hc_dot.py), ENABLED in `hc_config` or not.

    Same keys as `hc_rows_default` (rows past M in a 16-row tile are masked, so BLOCK_M is not used):
    down grid (row tiles of BLOCK_R, h·SPLITS_PER_BRANCH K splits) = 11 x 20 = 220 programs of 32 KB of
    W_dn at the real shapes, up grid d / BLOCK_C = 320 programs of 20 KB of W_up (h·BLOCK_C = 32 rows).
    ENABLED on sm90+ for M = 4-16: on the H200 (RESULTS.md K7c, tree 9a3e24b) 12.4-13.8 us per read at M = 4, 5,
    8, 16 against 19.0 / 26.4 / 29.3 (rows) and 26.8 (tiles, M = 16); at M = 1 the rows kernels stay faster (9.7
    against 13.0), so rows 1-3 keep them. Off elsewhere: not measured on sm80-89, and on sm_70 tl.dot is FMA.
    """
    dot = dict(hc_rows_default(arch), DOWN="dot", UP="dot", ENABLED=arch is not None and arch >= 90, MIN_M=4,
               MAX_M=16, BLOCK_R=32, BLOCK_K=256, BLOCK_C=8, UP_BLOCK_K=0)
    if arch == 70:  # tl.dot is FMA on sm_70 (no Volta MMA in Triton) and holds a whole K chunk per thread:
        dot.update(BLOCK_R=16, BLOCK_K=64, UP_BLOCK_K=32)  # 168 / 141 registers; K = 128 / 256 chunks spill
    return dot


def rows_config(base: dict, M: int, d: int, r: int, hc_count: int) -> dict:
    """`base` (a "rows" config) fitted to the shapes.

    BLOCK_M: at most next_pow2(M) rows per program; SPLITS_PER_BRANCH: the largest divisor of d not
    above the asked one.
    """
    spb = max(s for s in range(1, base["SPLITS_PER_BRANCH"] + 1) if d % s == 0)
    return dict(base, BLOCK_M=min(base["BLOCK_M"], triton.next_power_of_2(max(M, 1))), SPLITS_PER_BRANCH=spb)


def hc_config_tiles(M: int, d: int, r: int, hc_count: int, arch: int | None = None) -> dict:
    """The tiled kernels' config (KIND "tiles"; before the rows kernels, also M <= 8).

    M <= 8: GEMV-like (no tl.dot), BM·BR·BK <= 4K fp32 products per 128 threads (no sm70 spills), the
    K dimension split so that the down pass has several hundred CTAs. Larger M: tl.dot tiles, smaller
    on sm70 (FMA dots).
    """
    if M <= 8:
        bm = triton.next_power_of_2(M)
        br, bk = {1: (16, 256), 2: (16, 128), 4: (16, 64), 8: (16, 32)}[bm]
        bc, bk_up = {1: (16, 256), 2: (16, 128), 4: (16, 64), 8: (8, 64)}[bm]
        fits = [s for s in range(1, 11) if d % s == 0 and (d // s) % bk == 0]
        splits = max(fits) if fits else max(s for s in range(1, 9) if d % s == 0)
        return dict(KIND="tiles", BLOCK_M=bm, BLOCK_R=br, BLOCK_K=bk, SPLITS_PER_BRANCH=splits, BLOCK_C=bc,
                    BLOCK_K_UP=bk_up, USE_DOT=False, num_warps=4)
    splits = 1 if M > 64 else max(s for s in (1, 2, 4) if d % s == 0)
    if arch == 70:
        return dict(KIND="tiles", BLOCK_M=16, BLOCK_R=32, BLOCK_K=32, SPLITS_PER_BRANCH=splits, BLOCK_C=32,
                    BLOCK_K_UP=32, USE_DOT=True, num_warps=4)
    if M <= 64:
        return dict(KIND="tiles", BLOCK_M=16, BLOCK_R=64, BLOCK_K=64, SPLITS_PER_BRANCH=splits, BLOCK_C=32,
                    BLOCK_K_UP=64, USE_DOT=True, num_warps=4)
    return dict(KIND="tiles", BLOCK_M=64, BLOCK_R=128, BLOCK_K=64, SPLITS_PER_BRANCH=1, BLOCK_C=64, BLOCK_K_UP=64,
                USE_DOT=True, num_warps=8)


def _arch(x: Tensor) -> int | None:
    if not x.is_cuda:
        return None
    major, minor = torch.cuda.get_device_capability(x.device)
    return 10 * major + minor


def hc_read(x: Tensor, norm_w: Tensor, w_down: Tensor, w_up: Tensor, w_inject: Tensor | None,
            hc_count: int, eps: float, path: str = "auto", config: dict | None = None) -> tuple[Tensor, Tensor | None]:
    """Triton version of `hc_read_ref` (path="torch" runs the reference on cuBLAS).

    path "auto" and "triton" are the kernels with `config` (default `hc_config`: the rows kernels at
    small M, the tiled ones above; a config from `hc_config_tiles` runs the tiled kernels at any M).
    """
    if path == "torch":
        return hc_read_ref(x, norm_w, w_down, w_up, w_inject, hc_count, eps)
    if path not in ("auto", "triton"):
        raise ValueError(f"hc_read path={path!r}; use 'auto', 'triton' or 'torch'")
    out, inject, cfg, arch = _read_setup(x, norm_w, w_down, w_up, w_inject, hc_count, config)
    if x.shape[0] > 0:
        (_read_rows if cfg["KIND"] == "rows" else _read_tiles)(x, norm_w, w_down, w_up, w_inject, out, inject, hc_count,
                                                               eps, cfg, arch)
    return out, inject


def _read_setup(x, norm_w, w_down, w_up, w_inject, h, config):
    """Checks the operands -> (block input [M, d], inject [M, h] or None (uninitialised), config, arch)."""
    assert x.dim() == 2 and x.stride(-1) == 1, (x.shape, x.stride())
    M, wide = x.shape
    d, r = wide // h, w_down.shape[0]
    assert wide == h * d and norm_w.shape == (wide,) and norm_w.is_contiguous(), (x.shape, norm_w.shape, h)
    assert w_down.shape == (r, wide) and w_up.shape == (wide, r), (w_down.shape, w_up.shape)
    assert w_down.stride(-1) == 1 and w_up.is_contiguous(), (w_down.stride(), w_up.stride())
    assert w_inject is None or (w_inject.shape == (h, wide) and w_inject.stride(-1) == 1), w_inject
    assert x.dtype == w_down.dtype == w_up.dtype, (x.dtype, w_down.dtype, w_up.dtype)
    assert h & (h - 1) == 0, "hc_count must be a power of two"
    out = torch.empty(M, d, dtype=x.dtype, device=x.device)
    inject = torch.empty(M, h, dtype=x.dtype, device=x.device) if w_inject is not None else None
    arch = _arch(x)
    return out, inject, config or hc_config(max(M, 1), d, r, h, arch), arch


def hc_combine_read_ref(x: Tensor, inject: Tensor, u: Tensor, norm_w: Tensor, w_down: Tensor, w_up: Tensor,
                        w_inject: Tensor | None, hc_count: int, eps: float) -> tuple[Tensor, Tensor, Tensor | None]:
    """A block's HC write rounded once, then the next HC read: (y = hc_combine_once_ref(x, inject, u), *hc_read_ref(y))."""
    y = hc_combine_once_ref(x, inject, u)
    return y, *hc_read_ref(y, norm_w, w_down, w_up, w_inject, hc_count, eps)


def hc_combine_read(x: Tensor, inject: Tensor, u: Tensor, norm_w: Tensor, w_down: Tensor, w_up: Tensor,
                    w_inject: Tensor | None, hc_count: int, eps: float, config: dict | None = None
                    ) -> tuple[Tensor, Tensor, Tensor | None]:
    """A block's write then `hc_read` of the result. x: [M, h·d], inject: [M, h], u: [M, d] -> (y [M, h·d], block
    input, inject gates). With the rows or dot down pass in 16 bits one launch fewer: y = hc_combine_once_ref
    (product and sum rounded once: an H200 contracted the layer's product rounding into an FMA), the read bitwise
    `hc_read(y)`; otherwise (fp32, tiles) the two calls `hc_combine` (the layer's rounding) and `hc_read`."""
    out, inj_out, cfg, arch = _read_setup(x, norm_w, w_down, w_up, w_inject, hc_count, config)
    if x.shape[0] == 0 or cfg["KIND"] != "rows" or x.dtype not in (torch.float16, torch.bfloat16):
        y = hc_combine(x, inject, u)
        return (y, *hc_read(y, norm_w, w_down, w_up, w_inject, hc_count, eps, config=config))
    assert inject.shape == (x.shape[0], hc_count) and x.shape[1] == hc_count * u.shape[1] and inject.stride(-1) == 1 \
        and u.stride(-1) == 1 and x.dtype == inject.dtype == u.dtype, (x.shape, inject.shape, u.shape)
    y = torch.empty_like(x)  # not in place: other down programs still read x
    _read_rows(x, norm_w, w_down, w_up, w_inject, out, inj_out, hc_count, eps, cfg, arch, combine=(inject, u, y))
    return y, out, inj_out


def up_k_pieces(r: int) -> tuple[int, int]:
    """The up kernel's two power-of-two K pieces covering r (320 -> 256 + 64; 16 -> 16 + 0)."""
    k1 = 1 << (r.bit_length() - 1)
    return k1, (triton.next_power_of_2(r - k1) if r > k1 else 0)


def _read_rows(x, norm_w, w_down, w_up, w_inject, out, inject, h, eps, cfg, arch, combine=None):
    """The down pass writes per-split partial sums; the up pass reduces them itself (FUSED_MIX, two
    launches) or reads `a` and rstd from a small mix launch between the two. DOWN / UP "dot": that pass
    on tl.dot over 16-row tiles (kernels/hc_dot.py; the same workspaces). combine: (inject, u, y) of the
    write the rows down pass applies first (`hc_combine_read`); the later passes then read y."""
    M, wide = x.shape
    d, r = wide // h, w_down.shape[0]
    rh = r + (h if w_inject is not None else 0)
    spb = cfg["SPLITS_PER_BRANCH"]
    assert d % spb == 0, (d, spb)
    S, ksplit, bm, fused = h * spb, d // spb, cfg["BLOCK_M"], cfg["FUSED_MIX"]
    stride_p = triton.cdiv(rh, 16) * 16  # 64-byte rows: loads of them vectorise
    partial = torch.empty(S, M, stride_p, dtype=torch.float32, device=x.device)
    sumsq = torch.empty(S, M, dtype=torch.float32, device=x.device)
    mix = partial if fused else torch.empty(M, r, dtype=x.dtype, device=x.device)
    rstd = sumsq if fused else torch.empty(M, h, dtype=torch.float32, device=x.device)
    # programmatic dependent launch (sm90+; not under the interpreter): the later launches start while
    # the down pass streams, so their W_up loads overlap it and their launch latency is hidden
    pdl = bool(cfg["PDL"]) and pdl_allowed(arch)
    extra = pdl_launch(pdl)
    has_inj = w_inject is not None
    inj = inject if has_inj else out
    k1, k2 = up_k_pieces(r)
    hc_dot.check_dot_config(cfg, h)
    # the interpreter's tl.dot multiplies bf16 storage as integers: hand it fp32 operands of the same values
    dot_f32 = x.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") == "1"
    if cfg["DOWN"] == "dot":
        hc_dot.launch_down_dot(x, norm_w, w_down, w_inject, partial, sumsq, r, rh, S, ksplit, stride_p, cfg, dot_f32,
                               pdl, combine)
    else:
        _launch_down_rows(x, norm_w, w_down, w_inject, partial, sumsq, r, rh, S, ksplit, stride_p, cfg, pdl, combine)
    x = x if combine is None else combine[2]
    if not fused:
        _hc_mix_rows_kernel[(M, triton.cdiv(rh, 128))](
            partial, sumsq, mix, rstd, inj, M, r, rh, d, eps, stride_p, NH=h, S=S, BLOCK_K=128,
            BLOCK_S=triton.next_power_of_2(S), HAS_INJECT=has_inj, PDL=pdl, num_warps=4, **extra)
    if cfg["UP"] == "dot":
        hc_dot.launch_up_dot(x, norm_w, w_up, mix, rstd, out, h, cfg, dot_f32, pdl)
        return
    _hc_up_rows_kernel[(triton.cdiv(M, bm), triton.cdiv(d, cfg["BLOCK_C"]))](
        x, norm_w, w_up, partial, sumsq, mix, rstd, out, inj, M, r, rh, d, eps,
        x.stride(0), w_up.stride(0), stride_p, out.stride(0),
        NH=h, S=S, BLOCK_M=bm, BLOCK_C=cfg["BLOCK_C"], BLOCK_K1=k1, BLOCK_K2=k2, BLOCK_S=triton.next_power_of_2(S), FUSED_MIX=fused, HAS_INJECT=has_inj, PDL=pdl, num_warps=cfg["WARPS_UP"],
        **extra)


def _launch_down_rows(x, norm_w, w_down, w_inject, partial, sumsq, r, rh, S, ksplit, stride_p, cfg, pdl, combine=None):
    M, bm = x.shape[0], cfg["BLOCK_M"]
    has_inj = w_inject is not None
    c_inj, c_u, c_y = combine if combine is not None else (x, x, x)  # unused without COMBINE
    _hc_down_rows_kernel[(triton.cdiv(M, bm), triton.cdiv(rh, cfg["BLOCK_R"]), S)](
        x, norm_w, w_down, w_inject if has_inj else w_down, partial, sumsq, M, r, rh,
        x.stride(0), w_down.stride(0), w_inject.stride(0) if has_inj else 0, stride_p, c_inj, c_u, c_y,
        x.shape[1] // (S // cfg["SPLITS_PER_BRANCH"]), c_inj.stride(0), c_u.stride(0), c_y.stride(0),
        KSPLIT=ksplit, BLOCK_M=bm, BLOCK_R=cfg["BLOCK_R"], BLOCK_K=min(cfg["BLOCK_K"], triton.next_power_of_2(ksplit)),
        PDL=pdl, COMBINE=combine is not None, num_warps=cfg["WARPS_DOWN"])


def _read_tiles(x, norm_w, w_down, w_up, w_inject, out, inject, h, eps, cfg, arch):
    """Three launches: down (split K), mix (one program per row), up."""
    M, wide = x.shape
    d, r = wide // h, w_down.shape[0]
    dev = x.device
    rh = r + (h if w_inject is not None else 0)
    spb = cfg["SPLITS_PER_BRANCH"]
    assert d % spb == 0, (d, spb)
    S = h * spb
    partial = torch.empty(S, M, rh, dtype=torch.float32, device=dev)
    sumsq = torch.empty(S, M, dtype=torch.float32, device=dev)
    mix = torch.empty(M, r, dtype=x.dtype, device=dev)
    rstd = torch.empty(M, h, dtype=torch.float32, device=dev)
    bm = cfg["BLOCK_M"]
    _hc_down_kernel[(triton.cdiv(M, bm), triton.cdiv(rh, cfg["BLOCK_R"]), S)](
        x, norm_w, w_down, w_inject if w_inject is not None else w_down, partial, sumsq, M, r, rh, wide, d // spb,
        x.stride(0), w_down.stride(0), w_inject.stride(0) if w_inject is not None else 0,
        BLOCK_M=bm, BLOCK_R=cfg["BLOCK_R"], BLOCK_K=cfg["BLOCK_K"], HAS_INJECT=w_inject is not None,
        USE_DOT=cfg["USE_DOT"], num_warps=cfg["num_warps"])
    _hc_mix_kernel[(M,)](partial, sumsq, mix, rstd, inject if inject is not None else rstd, M, r, rh, d, S, eps,
                         NH=h, BLOCK_R=triton.next_power_of_2(rh), BLOCK_S=triton.next_power_of_2(S),
                         HAS_INJECT=w_inject is not None, num_warps=4)
    _hc_up_kernel[(triton.cdiv(M, bm), triton.cdiv(d, cfg["BLOCK_C"]))](
        x, norm_w, mix, w_up, rstd, out, M, r, d, x.stride(0), w_up.stride(0), out.stride(0),
        NH=h, BLOCK_M=bm, BLOCK_C=cfg["BLOCK_C"], BLOCK_K=cfg["BLOCK_K_UP"], USE_DOT=cfg["USE_DOT"],
        num_warps=cfg["num_warps"])

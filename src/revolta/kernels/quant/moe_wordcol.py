"""The packed-expert MoE on CUDA cores (kernels/quant/moe.py, config key WORDCOL): AWQ experts through gemv_wordcol.py's
word-column walk, one thread per packed word column, instead of tl.dot over 16 padded rows.

Every (token, slot) pair is its own program row (grid axis 0: pair = token·k + slot over the M·k pairs, the shared
expert riding as slot k - 1 with id num_routed), so a program is (pair, N tile, K slice). At M = 1 the pairs are
distinct experts; at M > 1 an expert chosen by several tokens is read once per token (M = 8, top-10 of 512 + the
shared expert: 88 pairs over ~76 distinct experts, 1.16x their bytes; M = 40: 1.6x), which the walk's fewer
instructions a weight repay: on an H100 2.0-2.1x faster than the grouped tl.dot path at 5-40 tokens on fp16 pairs,
1.4-1.6x with the fp32 walk in bf16 (RESULTS.md K5h), so it is the default up to moe.MOE_WORDCOL_MAX_TOKENS. gate_up
programs compute the gate and up sums of their features over their slice of the hidden size; one slice writes act =
SiLU(gate)·up (rounded to x.dtype once), several write fp32 partials to ws [SPLIT_UP, T, 2I] for
moe_decode._split_act_kernel, as the nibble path does. down programs write y rows pair·SPLIT_DOWN + s = w_pair ·
(act[pair, K slice s] @ down_eᵀ), which moe._moe_sum_kernel adds in order per token; with FIXUP
both adds happen inside the two kernels instead (common.splitk_fixup's counting: the last program of each gate_up
tile forms its act, the last of each (token, down tile)'s k · SPLIT_DOWN programs sums its y rows into the output),
two launches fewer, the same sums. Fixed order everywhere: bitwise reproducible, no host sync (CUDA-graph safe).

JOINT (fp16 pairs): gate and up walked together (gemv_wordcol.wordcol_slice2_half2): each step loads both weights'
words, so twice the loads are in flight a thread and the dependent steps halve; bf16 tokens also share one step
scale. Each sum is bitwise the two walks'. It needs about twice the registers: slower for fp16 tokens, faster for
bf16 in 32-row steps (RESULTS.md K5n), where moe.moe_wordcol_config turns it on. PDL: the gate_up, split-act, down
and slot-sum launches chained by programmatic dependent launch (kernels/pdl.py, sm_90): each grid is scheduled
while the one before it runs and waits inside before its first read, which hides the launch gaps of one token's
short kernels (K5n); the outputs do not change.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..pdl import pdl_start
from .common import splitk_last, splitk_sum
from .gemv_wordcol import _feature, wordcol_slice, wordcol_slice2_half2
from .moe_decode import _down_operands, _gate_up_operands


@triton.jit
def _act_store(act, ws, g, u, pair, o_f, m_w, T, I, stride_am, i_k, SPLIT: tl.constexpr, j: tl.constexpr):
    col = o_f * 8 + _feature(j)  # [W] features of nibble j
    if SPLIT == 1:
        tl.store(act + pair * stride_am + col, (g * tl.sigmoid(g) * u).to(act.dtype.element_ty), mask=m_w)
    else:
        p_w = ws + (i_k * T + pair) * (2 * I) + col
        tl.store(p_w, g, mask=m_w)
        tl.store(p_w + I, u, mask=m_w)


@triton.jit
def _wordcol_gate_up_kernel(x, w0, w1, w2, sg0, sg1, sg2, su0, su1, su2, act, ws, topk_ids, num_routed, H, I, T,
                            stride_xm, stride_e0, stride_e1, stride_e2, stride_am, k_split, TOP_K: tl.constexpr,
                            G: tl.constexpr,
                            BLOCK_N: tl.constexpr, HAS_SHARED: tl.constexpr, SPLIT: tl.constexpr,
                            EVEN: tl.constexpr, ROWS: tl.constexpr, PREFETCH: tl.constexpr,
                            HALF2: tl.constexpr = False, ASM: tl.constexpr = True, counters=None,
                            FIXUP: tl.constexpr = False, order=None, EXPERT_ORDER: tl.constexpr = False,
                            JOINT: tl.constexpr = False, PDL: tl.constexpr = False):
    """act [T, I] = SiLU(gate)·up in x.dtype (SPLIT == 1) or K slice program_id(2) of gate and up to ws [SPLIT, T, 2I];
    x [M, H]; pair = program_id(0) = token·TOP_K + slot, its expert topk_ids[pair] (the shared expert: num_routed).
    ROWS, PREFETCH, HALF2, ASM: gemv_wordcol.wordcol_slice's. FIXUP (SPLIT > 1): the last of a (pair, N tile)'s
    slices writes its act from ws (`_act_fixup`; int32 counters, one a (pair, N tile)) instead of _split_act_kernel.
    EXPERT_ORDER: program row r walks pair order[r] (pairs sorted by expert, moe_group), so the pairs of an expert
    several tokens chose run side by side and the later ones read its words from L2. JOINT (HALF2): gate and up in
    one walk (gemv_wordcol.wordcol_slice2_half2), bitwise the two walks' sums. PDL: `pdl_start`."""
    pdl_start(PDL)
    pair = tl.load(order + tl.program_id(0)) if EXPERT_ORDER else tl.program_id(0)
    x_row = x + (pair // TOP_K).to(tl.int64) * stride_xm
    i_n = tl.program_id(1)
    i_k = tl.program_id(2)
    i_e = tl.load(topk_ids + pair).to(tl.int64)
    g0, g1, g2, n_g, u0, u1, u2, n_u, N = _gate_up_operands(w0, w1, w2, sg0, sg1, sg2, su0, su1, su2, i_e, i_n,
                                                            num_routed, I, stride_e0, stride_e1, stride_e2, BLOCK_N,
                                                            HAS_SHARED)
    W: tl.constexpr = BLOCK_N // 8
    o_f = i_n * W + tl.arange(0, W)  # the program's words among the I / 8 of gate (and of up)
    m_w = None if EVEN else o_f < I // 8
    k_lo = i_k * k_split
    k_hi = tl.minimum(k_lo + k_split, H)
    if JOINT:  # gate and up in one walk: both weights' words of a step in flight together
        tl.static_assert(HALF2, "JOINT walks fp16 pairs (HALF2)")
        g_0, g_1, g_2, g_3, g_4, g_5, g_6, g_7, u_0, u_1, u_2, u_3, u_4, u_5, u_6, u_7 = wordcol_slice2_half2(
            x_row, g0, g1, g2, n_g // 8 + tl.arange(0, W), u0, u1, u2, n_u // 8 + tl.arange(0, W), m_w, N, k_lo, k_hi,
            G, W, ROWS, ASM)
    else:
        g_0, g_1, g_2, g_3, g_4, g_5, g_6, g_7 = wordcol_slice(x_row, g0, g1, g2, n_g // 8 + tl.arange(0, W), m_w,
                                                               N, k_lo, k_hi, G, W, ROWS, PREFETCH, HALF2, ASM)
        u_0, u_1, u_2, u_3, u_4, u_5, u_6, u_7 = wordcol_slice(x_row, u0, u1, u2, n_u // 8 + tl.arange(0, W), m_w,
                                                               N, k_lo, k_hi, G, W, ROWS, PREFETCH, HALF2, ASM)
    _act_store(act, ws, g_0, u_0, pair, o_f, m_w, T, I, stride_am, i_k, SPLIT, 0)
    _act_store(act, ws, g_1, u_1, pair, o_f, m_w, T, I, stride_am, i_k, SPLIT, 1)
    _act_store(act, ws, g_2, u_2, pair, o_f, m_w, T, I, stride_am, i_k, SPLIT, 2)
    _act_store(act, ws, g_3, u_3, pair, o_f, m_w, T, I, stride_am, i_k, SPLIT, 3)
    _act_store(act, ws, g_4, u_4, pair, o_f, m_w, T, I, stride_am, i_k, SPLIT, 4)
    _act_store(act, ws, g_5, u_5, pair, o_f, m_w, T, I, stride_am, i_k, SPLIT, 5)
    _act_store(act, ws, g_6, u_6, pair, o_f, m_w, T, I, stride_am, i_k, SPLIT, 6)
    _act_store(act, ws, g_7, u_7, pair, o_f, m_w, T, I, stride_am, i_k, SPLIT, 7)
    if FIXUP:
        _act_fixup(act, ws, counters, pair, i_n, T, I, stride_am, SPLIT, BLOCK_N)


@triton.jit
def _act_fixup(act, ws, counters, pair, i_n, T, I, stride_am, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """The last K slice of (pair, N tile i_n) writes act[pair, tile] = SiLU(Σ_s gate_s)·Σ_s up_s from ws [SPLIT, T, 2I]
    (moe_decode._split_act_kernel's sums and rounding: bitwise the same act)."""
    if splitk_last(counters, pair * tl.num_programs(1) + i_n, SPLIT):
        o = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # the tile's features of gate (of up: I further)
        m = o < I
        p = ws + pair.to(tl.int64) * (2 * I) + o
        g = splitk_sum(p, m, T * 2 * I, SPLIT)
        u = splitk_sum(p + I, m, T * 2 * I, SPLIT)
        tl.store(act + pair * stride_am + o, (g * tl.sigmoid(g) * u).to(act.dtype.element_ty), mask=m)


@triton.jit
def _y_store(y, a, rw, pair, o_w, m_w, stride_ym, i_k, SPLIT: tl.constexpr, j: tl.constexpr):
    tl.store(y + (pair * SPLIT + i_k) * stride_ym + o_w * 8 + _feature(j), a * rw, mask=m_w)


@triton.jit
def _wordcol_down_kernel(act, w0, w1, w2, sd0, sd1, sd2, topk_weights, y, topk_ids, num_routed, H, I, stride_am,
                         stride_e0, stride_e1, stride_e2, stride_ym, k_split, G: tl.constexpr, BLOCK_N: tl.constexpr,
                         HAS_SHARED: tl.constexpr, SPLIT: tl.constexpr, EVEN: tl.constexpr, ROWS: tl.constexpr,
                         PREFETCH: tl.constexpr, HALF2: tl.constexpr = False, ASM: tl.constexpr = True,
                         out=None, counters=None, TOP_K: tl.constexpr = 1, FIXUP: tl.constexpr = False,
                         order=None, EXPERT_ORDER: tl.constexpr = False, PDL: tl.constexpr = False):
    """y [T·SPLIT, H] fp32: row pair·SPLIT + s = w_pair · (act[pair, K slice s] @ down_e[:, K slice s]ᵀ). FIXUP: the
    last of a (token, N tile)'s TOP_K·SPLIT programs also writes out [M, H] (`_sum_fixup`; int32 counters, one a
    (token, N tile)) instead of moe._moe_sum_kernel. EXPERT_ORDER, PDL: as _wordcol_gate_up_kernel's."""
    pdl_start(PDL)
    pair = tl.load(order + tl.program_id(0)) if EXPERT_ORDER else tl.program_id(0)
    i_n = tl.program_id(1)
    i_k = tl.program_id(2)
    i_e = tl.load(topk_ids + pair).to(tl.int64)
    d0, d1, d2 = _down_operands(w0, w1, w2, sd0, sd1, sd2, i_e, num_routed, stride_e0, stride_e1, stride_e2,
                                HAS_SHARED)
    W: tl.constexpr = BLOCK_N // 8
    o_w = i_n * W + tl.arange(0, W)
    m_w = None if EVEN else o_w < H // 8
    k_lo = i_k * k_split
    k_hi = tl.minimum(k_lo + k_split, I)
    a_0, a_1, a_2, a_3, a_4, a_5, a_6, a_7 = wordcol_slice(act + pair * stride_am, d0, d1, d2, o_w, m_w, H, k_lo,
                                                           k_hi, G, W, ROWS, PREFETCH, HALF2, ASM)
    rw = tl.load(topk_weights + pair).to(tl.float32)
    _y_store(y, a_0, rw, pair, o_w, m_w, stride_ym, i_k, SPLIT, 0)
    _y_store(y, a_1, rw, pair, o_w, m_w, stride_ym, i_k, SPLIT, 1)
    _y_store(y, a_2, rw, pair, o_w, m_w, stride_ym, i_k, SPLIT, 2)
    _y_store(y, a_3, rw, pair, o_w, m_w, stride_ym, i_k, SPLIT, 3)
    _y_store(y, a_4, rw, pair, o_w, m_w, stride_ym, i_k, SPLIT, 4)
    _y_store(y, a_5, rw, pair, o_w, m_w, stride_ym, i_k, SPLIT, 5)
    _y_store(y, a_6, rw, pair, o_w, m_w, stride_ym, i_k, SPLIT, 6)
    _y_store(y, a_7, rw, pair, o_w, m_w, stride_ym, i_k, SPLIT, 7)
    if FIXUP:
        _sum_fixup(y, out, counters, pair // TOP_K, i_n, H, stride_ym, TOP_K * SPLIT, BLOCK_N)


@triton.jit
def _sum_fixup(y, out, counters, token, i_n, H, stride_ym, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The last of the ROWS = TOP_K·SPLIT programs of (token, N tile i_n) writes out[token, tile] = Σ_j y[token·ROWS
    + j, tile] (moe._moe_sum_kernel's order and rounding: bitwise its output)."""
    if splitk_last(counters, token * tl.num_programs(1) + i_n, ROWS):
        o = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m = o < H
        acc = splitk_sum(y + token.to(tl.int64) * ROWS * stride_ym + o, m, stride_ym, ROWS)
        tl.store(out + token.to(tl.int64) * H + o, acc.to(out.dtype.element_ty), mask=m)

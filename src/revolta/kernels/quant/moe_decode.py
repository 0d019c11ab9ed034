"""The group-factored decode path of the packed-expert MoE (kernels/quant/moe.py, config key "NIBBLE_DOT"): the
grouped gate_up and down kernels over nibble.py's group decoders (why and how the decode works: nibble.py).

Split-K (SPLIT_UP / SPLIT_DOWN, third grid axis; for M = 1, where ~11 experts give few N tiles): gate_up programs
of split s write their fp32 gate and up partials to ws [SPLIT_UP, T, 2I] and `_split_act_kernel` forms act =
SiLU(Σ gate)·Σ up in split order (one small launch); down programs write y rows pair·SPLIT_DOWN + s, which
moe._moe_sum_kernel adds in order with the k slots. Fixed order everywhere: no atomics, bitwise reproducible, no
host sync (CUDA-graph safe). act is rounded to x.dtype once, as in the reference.

Restrictions: nibble.py's (tl.dot only, so sm70 keeps the tile path; the K step divides the group).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..moe_grouped import _pairs, _program
from ..pdl import pdl_start
from .nibble import _nibble_rows_matmul


@triton.jit
def _gate_up_operands(w0, w1, w2, sg0, sg1, sg2, su0, su1, su2, i_e, i_n, num_routed, I, stride_e0, stride_e1,
                      stride_e2, BLOCK_N: tl.constexpr, HAS_SHARED: tl.constexpr):
    """(gate bases, first gate row, up bases, first up row, rows N of the linear) of expert i_e's N tile i_n:
    routed: one [2I, H] linear, up rows at I; the shared expert (id num_routed): its own [I, H] gate and up."""
    g0 = w0 + i_e * stride_e0
    g1 = w1 + i_e * stride_e1
    g2 = w2 + i_e * stride_e2
    u0, u1, u2 = g0, g1, g2
    n_g = i_n * BLOCK_N
    n_u = n_g + I
    N = 2 * I
    if HAS_SHARED:
        if i_e == num_routed:
            g0, g1, g2 = sg0, sg1, sg2
            u0, u1, u2 = su0, su1, su2
            n_u = n_g
            N = I
    return g0, g1, g2, n_g, u0, u1, u2, n_u, N


@triton.jit
def _down_operands(w0, w1, w2, sd0, sd1, sd2, i_e, num_routed, stride_e0, stride_e1, stride_e2,
                   HAS_SHARED: tl.constexpr):
    d0 = w0 + i_e * stride_e0
    d1 = w1 + i_e * stride_e1
    d2 = w2 + i_e * stride_e2
    if HAS_SHARED:
        if i_e == num_routed:
            d0, d1, d2 = sd0, sd1, sd2
    return d0, d1, d2


@triton.jit
def _nibble_gate_up_kernel(x, w0, w1, w2, sg0, sg1, sg2, su0, su1, su2, act, ws, topk_ids, order, slot_expert,
                           slot_start, slot_end, num_routed, H, I, T, stride_xm, stride_e0, stride_e1, stride_e2,
                           stride_am, k_split, FMT: tl.constexpr, G: tl.constexpr, HAS_ZP: tl.constexpr,
                           INVERTED: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, HAS_SHARED: tl.constexpr, SORTED: tl.constexpr,
                           SPLIT: tl.constexpr, SCALE_AHEAD: tl.constexpr):
    """act [T, I] = SiLU(gate)·up in x.dtype; SPLIT > 1: K slice program_id(2) of gate and up to ws [SPLIT, T, 2I]."""
    i_n, i_e, start, end = _program(topk_ids, slot_expert, slot_start, slot_end, SORTED)
    if i_e < 0:
        return
    g0, g1, g2, n_g, u0, u1, u2, n_u, N = _gate_up_operands(w0, w1, w2, sg0, sg1, sg2, su0, su1, su2, i_e, i_n,
                                                            num_routed, I, stride_e0, stride_e1, stride_e2, BLOCK_N,
                                                            HAS_SHARED)
    i_k = tl.program_id(2)
    k_lo = i_k * k_split
    k_hi = tl.minimum(k_lo + k_split, H)
    o_n = n_g + tl.arange(0, BLOCK_N)
    m_n = o_n < I
    for m0 in range(start, end, BLOCK_M):
        b_pair, m_p = _pairs(order, m0, end, BLOCK_M, SORTED)
        a_rows = x + (b_pair // TOP_K) * stride_xm
        b_g, b_u = _nibble_rows_matmul(a_rows, m_p, g0, g1, g2, n_g, u0, u1, u2, n_u, N, H, k_lo, k_hi, I, FMT, G,
                                       HAS_ZP, INVERTED, BLOCK_N, BLOCK_M, BLOCK_K, True, SCALE_AHEAD)  # [BM, BN] each
        m_s = m_p[:, None] & m_n[None, :]
        if SPLIT == 1:
            tl.store(act + b_pair[:, None] * stride_am + o_n[None, :], (b_g * tl.sigmoid(b_g) * b_u).to(
                act.dtype.element_ty), mask=m_s)
        else:
            p_w = ws + (i_k * T + b_pair[:, None]) * (2 * I) + o_n[None, :]
            tl.store(p_w, b_g, mask=m_s)
            tl.store(p_w + I, b_u, mask=m_s)


@triton.jit
def _split_act_kernel(ws, act, T, I, stride_am, SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """act[t] = SiLU(Σ_s gate_s)·Σ_s up_s in act's dtype from ws [SPLIT, T, 2I] (fixed split order); grid (T, I
    tiles). PDL: pdl.pdl_start."""
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = o < I
    b_g = tl.zeros([BLOCK], dtype=tl.float32)
    b_u = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        p = ws + (s * T + t) * (2 * I) + o
        b_g += tl.load(p, mask=m, other=0.0)
        b_u += tl.load(p + I, mask=m, other=0.0)
    tl.store(act + t * stride_am + o, (b_g * tl.sigmoid(b_g) * b_u).to(act.dtype.element_ty), mask=m)


@triton.jit
def _nibble_down_kernel(act, w0, w1, w2, sd0, sd1, sd2, topk_weights, y, topk_ids, order, slot_expert, slot_start,
                        slot_end, num_routed, H, I, stride_am, stride_e0, stride_e1, stride_e2, stride_ym, k_split,
                        FMT: tl.constexpr, G: tl.constexpr, HAS_ZP: tl.constexpr, INVERTED: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SHARED: tl.constexpr,
                        SORTED: tl.constexpr, SPLIT: tl.constexpr, SCALE_AHEAD: tl.constexpr):
    """y [T·SPLIT, H] fp32: row pair·SPLIT + s = w_pair · (act[pair, K slice s] @ down_e[:, K slice s]ᵀ)."""
    i_n, i_e, start, end = _program(topk_ids, slot_expert, slot_start, slot_end, SORTED)
    if i_e < 0:
        return
    d0, d1, d2 = _down_operands(w0, w1, w2, sd0, sd1, sd2, i_e, num_routed, stride_e0, stride_e1, stride_e2,
                                HAS_SHARED)
    i_k = tl.program_id(2)
    k_lo = i_k * k_split
    k_hi = tl.minimum(k_lo + k_split, I)
    n = i_n * BLOCK_N
    o_n = n + tl.arange(0, BLOCK_N)
    m_n = o_n < H
    for m0 in range(start, end, BLOCK_M):
        b_pair, m_p = _pairs(order, m0, end, BLOCK_M, SORTED)
        acc, _ = _nibble_rows_matmul(act + b_pair * stride_am, m_p, d0, d1, d2, n, d0, d1, d2, n, H, I, k_lo, k_hi, H,
                                     FMT, G, HAS_ZP, INVERTED, BLOCK_N, BLOCK_M, BLOCK_K, False,
                                     SCALE_AHEAD)  # [BM, BN]
        b_rw = tl.load(topk_weights + b_pair, mask=m_p, other=0.0).to(tl.float32)
        p_y = y + (b_pair[:, None] * SPLIT + i_k) * stride_ym + o_n[None, :]
        tl.store(p_y, acc * b_rw[:, None], mask=m_p[:, None] & m_n[None, :])

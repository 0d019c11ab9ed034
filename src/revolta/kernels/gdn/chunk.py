"""Chunked gated delta rule prefill over a flat varlen batch (spec/model.md §3.5, chunked form;
spec/performance.md §2.2), state pool in/out.

Four launches, chunk size BT = 64 (4 sub-blocks of 16):
1. `_gdn_chunk_kkt_solve_kernel` (chunk, v-head): chunk-local cumsum γ of g, 1/‖k‖, the
   strictly-lower A = β K̂K̂ᵀ ⊙ Γ built as ten 16x16 blocks, and T = (I + A)⁻¹ by forward
   substitution inside each diagonal block plus block substitution for the six blocks below.
2. `_gdn_chunk_wu_kernel` (chunk, v-head): W = T·(β e^γ ⊙ K̂), U = T·(β ⊙ V) (the WY form).
3. `_gdn_chunk_h_kernel` (V block, sequence · v-head): walks the chunks of one sequence in order,
   state [K, BV] fp32 in registers: store h_c, V' = U − W h, h ← e^{γ_C} h + K̂ᵀ(e^{γ_C−γ} ⊙ V').
   Initial state from the pool slot (or zeros), final state written back to it.
4. `_gdn_chunk_o_kernel` (V block, chunk, v-head): O = (Q̂ ⊙ e^γ) h_c + (Q̂K̂ᵀ ⊙ Γ_incl) V'.

q and k stay raw in memory: the L2 norms (and the q scale) are per-row factors applied to dot
results or folded into the other operand, so the tensor-core operands are the input dtype and
nothing is re-materialised. Intermediates W, U, h_c, V' are stored in the input dtype (fp32 for
fp32 inputs), T in fp32, the running state and all accumulations in fp32 (fla's precision
choices). Varlen: programs map to (sequence, chunk) through `cu_chunks` (a device cumsum of
ceil(len/64)); the grid is the host-known bound T // 64 + B, spare programs exit at once, so the
wrapper never synchronises with the device and can be graph-captured.

sm70 note: tl.dot on Volta runs on FMA units (no tensor cores); a V100 variant should move the
intra-chunk products (kernels 1, 2, 4) to torch.bmm and keep only kernel 3 in Triton — see
`gdn_chunk_prefill`'s docstring.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BT = 64  # chunk size
BC = 16  # sub-block of the triangular solve


@triton.jit
def _find_seq(cu_ptr, idx, NUM_SEQ, LOG_NUM_SEQ: tl.constexpr):
    """Largest b in [0, NUM_SEQ) with cu[b] <= idx (binary search)."""
    lo = idx * 0
    hi = lo + NUM_SEQ
    for _ in tl.static_range(LOG_NUM_SEQ):
        mid = (lo + hi) // 2
        go_right = tl.load(cu_ptr + mid) <= idx
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@triton.jit
def _chunk_bounds(cu_seqlens, cu_chunks, i_c, NUM_SEQ, LOG_NUM_SEQ: tl.constexpr):
    """Global chunk index -> (sequence, first token of the chunk, end of the sequence)."""
    i_b = _find_seq(cu_chunks, i_c, NUM_SEQ, LOG_NUM_SEQ)
    t0 = tl.load(cu_seqlens + i_b) + (i_c - tl.load(cu_chunks + i_b)) * 64
    eos = tl.load(cu_seqlens + i_b + 1)
    return i_b, t0, eos


@triton.jit
def _sub_rows(beta, t0, eos, i_s: tl.constexpr, o_g, b_g, i_hv, stride_beta):
    """Rows 16·i_s .. 16·i_s + 15 of the chunk: token index, validity, β, γ (chunk cumsum of g)."""
    o_r = i_s * 16 + tl.arange(0, 16)
    o_t = t0 + o_r
    m_t = o_t < eos
    b_beta = tl.load(beta + o_t.to(tl.int64) * stride_beta + i_hv, mask=m_t, other=0.0).to(tl.float32)
    # γ_r = Σ_{j <= r} g_j inside the chunk, from the chunk's 64 gates already in registers
    b_gc = tl.sum(tl.where(o_g[None, :] <= o_r[:, None], b_g[None, :], 0.0), 1)
    return o_t, m_t, b_beta, b_gc


@triton.jit
def _load_k_rows(k, o_t, m_t, o_k, i_h, stride_k, K: tl.constexpr):
    return tl.load(k + o_t.to(tl.int64)[:, None] * stride_k + i_h * K + o_k[None, :],
                   mask=m_t[:, None] & (o_k < K)[None, :], other=0.0)


@triton.jit
def _sumsq(b_x):
    b_xf = b_x.to(tl.float32)
    return tl.sum(b_xf * b_xf, 1)


@triton.jit
def _a_block(b_a, b_rki, b_rkj, b_betai, b_gci, b_gcj, m_i, m_j, DIAG: tl.constexpr):
    """Block (i, j) of A = β K̂K̂ᵀ ⊙ Γ from the raw K Kᵀ block; strictly lower on the diagonal."""
    mask = m_i[:, None] & m_j[None, :]
    if DIAG:
        o = tl.arange(0, 16)
        mask = mask & (o[:, None] > o[None, :])
    b_decay = tl.exp(tl.where(mask, b_gci[:, None] - b_gcj[None, :], 0.0))
    return tl.where(mask, b_a * (b_betai * b_rki)[:, None] * b_rkj[None, :] * b_decay, 0.0)


@triton.jit
def _inv_unit_lower(b_a):
    """(I + A)⁻¹ of a strictly lower [16, 16] A, by forward substitution row by row."""
    o = tl.arange(0, 16)
    b_t = (o[:, None] == o[None, :]).to(tl.float32)
    for i in range(1, 16):
        b_ai = tl.sum(tl.where(o[:, None] == i, b_a, 0.0), 0)  # row i of A
        b_ti = tl.sum(b_ai[:, None] * b_t, 0)  # Σ_j a_ij T_j (rows j < i are final)
        b_t = tl.where(o[:, None] == i, b_t - b_ti[None, :], b_t)
    return b_t


@triton.jit
def _store_t_block(ainv, b_t, o_t, m_t, i_hv, j: tl.constexpr, HV: tl.constexpr):
    o_col = j * 16 + tl.arange(0, 16)
    tl.store(ainv + (o_t.to(tl.int64)[:, None] * HV + i_hv) * 64 + o_col[None, :], b_t, mask=m_t[:, None])


@triton.jit
def _gdn_chunk_kkt_solve_kernel(k, g, beta, cu_seqlens, cu_chunks, ainv, gcum, k_rstd, NUM_SEQ,
                                stride_k, stride_g, stride_beta,
                                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                                USE_L2NORM: tl.constexpr, DOT_PREC: tl.constexpr, LOG_NUM_SEQ: tl.constexpr):
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    if i_c >= tl.load(cu_chunks + NUM_SEQ):
        return
    i_h = i_hv // (HV // H)
    _, t0, eos = _chunk_bounds(cu_seqlens, cu_chunks, i_c, NUM_SEQ, LOG_NUM_SEQ)
    o_g = tl.arange(0, 64)
    b_g = tl.load(g + (t0 + o_g).to(tl.int64) * stride_g + i_hv, mask=t0 + o_g < eos, other=0.0).to(tl.float32)
    t_0, m0, beta0, gc0 = _sub_rows(beta, t0, eos, 0, o_g, b_g, i_hv, stride_beta)
    t_1, m1, beta1, gc1 = _sub_rows(beta, t0, eos, 1, o_g, b_g, i_hv, stride_beta)
    t_2, m2, beta2, gc2 = _sub_rows(beta, t0, eos, 2, o_g, b_g, i_hv, stride_beta)
    t_3, m3, beta3, gc3 = _sub_rows(beta, t0, eos, 3, o_g, b_g, i_hv, stride_beta)
    # raw K Kᵀ blocks (row block >= column block) and row sums of squares, over K in BK slices
    a00 = tl.zeros([16, 16], dtype=tl.float32)
    a11 = tl.zeros([16, 16], dtype=tl.float32)
    a22 = tl.zeros([16, 16], dtype=tl.float32)
    a33 = tl.zeros([16, 16], dtype=tl.float32)
    a10 = tl.zeros([16, 16], dtype=tl.float32)
    a20 = tl.zeros([16, 16], dtype=tl.float32)
    a21 = tl.zeros([16, 16], dtype=tl.float32)
    a30 = tl.zeros([16, 16], dtype=tl.float32)
    a31 = tl.zeros([16, 16], dtype=tl.float32)
    a32 = tl.zeros([16, 16], dtype=tl.float32)
    ss0 = tl.zeros([16], dtype=tl.float32)
    ss1 = tl.zeros([16], dtype=tl.float32)
    ss2 = tl.zeros([16], dtype=tl.float32)
    ss3 = tl.zeros([16], dtype=tl.float32)
    for i_k in range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        k0 = _load_k_rows(k, t_0, m0, o_k, i_h, stride_k, K)
        k1 = _load_k_rows(k, t_1, m1, o_k, i_h, stride_k, K)
        k2 = _load_k_rows(k, t_2, m2, o_k, i_h, stride_k, K)
        k3 = _load_k_rows(k, t_3, m3, o_k, i_h, stride_k, K)
        a00 += tl.dot(k0, tl.trans(k0), input_precision=DOT_PREC)
        a11 += tl.dot(k1, tl.trans(k1), input_precision=DOT_PREC)
        a22 += tl.dot(k2, tl.trans(k2), input_precision=DOT_PREC)
        a33 += tl.dot(k3, tl.trans(k3), input_precision=DOT_PREC)
        a10 += tl.dot(k1, tl.trans(k0), input_precision=DOT_PREC)
        a20 += tl.dot(k2, tl.trans(k0), input_precision=DOT_PREC)
        a21 += tl.dot(k2, tl.trans(k1), input_precision=DOT_PREC)
        a30 += tl.dot(k3, tl.trans(k0), input_precision=DOT_PREC)
        a31 += tl.dot(k3, tl.trans(k1), input_precision=DOT_PREC)
        a32 += tl.dot(k3, tl.trans(k2), input_precision=DOT_PREC)
        if USE_L2NORM:
            ss0 += _sumsq(k0)
            ss1 += _sumsq(k1)
            ss2 += _sumsq(k2)
            ss3 += _sumsq(k3)
    if USE_L2NORM:
        rk0, rk1, rk2, rk3 = tl.rsqrt(ss0 + 1e-6), tl.rsqrt(ss1 + 1e-6), tl.rsqrt(ss2 + 1e-6), tl.rsqrt(ss3 + 1e-6)
    else:
        rk0, rk1, rk2, rk3 = ss0 + 1.0, ss1 + 1.0, ss2 + 1.0, ss3 + 1.0
    tl.store(gcum + t_0.to(tl.int64) * HV + i_hv, gc0, mask=m0)
    tl.store(gcum + t_1.to(tl.int64) * HV + i_hv, gc1, mask=m1)
    tl.store(gcum + t_2.to(tl.int64) * HV + i_hv, gc2, mask=m2)
    tl.store(gcum + t_3.to(tl.int64) * HV + i_hv, gc3, mask=m3)
    if i_hv % (HV // H) == 0:  # one writer per q/k head
        tl.store(k_rstd + t_0.to(tl.int64) * H + i_h, rk0, mask=m0)
        tl.store(k_rstd + t_1.to(tl.int64) * H + i_h, rk1, mask=m1)
        tl.store(k_rstd + t_2.to(tl.int64) * H + i_h, rk2, mask=m2)
        tl.store(k_rstd + t_3.to(tl.int64) * H + i_h, rk3, mask=m3)

    a00 = _a_block(a00, rk0, rk0, beta0, gc0, gc0, m0, m0, True)
    a11 = _a_block(a11, rk1, rk1, beta1, gc1, gc1, m1, m1, True)
    a22 = _a_block(a22, rk2, rk2, beta2, gc2, gc2, m2, m2, True)
    a33 = _a_block(a33, rk3, rk3, beta3, gc3, gc3, m3, m3, True)
    a10 = _a_block(a10, rk1, rk0, beta1, gc1, gc0, m1, m0, False)
    a20 = _a_block(a20, rk2, rk0, beta2, gc2, gc0, m2, m0, False)
    a21 = _a_block(a21, rk2, rk1, beta2, gc2, gc1, m2, m1, False)
    a30 = _a_block(a30, rk3, rk0, beta3, gc3, gc0, m3, m0, False)
    a31 = _a_block(a31, rk3, rk1, beta3, gc3, gc1, m3, m1, False)
    a32 = _a_block(a32, rk3, rk2, beta3, gc3, gc2, m3, m2, False)

    t00 = _inv_unit_lower(a00)
    t11 = _inv_unit_lower(a11)
    t22 = _inv_unit_lower(a22)
    t33 = _inv_unit_lower(a33)
    # block substitution: T_ij = -T_ii Σ_{j <= m < i} A_im T_mj
    t10 = -tl.dot(t11, tl.dot(a10, t00, input_precision="ieee"), input_precision="ieee")
    t21 = -tl.dot(t22, tl.dot(a21, t11, input_precision="ieee"), input_precision="ieee")
    t32 = -tl.dot(t33, tl.dot(a32, t22, input_precision="ieee"), input_precision="ieee")
    t20 = -tl.dot(t22, tl.dot(a20, t00, input_precision="ieee") + tl.dot(a21, t10, input_precision="ieee"),
                  input_precision="ieee")
    t31 = -tl.dot(t33, tl.dot(a31, t11, input_precision="ieee") + tl.dot(a32, t21, input_precision="ieee"),
                  input_precision="ieee")
    t30 = -tl.dot(t33, tl.dot(a30, t00, input_precision="ieee") + tl.dot(a31, t10, input_precision="ieee")
                  + tl.dot(a32, t20, input_precision="ieee"), input_precision="ieee")

    _store_t_block(ainv, t00, t_0, m0, i_hv, 0, HV)
    _store_t_block(ainv, t10, t_1, m1, i_hv, 0, HV)
    _store_t_block(ainv, t11, t_1, m1, i_hv, 1, HV)
    _store_t_block(ainv, t20, t_2, m2, i_hv, 0, HV)
    _store_t_block(ainv, t21, t_2, m2, i_hv, 1, HV)
    _store_t_block(ainv, t22, t_2, m2, i_hv, 2, HV)
    _store_t_block(ainv, t30, t_3, m3, i_hv, 0, HV)
    _store_t_block(ainv, t31, t_3, m3, i_hv, 1, HV)
    _store_t_block(ainv, t32, t_3, m3, i_hv, 2, HV)
    _store_t_block(ainv, t33, t_3, m3, i_hv, 3, HV)


@triton.jit
def _gdn_chunk_wu_kernel(k, v, beta, ainv, gcum, k_rstd, w, u, cu_seqlens, cu_chunks, NUM_SEQ,
                         stride_k, stride_v, stride_beta,
                         H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr, LOG_NUM_SEQ: tl.constexpr):
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    if i_c >= tl.load(cu_chunks + NUM_SEQ):
        return
    i_h = i_hv // (HV // H)
    _, t0, eos = _chunk_bounds(cu_seqlens, cu_chunks, i_c, NUM_SEQ, LOG_NUM_SEQ)
    o_r = tl.arange(0, 64)
    o_t = (t0 + o_r).to(tl.int64)
    m_t = t0 + o_r < eos
    b_t = tl.load(ainv + (o_t[:, None] * HV + i_hv) * 64 + o_r[None, :],
                  mask=m_t[:, None] & (o_r[None, :] <= o_r[:, None]), other=0.0).to(k.dtype.element_ty)
    b_beta = tl.load(beta + o_t * stride_beta + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_gc = tl.load(gcum + o_t * HV + i_hv, mask=m_t, other=0.0)
    b_rk = tl.load(k_rstd + o_t * H + i_h, mask=m_t, other=0.0)
    for i_v in tl.static_range(0, V, BV):
        o_v = i_v + tl.arange(0, BV)
        m_v = m_t[:, None] & (o_v < V)[None, :]
        b_v = tl.load(v + o_t[:, None] * stride_v + i_hv * V + o_v[None, :], mask=m_v, other=0.0)
        b_u = tl.dot(b_t, (b_v.to(tl.float32) * b_beta[:, None]).to(b_t.dtype), input_precision=DOT_PREC)
        tl.store(u + (o_t[:, None] * HV + i_hv) * V + o_v[None, :], b_u.to(u.dtype.element_ty), mask=m_v)
    b_kscale = b_rk * b_beta * tl.exp(b_gc)
    for i_k in tl.static_range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        m_k = m_t[:, None] & (o_k < K)[None, :]
        b_k = tl.load(k + o_t[:, None] * stride_k + i_h * K + o_k[None, :], mask=m_k, other=0.0)
        b_w = tl.dot(b_t, (b_k.to(tl.float32) * b_kscale[:, None]).to(b_t.dtype), input_precision=DOT_PREC)
        tl.store(w + (o_t[:, None] * HV + i_hv) * K + o_k[None, :], b_w.to(w.dtype.element_ty), mask=m_k)


@triton.jit
def _gdn_chunk_h_kernel(k, w, u, gcum, k_rstd, h, v_new, ssm_state, slots, has_initial_state,
                        cu_seqlens, cu_chunks, stride_k,
                        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_seqlens + i_b)
    eos = tl.load(cu_seqlens + i_b + 1)
    if eos == bos:  # empty sequence: its slot stays as it is
        return
    c0 = tl.load(cu_chunks + i_b)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]  # [BK, BV] inside one head's state
    p_slot = ssm_state + tl.load(slots + i_b).to(tl.int64) * (HV * K * V) + i_hv * K * V
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if tl.load(has_initial_state + i_b).to(tl.int32) != 0:
        b_h = tl.load(p_slot + o_kv, mask=m_kv, other=0.0)
    o_r = tl.arange(0, 64)
    for i_c in range(0, tl.cdiv(eos - bos, 64)):
        t0 = bos + i_c * 64
        o_t = (t0 + o_r).to(tl.int64)
        m_t = t0 + o_r < eos
        tl.store(h + ((c0 + i_c).to(tl.int64) * HV + i_hv) * (K * V) + o_kv, b_h.to(h.dtype.element_ty), mask=m_kv)
        # V' = U - W h
        b_w = tl.load(w + (o_t[:, None] * HV + i_hv) * K + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :],
                      other=0.0)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_u = tl.load(u + (o_t[:, None] * HV + i_hv) * V + o_v[None, :], mask=m_tv, other=0.0)
        b_vn = b_u.to(tl.float32) - tl.dot(b_w, b_h.to(b_w.dtype), input_precision=DOT_PREC)
        tl.store(v_new + (o_t[:, None] * HV + i_hv) * V + o_v[None, :], b_vn.to(v_new.dtype.element_ty), mask=m_tv)
        # h <- e^{γ_C} h + K̂ᵀ (e^{γ_C - γ} ⊙ V'), 1/‖k‖ folded into the V' side
        t_last = tl.minimum(t0 + 64, eos) - 1
        b_glast = tl.load(gcum + t_last.to(tl.int64) * HV + i_hv)
        b_gc = tl.load(gcum + o_t * HV + i_hv, mask=m_t, other=0.0)
        b_rk = tl.load(k_rstd + o_t * H + i_h, mask=m_t, other=0.0)
        b_f = tl.where(m_t, tl.exp(b_glast - b_gc) * b_rk, 0.0)
        b_kt = tl.load(k + o_t[None, :] * stride_k + i_h * K + o_k[:, None], mask=(o_k < K)[:, None] & m_t[None, :],
                       other=0.0)  # [BK, 64]
        b_h = b_h * tl.exp(b_glast) + tl.dot(b_kt, (b_vn * b_f[:, None]).to(b_kt.dtype), input_precision=DOT_PREC)
    tl.store(p_slot + o_kv, b_h, mask=m_kv)


@triton.jit
def _gdn_chunk_o_kernel(q, k, h, v_new, gcum, k_rstd, o, cu_seqlens, cu_chunks, NUM_SEQ, scale,
                        stride_q, stride_k,
                        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, USE_L2NORM: tl.constexpr, DOT_PREC: tl.constexpr,
                        LOG_NUM_SEQ: tl.constexpr):
    i_v, i_c, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if i_c >= tl.load(cu_chunks + NUM_SEQ):
        return
    i_h = i_hv // (HV // H)
    _, t0, eos = _chunk_bounds(cu_seqlens, cu_chunks, i_c, NUM_SEQ, LOG_NUM_SEQ)
    o_r = tl.arange(0, 64)
    o_t = (t0 + o_r).to(tl.int64)
    m_t = t0 + o_r < eos
    o_v = i_v * BV + tl.arange(0, BV)
    m_tv = m_t[:, None] & (o_v < V)[None, :]
    b_qh = tl.zeros([64, BV], dtype=tl.float32)
    b_qk = tl.zeros([64, 64], dtype=tl.float32)
    b_qq = tl.zeros([64], dtype=tl.float32)
    for i_k in tl.static_range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        m_k = (o_k < K)[None, :]
        b_q = tl.load(q + o_t[:, None] * stride_q + i_h * K + o_k[None, :], mask=m_t[:, None] & m_k, other=0.0)
        b_k = tl.load(k + o_t[:, None] * stride_k + i_h * K + o_k[None, :], mask=m_t[:, None] & m_k, other=0.0)
        b_h = tl.load(h + (i_c.to(tl.int64) * HV + i_hv) * (K * V) + o_k[:, None] * V + o_v[None, :],
                      mask=(o_k < K)[:, None] & (o_v < V)[None, :], other=0.0)
        b_qh += tl.dot(b_q, b_h, input_precision=DOT_PREC)
        b_qk += tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)
        if USE_L2NORM:
            b_qf = b_q.to(tl.float32)
            b_qq += tl.sum(b_qf * b_qf, 1)
    if USE_L2NORM:
        b_rq = tl.rsqrt(b_qq + 1e-6) * scale
    else:
        b_rq = tl.full([64], 1.0, tl.float32) * scale
    b_gc = tl.load(gcum + o_t * HV + i_hv, mask=m_t, other=0.0)
    b_rk = tl.load(k_rstd + o_t * H + i_h, mask=m_t, other=0.0)
    mask = (o_r[:, None] >= o_r[None, :]) & m_t[:, None]
    b_a = tl.where(mask, b_qk * b_rq[:, None] * b_rk[None, :] * tl.exp(tl.where(mask, b_gc[:, None] - b_gc[None, :], 0.0)),
                   0.0)
    b_vn = tl.load(v_new + (o_t[:, None] * HV + i_hv) * V + o_v[None, :], mask=m_tv, other=0.0)
    b_o = b_qh * (b_rq * tl.exp(b_gc))[:, None] + tl.dot(b_a.to(b_vn.dtype), b_vn, input_precision=DOT_PREC)
    tl.store(o + (o_t[:, None] * HV + i_hv) * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)


def chunk_config(K: int, V: int, arch: int = 90) -> dict:
    """Block sizes and warps of the four kernels for sm_<arch> (sm_70 and sm_90 builds are
    checked in tests/kernels/test_gdn_aot.py). On sm70 tl.dot is FMA-only and keeps whole
    operand rows per thread, so the tiles shrink and the warps double to bound register spills.
    """
    if arch < 80:
        return dict(kkt_bk=min(32, K), wu_bk=min(32, K), wu_bv=min(32, V), h_bv=min(16, V), o_bk=min(16, K),
                    o_bv=min(32, V), kkt_warps=4, wu_warps=4, h_warps=8, o_warps=8)
    return dict(kkt_bk=min(32, K), wu_bk=min(64, K), wu_bv=min(64, V), h_bv=min(32, V), o_bk=min(64, K),
                o_bv=min(64, V), kkt_warps=4, wu_warps=8, h_warps=4, o_warps=4)


def _device_arch(device: torch.device) -> int:
    if device.type != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def _check_prefill_inputs(q, k, v, g, beta, cu_seqlens, ssm_state, slots, has_initial_state):
    assert q.dim() == 3 and k.shape == q.shape, f"q, k must be [T, H, K], got {tuple(q.shape)} and {tuple(k.shape)}"
    T, H, K = q.shape
    assert v.dim() == 3 and v.shape[0] == T, f"v must be [T={T}, HV, V], got {tuple(v.shape)}"
    HV, V = v.shape[1:]
    assert HV % H == 0, f"value heads ({HV}) must be a multiple of q/k heads ({H})"
    assert g.shape == (T, HV) and beta.shape == (T, HV), \
        f"g, beta must be [T={T}, HV={HV}], got {tuple(g.shape)} and {tuple(beta.shape)}"
    assert g.dtype == torch.float32 and beta.dtype == torch.float32, f"g, beta must be fp32, got {g.dtype}, {beta.dtype}"
    assert q.dtype == k.dtype == v.dtype and v.dtype in (torch.float16, torch.bfloat16, torch.float32), \
        f"q, k, v must share one of fp16/bf16/fp32, got {q.dtype}, {k.dtype}, {v.dtype}"
    for name, x, inner in (("q", q, K), ("k", k, K), ("v", v, V)):
        assert x.stride(-1) == 1 and x.stride(-2) == inner, \
            f"{name} must have contiguous heads (strides [*, {inner}, 1]), got {x.stride()}"
    assert g.stride(-1) == 1 and beta.stride(-1) == 1, "g, beta must be contiguous over heads"
    assert K in (16, 32, 64, 128, 256) and V % 16 == 0, f"K must be a power of two in [16, 256] and V a multiple of 16, got {K}, {V}"
    assert ssm_state.dtype == torch.float32 and ssm_state.dim() == 4 and ssm_state.shape[1:] == (HV, K, V) \
        and ssm_state.is_contiguous(), \
        f"ssm_state must be contiguous fp32 [num_slots, {HV}, {K}, {V}], got {ssm_state.dtype} {tuple(ssm_state.shape)}"
    assert slots.dtype == torch.int32 and slots.dim() == 1, f"slots must be int32 [B], got {slots.dtype} {tuple(slots.shape)}"
    B = slots.shape[0]
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.shape == (B + 1,), \
        f"cu_seqlens must be int32 [B+1={B + 1}], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
    assert has_initial_state.dtype == torch.bool and has_initial_state.shape == (B,), \
        f"has_initial_state must be bool [B={B}], got {has_initial_state.dtype} {tuple(has_initial_state.shape)}"
    devs = {x.device for x in (q, k, v, g, beta, cu_seqlens, ssm_state, slots, has_initial_state)}
    assert len(devs) == 1, f"all tensors must be on one device, got {devs}"
    return T, B, H, HV, K, V


def gdn_chunk_prefill(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                      ssm_state: Tensor, slots: Tensor, has_initial_state: Tensor, scale: float | None = None,
                      use_qk_l2norm: bool = True) -> Tensor:
    """Chunked (C = 64) gated delta rule over a flat varlen batch, states from/to a slot pool.

    q, k: [T, H, K] raw (normalised in the kernels when use_qk_l2norm; views with contiguous heads
    are fine); v: [T, HV, V]; g (log decay), beta: [T, HV] fp32; cu_seqlens: int32 [B+1];
    ssm_state: [num_slots, HV, K, V] fp32; slots: int32 [B]; has_initial_state: bool [B] (False:
    start from zeros). Each sequence's final state is written to its slot (length 0: untouched).
    Returns o [T, HV, V] in v.dtype. scale defaults to K^-1/2.

    V100: every tl.dot here runs on FMA units on sm70 (Triton has no Volta MMA); the follow-up is
    a variant doing the intra-chunk products (K Kᵀ, T·[K|V], Q Kᵀ, Q h, A V') as torch.bmm on
    cuBLAS tensor cores with only the sequential state walk in Triton.
    """
    T, B, H, HV, K, V = _check_prefill_inputs(q, k, v, g, beta, cu_seqlens, ssm_state, slots, has_initial_state)
    o = torch.empty(T, HV, V, dtype=v.dtype, device=v.device)
    if T == 0 or B == 0:
        return o
    dev, dt = v.device, v.dtype
    cfg = chunk_config(K, V, _device_arch(dev))
    dev, dt = v.device, v.dtype
    scale = float(K**-0.5 if scale is None else scale)
    num_chunks_max = T // BT + B  # >= Σ ceil(len_b / 64), known without reading the lengths
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    cu_chunks = torch.zeros(B + 1, dtype=torch.int32, device=dev)
    torch.cumsum(torch.div(lens + (BT - 1), BT, rounding_mode="floor"), 0, out=cu_chunks[1:])
    log_b = max(1, (B - 1).bit_length())
    prec = "ieee"  # fp32 inputs: exact fp32 products (no TF32); fp16/bf16 inputs ignore it

    ainv = torch.empty(T, HV, BT, dtype=torch.float32, device=dev)
    gcum = torch.empty(T, HV, dtype=torch.float32, device=dev)
    k_rstd = torch.empty(T, H, dtype=torch.float32, device=dev)
    _gdn_chunk_kkt_solve_kernel[(num_chunks_max, HV)](
        k, g, beta, cu_seqlens, cu_chunks, ainv, gcum, k_rstd, B, k.stride(0), g.stride(0), beta.stride(0),
        H=H, HV=HV, K=K, BK=cfg["kkt_bk"], USE_L2NORM=use_qk_l2norm, DOT_PREC=prec, LOG_NUM_SEQ=log_b,
        num_warps=cfg["kkt_warps"])
    w = torch.empty(T, HV, K, dtype=dt, device=dev)
    u = torch.empty(T, HV, V, dtype=dt, device=dev)
    _gdn_chunk_wu_kernel[(num_chunks_max, HV)](
        k, v, beta, ainv, gcum, k_rstd, w, u, cu_seqlens, cu_chunks, B, k.stride(0), v.stride(0), beta.stride(0),
        H=H, HV=HV, K=K, V=V, BK=cfg["wu_bk"], BV=cfg["wu_bv"], DOT_PREC=prec, LOG_NUM_SEQ=log_b,
        num_warps=cfg["wu_warps"])
    h = torch.empty(num_chunks_max, HV, K, V, dtype=dt, device=dev)
    v_new = torch.empty(T, HV, V, dtype=dt, device=dev)
    _gdn_chunk_h_kernel[(triton.cdiv(V, cfg["h_bv"]), B * HV)](
        k, w, u, gcum, k_rstd, h, v_new, ssm_state, slots, has_initial_state, cu_seqlens, cu_chunks, k.stride(0),
        H=H, HV=HV, K=K, V=V, BK=K, BV=cfg["h_bv"], DOT_PREC=prec, num_warps=cfg["h_warps"])
    _gdn_chunk_o_kernel[(triton.cdiv(V, cfg["o_bv"]), num_chunks_max, HV)](
        q, k, h, v_new, gcum, k_rstd, o, cu_seqlens, cu_chunks, B, scale, q.stride(0), k.stride(0),
        H=H, HV=HV, K=K, V=V, BK=cfg["o_bk"], BV=cfg["o_bv"], USE_L2NORM=use_qk_l2norm, DOT_PREC=prec,
        LOG_NUM_SEQ=log_b, num_warps=cfg["o_warps"])
    return o

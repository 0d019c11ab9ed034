"""Chunked prefill, stage 3 (fully parallel): outputs from the chunk start states.

One program per (BV columns of V, chunk, value head):
  O = (Q̂ ⊙ e^γ) h_c + (Q̂K̂ᵀ ⊙ Γ_incl) V'_c
with Q̂ = q / ‖q‖ · scale and K̂ = k / ‖k‖ applied as row factors on the fp32 products (q and k
stay raw in memory), h_c and V'_c from the state walk (chunk_state.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_index import _chunk_rows


@triton.jit(do_not_specialize=["NUM_SEQ"])  # one build for any batch
def _gdn_chunk_o_kernel(q, k, h, v_new, gcum, k_rstd, o, cu_seqlens, cu_chunks, NUM_SEQ, scale,
                        stride_q, stride_k,
                        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, VP: tl.constexpr, USE_L2NORM: tl.constexpr,
                        DOT_PREC: tl.constexpr, LOG_NUM_SEQ: tl.constexpr, H_T: tl.constexpr = False):
    """Program (i_p, chunk, v-head) writes columns i_p * VP .. + VP in BV tiles; Q Kᵀ once per program.
    h: [chunks, HV, K, V], or [chunks, HV, V, K] with H_T (the transposed walk's)."""
    i_p, i_c, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if i_c >= tl.load(cu_chunks + NUM_SEQ):
        return
    i_h = i_hv // (HV // H)
    o_t, m_t = _chunk_rows(cu_seqlens, cu_chunks, i_c, NUM_SEQ, LOG_NUM_SEQ)
    o_r = tl.arange(0, 64)
    b_qk = tl.zeros([64, 64], dtype=tl.float32)
    b_qq = tl.zeros([64], dtype=tl.float32)
    for i_k in tl.static_range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        b_q = tl.load(q + o_t[:, None] * stride_q + i_h * K + o_k[None, :], mask=m_t[:, None], other=0.0)
        b_k = tl.load(k + o_t[:, None] * stride_k + i_h * K + o_k[None, :], mask=m_t[:, None], other=0.0)
        b_qk = tl.dot(b_q, tl.trans(b_k), b_qk, input_precision=DOT_PREC)
        if USE_L2NORM:
            b_qf = b_q.to(tl.float32)
            b_qq += tl.sum(b_qf * b_qf, 1)
    if USE_L2NORM:
        b_rq = tl.rsqrt(b_qq + 1e-6) * scale
    else:
        b_rq = b_qq + scale
    b_gc = tl.load(gcum + o_t * HV + i_hv, mask=m_t, other=0.0)
    b_rk = tl.load(k_rstd + o_t * H + i_h, mask=m_t, other=0.0)
    causal = (o_r[:, None] >= o_r[None, :]) & m_t[:, None]
    b_decay = tl.exp(tl.where(causal, b_gc[:, None] - b_gc[None, :], 0.0))
    b_a = tl.where(causal, b_qk * b_rq[:, None] * b_rk[None, :] * b_decay, 0.0).to(v_new.dtype.element_ty)
    b_qscale = b_rq * tl.exp(b_gc)
    p_h = h + (i_c.to(tl.int64) * HV + i_hv) * (K * V)
    for i_v in tl.static_range(0, VP, BV):
        o_v = i_p * VP + i_v + tl.arange(0, BV)
        b_qh = tl.zeros([64, BV], dtype=tl.float32)
        for i_k in tl.static_range(0, K, BK):
            o_k = i_k + tl.arange(0, BK)
            b_q = tl.load(q + o_t[:, None] * stride_q + i_h * K + o_k[None, :], mask=m_t[:, None], other=0.0)
            o_h = o_v[None, :] * K + o_k[:, None] if H_T else o_k[:, None] * V + o_v[None, :]  # [BK, BV]
            b_qh = tl.dot(b_q, tl.load(p_h + o_h), b_qh, input_precision=DOT_PREC)
        b_vn = tl.load(v_new + (o_t[:, None] * HV + i_hv) * V + o_v[None, :], mask=m_t[:, None], other=0.0)
        b_o = tl.dot(b_a, b_vn, b_qh * b_qscale[:, None], input_precision=DOT_PREC)
        tl.store(o + (o_t[:, None] * HV + i_hv) * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_t[:, None])

"""Chunked prefill, stage 1 (fully parallel): the WY form of every (chunk, value head).

One program per (chunk of 64 tokens, value head), in one pass over k, v, g, beta:
  γ = chunk-local cumsum of g; 1/‖k‖ per row (L2 norm folded into products, k stays raw);
  A = β K̂K̂ᵀ ⊙ Γ (strictly lower, Γ_ij = e^{γ_i − γ_j}); T = (I + A)⁻¹;
  U = T·(β ⊙ V) and W = T·(β e^γ ⊙ K̂), stored in the input dtype for the state walk.
T never leaves the program (fla writes it out and reads it back in a second kernel).

GROUP_HEADS (`ChunkConfig.intra_group_heads`): one program per (chunk, q/k head) instead, looping over the
HV / H value heads that share the k head. Raw K Kᵀ and 1/‖k‖ depend on the k head only, so they are computed
(and k_rstd stored) once per program rather than once per value head; γ, β, T, U and W stay per value head.
Every value is the same expression on the same operands in the same order as in a per-value-head program, so
w, u, gcum and k_rstd are bitwise those of the launch without it at the same warps and tiles. Opt-in: timed on an
H100 (RESULTS.md K1, bf16) it is slower, intra 418 against 360 µs at 1 x 8K and 1,630 against 1,423 at 1 x 32K:
244 registers a thread against 143 (two programs an SM instead of three) cost more than the shared K Kᵀ saves.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_index import _chunk_rows


@triton.jit
def _load_rows(x, o_t, m_t, col0, stride, BC: tl.constexpr):
    """[64, BC] slice (columns col0 .. col0 + BC) of the rows o_t of a token-major tensor."""
    o_c = col0 + tl.arange(0, BC)
    return tl.load(x + o_t[:, None] * stride + o_c[None, :], mask=m_t[:, None], other=0.0)


@triton.jit
def _solve_unit_lower(b_a, SOLVE_PREC: tl.constexpr):
    """T = (I + A)⁻¹ of a strictly lower [64, 64] fp32 A, exactly.

    The four diagonal 16x16 blocks D are inverted together by forward substitution. With
    L = A − D and N = (I + D)⁻¹ L, which is strictly block-lower over four block rows and so
    nilpotent (N⁴ = 0): T = (I + N)⁻¹ (I + D)⁻¹ = (I − N)(I + N²)(I + D)⁻¹, four 64x64 products.
    """
    o4 = tl.arange(0, 4)
    o16 = tl.arange(0, 16)
    same4 = o4[:, None, None, None] == o4[None, None, :, None]  # [4, 1, 4, 1] diagonal block pairs
    b_d = tl.sum(tl.where(same4, tl.reshape(b_a, (4, 16, 4, 16)), 0.0), 2)  # [4, 16, 16]
    b_td = tl.zeros([4, 16, 16], dtype=tl.float32) + (o16[:, None] == o16[None, :]).to(tl.float32)[None, :, :]
    for i in range(1, 16):
        row_i = (o16 == i)[None, :, None]
        b_ai = tl.sum(tl.where(row_i, b_d, 0.0), 1)  # [4, 16] row i of each block
        b_ci = tl.sum(b_ai[:, :, None] * b_td, 1)  # Σ_j a_ij T_j over the rows j < i, already final
        b_td = tl.where(row_i, b_td - b_ci[:, None, :], b_td)
    b_td = tl.reshape(tl.where(same4, b_td[:, :, None, :], 0.0), (64, 64))  # (I + D)⁻¹, block diagonal
    o = tl.arange(0, 64)
    b_l = tl.where((o[:, None] // 16) > (o[None, :] // 16), b_a, 0.0)
    b_n = tl.dot(b_td, b_l, input_precision=SOLVE_PREC)
    b_x = (o[:, None] == o[None, :]).to(tl.float32) + tl.dot(b_n, b_n, input_precision=SOLVE_PREC)
    b_y = b_x - tl.dot(b_n, b_x, input_precision=SOLVE_PREC)
    return tl.dot(b_y, b_td, input_precision=SOLVE_PREC)


@triton.jit
def _gates(g, beta, o_t, m_t, i_hv, stride_g, stride_beta):
    """γ (the chunk-local cumsum of g) and β of value head i_hv, [64] each."""
    b_gc = tl.cumsum(tl.load(g + o_t * stride_g + i_hv, mask=m_t, other=0.0), 0)
    return b_gc, tl.load(beta + o_t * stride_beta + i_hv, mask=m_t, other=0.0)


@triton.jit
def _wy_value_head(k, v, w, u, o_t, m_t, b_kk, b_rk, b_gc, b_beta, i_h, i_hv, stride_k, stride_v, HV: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr,
                   SOLVE_PREC: tl.constexpr):
    """T and the WY form U, W of value head i_hv on one chunk, from its k head's raw K Kᵀ [64, 64] and
    1/‖k‖ [64]."""
    o_r = tl.arange(0, 64)
    strict = (o_r[:, None] > o_r[None, :]) & m_t[:, None] & m_t[None, :]
    b_decay = tl.exp(tl.where(strict, b_gc[:, None] - b_gc[None, :], 0.0))  # Γ [64, 64]
    b_a = tl.where(strict, b_kk * (b_beta * b_rk)[:, None] * b_rk[None, :] * b_decay, 0.0)
    b_t = _solve_unit_lower(b_a, SOLVE_PREC).to(w.dtype.element_ty)

    for i_v in tl.static_range(0, V, BV):
        b_v = _load_rows(v, o_t, m_t, i_hv * V + i_v, stride_v, BV)
        b_u = tl.dot(b_t, (b_v.to(tl.float32) * b_beta[:, None]).to(b_t.dtype), input_precision=DOT_PREC)
        o_v = i_v + tl.arange(0, BV)
        tl.store(u + (o_t[:, None] * HV + i_hv) * V + o_v[None, :], b_u.to(u.dtype.element_ty), mask=m_t[:, None])
    b_kscale = b_rk * b_beta * tl.exp(b_gc)
    for i_k in tl.static_range(0, K, BK):
        b_k = _load_rows(k, o_t, m_t, i_h * K + i_k, stride_k, BK)
        b_w = tl.dot(b_t, (b_k.to(tl.float32) * b_kscale[:, None]).to(b_t.dtype), input_precision=DOT_PREC)
        o_k = i_k + tl.arange(0, BK)
        tl.store(w + (o_t[:, None] * HV + i_hv) * K + o_k[None, :], b_w.to(w.dtype.element_ty), mask=m_t[:, None])


@triton.jit(do_not_specialize=["NUM_SEQ"])  # one build for any batch
def _gdn_chunk_intra_kernel(k, v, g, beta, cu_seqlens, cu_chunks, w, u, gcum, k_rstd, NUM_SEQ,
                            stride_k, stride_v, stride_g, stride_beta,
                            H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                            BK: tl.constexpr, BV: tl.constexpr, USE_L2NORM: tl.constexpr,
                            DOT_PREC: tl.constexpr, SOLVE_PREC: tl.constexpr, LOG_NUM_SEQ: tl.constexpr,
                            GROUP_HEADS: tl.constexpr = False):
    """Grid (chunk, value head), or (chunk, k head) with GROUP_HEADS: then one program does the HV / H value heads
    of its k head, on one K Kᵀ and 1/‖k‖."""
    i_c, i_p = tl.program_id(0), tl.program_id(1)
    if i_c >= tl.load(cu_chunks + NUM_SEQ):
        return
    if GROUP_HEADS:
        i_h = i_p
    else:
        i_h = i_p // (HV // H)
    o_t, m_t = _chunk_rows(cu_seqlens, cu_chunks, i_c, NUM_SEQ, LOG_NUM_SEQ)
    if not GROUP_HEADS:  # issued before K Kᵀ, as before grouping existed: the default's build is unchanged
        b_gc, b_beta = _gates(g, beta, o_t, m_t, i_p, stride_g, stride_beta)
    # raw K Kᵀ [64, 64] and the rows' sums of squares [64], over K in BK slices
    b_kk = tl.zeros([64, 64], dtype=tl.float32)
    b_ss = tl.zeros([64], dtype=tl.float32)
    for i_k in tl.static_range(0, K, BK):
        b_k = _load_rows(k, o_t, m_t, i_h * K + i_k, stride_k, BK)
        b_kk += tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PREC)
        if USE_L2NORM:
            b_kf = b_k.to(tl.float32)
            b_ss += tl.sum(b_kf * b_kf, 1)
    if USE_L2NORM:
        b_rk = tl.rsqrt(b_ss + 1e-6)
    else:
        b_rk = b_ss + 1.0
    if GROUP_HEADS:
        tl.store(k_rstd + o_t * H + i_h, b_rk, mask=m_t)  # the program owns its k head
        # the value heads of k head i_h, not hoisted: the ~160 shared-memory addresses of the body's layout conversions
        # would stay live across the loop (4 B spilled at 8 warps); unrolled, the copies share them alike (116 B at 4)
        for j in tl.range(HV // H, disable_licm=True):
            i_hv = i_h * (HV // H) + j
            b_gc, b_beta = _gates(g, beta, o_t, m_t, i_hv, stride_g, stride_beta)
            tl.store(gcum + o_t * HV + i_hv, b_gc, mask=m_t)
            _wy_value_head(k, v, w, u, o_t, m_t, b_kk, b_rk, b_gc, b_beta, i_h, i_hv, stride_k, stride_v, HV, K, V,
                           BK, BV, DOT_PREC, SOLVE_PREC)
    else:
        tl.store(gcum + o_t * HV + i_p, b_gc, mask=m_t)
        if i_p % (HV // H) == 0:  # one writer per q/k head
            tl.store(k_rstd + o_t * H + i_h, b_rk, mask=m_t)
        _wy_value_head(k, v, w, u, o_t, m_t, b_kk, b_rk, b_gc, b_beta, i_h, i_p, stride_k, stride_v, HV, K, V, BK, BV,
                       DOT_PREC, SOLVE_PREC)

"""Chunked prefill, stage 2: the inter-chunk state walk, optionally split along the sequence.

Per chunk c of one value head (state h [K, V] fp32, WY form W, U from chunk_intra.py):
  V'_c = U_c − W_c h_c,   h_{c+1} = e^{γ_C} h_c + K̂_cᵀ (e^{γ_C − γ} ⊙ V'_c)
which is affine in h: h_{c+1} = M_c h_c + B_c with M_c = e^{γ_C} I − K̂ᵀ F W_c.

The walk is serial over chunks; each program owns one (segment, value head, BV columns of V)
and keeps its [K, BV] slice of h in registers. Without context parallelism a segment is a whole
sequence, so one long sequence runs only HV * V / BV programs for T / 64 steps. With it
(SEG_CHUNKS chunks per segment) three launches replace the one walk:
1. `_gdn_chunk_prescan_kernel` (segment, head, column tile) summarises every segment but each
   sequence's last as the affine map h_out = P h_in + Q: the same walk run on the augmented
   state [Q | P] of width V + K, Q from zero with U, P from the identity without U;
2. `_gdn_chunk_merge_kernel` (sequence, head, V tile) chains the summaries from the sequence's
   initial state: the start state of every later segment (S − 1 [K, K] x [K, BV] products);
3. `_gdn_chunk_walk_kernel` walks all segments at once from their start states, storing h_c
   (input dtype, for the output stage) and V'_c, and the final state of each sequence.
The walk's products use the input dtype (fla's precision, as in one serial walk); the merge
runs in fp32 (3xTF32 on tensor cores), so splitting adds no error beyond fp32 rounding.

TRANSPOSED (a launch-configuration variant, off by default): the walk holds hᵀ [BV, K] and computes
  V'ᵀ = Uᵀ − hᵀ Wᵀ,   hᵀ ← e^{γ_C} hᵀ + (F V')ᵀ K̂
so the operand that changes every chunk (the state, then F V') is the left one of both products. On
sm_90 a wgmma takes its left operand from registers and its right one from shared memory only, and in
the [K, BV] form the state and F V' are right operands: each chunk stores both to shared memory
(and waits for the stores) inside the serial chain; here only W and K̂, loaded ahead, go through
shared memory. h_c is stored transposed ([V, K] per chunk and head, which the output stage reads
with H_T); slot states and the merge's start states keep their [K, V] layout (read and written
transposed once per segment).

PREFETCH (`walk_prefetch`: off by default, the sm_90 default before STAGE_U; not with K_HALVES): the chunk's decay
factors (γ_C and F, three small loads) are loaded a chunk ahead with U, instead of between the chunk's two products
where their latency sits inside the serial chain (the loads that feed a product are pipelined by Triton; these are
not): 8-9% off the walk on an H100 (RESULTS.md K1). Bitwise the same outputs.

STAGE_U (`walk_stage_u`: on in the sm_90 default, at 64 columns and 3 stages; off on sm_70): U and the decay factors
are loaded inside their own chunk instead of a chunk ahead into registers, so Triton's pipeliner stages them in shared
memory with W and K̂ (cp.async, num_stages - 1 chunks ahead), as fla's walk stages every per-chunk input; a static
sm_90 comparison with fla's walk found the register-prefetched U (read from HBM once, larger than L2) and its
per-chunk layout conversion the main difference in the loop, and on an H100 it takes the walk 305 -> 261 µs at
1 x 8K (RESULTS.md K1). Bitwise the same outputs; the walk without it builds as it did before it existed.

K_HALVES (a launch-configuration variant, off by default): the walk and the prescan hold the
state as two [K/2, BV] register tiles, rows 0 .. K/2 − 1 and K/2 .. K − 1, as fla's walk holds
its state in 64-row tiles: W h becomes two accumulating K/2-deep products and K̂ᵀ V' two
independent ones, each updating its own tile. Same arithmetic, different tiling of the dots.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_index import _segment_bounds


@triton.jit
def _load_u(u, t0, end, i_hv, o_col, HV: tl.constexpr, V: tl.constexpr):
    """U rows t0 .. t0 + 63 of one value head, columns o_col (zero from row `end` on and past V)."""
    o_r = tl.arange(0, 64)
    o_t = (t0 + o_r).to(tl.int64)
    m = (t0 + o_r < end)[:, None] & (o_col < V)[None, :]
    return tl.load(u + (o_t[:, None] * HV + i_hv) * V + o_col[None, :], mask=m, other=0.0)


@triton.jit
def _chunk_factors(gcum, k_rstd, t0, eos, o_t, m_t, i_h, i_hv, H: tl.constexpr, HV: tl.constexpr):
    """The chunk's log decay at its last token γ_C and the row factors F = e^{γ_C − γ} / ‖k‖ [64] (0 past eos)."""
    b_glast = tl.load(gcum + (tl.minimum(t0 + 64, eos) - 1).to(tl.int64) * HV + i_hv)
    b_gc = tl.load(gcum + o_t * HV + i_hv, mask=m_t, other=0.0)
    b_rk = tl.load(k_rstd + o_t * H + i_h, mask=m_t, other=0.0)
    return b_glast, tl.where(m_t, tl.exp(b_glast - b_gc) * b_rk, 0.0)


@triton.jit
def _next_factors(gcum, k_rstd, t0, eos, i_h, i_hv, H: tl.constexpr, HV: tl.constexpr):
    """`_chunk_factors` of the chunk starting at token t0 (PREFETCH: loaded a chunk ahead, as U is)."""
    o_r = tl.arange(0, 64)
    return _chunk_factors(gcum, k_rstd, t0, eos, (t0 + o_r).to(tl.int64), t0 + o_r < eos, i_h, i_hv, H, HV)


@triton.jit
def _walk_chunk(b_h, b_u, k, w, gcum, k_rstd, t0, eos, i_h, i_hv, stride_k,
                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, DOT_PREC: tl.constexpr,
                pre_glast=0.0, pre_f=0.0, PREFETCH: tl.constexpr = False):
    """One chunk of the walk from state b_h [K, BV] fp32: returns (V' = U − W h [64, BV] fp32, next state).
    PREFETCH: the chunk's factors are pre_glast, pre_f (loaded during the previous chunk), not loaded here."""
    o_r = tl.arange(0, 64)
    o_k = tl.arange(0, K)
    o_t = (t0 + o_r).to(tl.int64)
    m_t = t0 + o_r < eos
    b_w = tl.load(w + (o_t[:, None] * HV + i_hv) * K + o_k[None, :], mask=m_t[:, None], other=0.0)
    b_vn = b_u.to(tl.float32) - tl.dot(b_w, b_h.to(b_w.dtype), input_precision=DOT_PREC)
    if PREFETCH:
        b_glast, b_f = pre_glast, pre_f
    else:
        b_glast, b_f = _chunk_factors(gcum, k_rstd, t0, eos, o_t, m_t, i_h, i_hv, H, HV)
    b_kt = tl.load(k + o_t[None, :] * stride_k + i_h * K + o_k[:, None], mask=m_t[None, :], other=0.0)  # [K, 64]
    b_h = tl.dot(b_kt, (b_vn * b_f[:, None]).to(b_kt.dtype), b_h * tl.exp(b_glast), input_precision=DOT_PREC)
    return b_vn, b_h


@triton.jit
def _walk_chunk_halves(b_h1, b_h2, b_u, k, w, gcum, k_rstd, t0, eos, i_h, i_hv, stride_k,
                       H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, DOT_PREC: tl.constexpr):
    """`_walk_chunk` on the state split by rows, b_h1 = h[:K/2], b_h2 = h[K/2:] ([K/2, BV] fp32 each):
    returns (V' [64, BV] fp32, next b_h1, next b_h2)."""
    o_r = tl.arange(0, 64)
    o_k = tl.arange(0, K // 2)
    o_t = (t0 + o_r).to(tl.int64)
    m_t = t0 + o_r < eos
    p_w = w + (o_t[:, None] * HV + i_hv) * K + o_k[None, :]
    b_w1 = tl.load(p_w, mask=m_t[:, None], other=0.0)
    b_w2 = tl.load(p_w + K // 2, mask=m_t[:, None], other=0.0)
    b_wh = tl.dot(b_w2, b_h2.to(b_w2.dtype), tl.dot(b_w1, b_h1.to(b_w1.dtype), input_precision=DOT_PREC),
                  input_precision=DOT_PREC)
    b_vn = b_u.to(tl.float32) - b_wh
    b_glast, b_f = _chunk_factors(gcum, k_rstd, t0, eos, o_t, m_t, i_h, i_hv, H, HV)
    p_kt = k + o_t[None, :] * stride_k + i_h * K + o_k[:, None]  # [K/2, 64]
    b_kt1 = tl.load(p_kt, mask=m_t[None, :], other=0.0)
    b_kt2 = tl.load(p_kt + K // 2, mask=m_t[None, :], other=0.0)
    b_vf = (b_vn * b_f[:, None]).to(b_kt1.dtype)
    b_decay = tl.exp(b_glast)
    b_h1 = tl.dot(b_kt1, b_vf, b_h1 * b_decay, input_precision=DOT_PREC)
    b_h2 = tl.dot(b_kt2, b_vf, b_h2 * b_decay, input_precision=DOT_PREC)
    return b_vn, b_h1, b_h2


@triton.jit
def _load_ut(u, t0, end, i_hv, o_col, HV: tl.constexpr, V: tl.constexpr):
    """`_load_u` transposed: Uᵀ [BV, 64], columns o_col of U as rows (zero from token `end` on and past V)."""
    o_r = tl.arange(0, 64)
    o_t = (t0 + o_r).to(tl.int64)
    m = (o_col < V)[:, None] & (t0 + o_r < end)[None, :]
    return tl.load(u + (o_t[None, :] * HV + i_hv) * V + o_col[:, None], mask=m, other=0.0)


@triton.jit
def _walk_chunk_t(b_ht, b_ut, k, w, gcum, k_rstd, t0, eos, i_h, i_hv, stride_k,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, DOT_PREC: tl.constexpr,
                  pre_glast=0.0, pre_f=0.0, PREFETCH: tl.constexpr = False):
    """`_walk_chunk` on the transposed state b_ht = hᵀ [BV, K] fp32 (TRANSPOSED): returns (V'ᵀ [BV, 64] fp32, next
    hᵀ). Same arithmetic; both products take the state side as their left operand."""
    o_r = tl.arange(0, 64)
    o_k = tl.arange(0, K)
    o_t = (t0 + o_r).to(tl.int64)
    m_t = t0 + o_r < eos
    b_wt = tl.load(w + (o_t[None, :] * HV + i_hv) * K + o_k[:, None], mask=m_t[None, :], other=0.0)  # Wᵀ [K, 64]
    b_vnt = b_ut.to(tl.float32) - tl.dot(b_ht.to(b_wt.dtype), b_wt, input_precision=DOT_PREC)  # [BV, 64]
    if PREFETCH:
        b_glast, b_f = pre_glast, pre_f
    else:
        b_glast, b_f = _chunk_factors(gcum, k_rstd, t0, eos, o_t, m_t, i_h, i_hv, H, HV)
    b_k = tl.load(k + o_t[:, None] * stride_k + i_h * K + o_k[None, :], mask=m_t[:, None], other=0.0)  # [64, K]
    b_ht = tl.dot((b_vnt * b_f[None, :]).to(b_k.dtype), b_k, b_ht * tl.exp(b_glast), input_precision=DOT_PREC)
    return b_vnt, b_ht


@triton.jit
def _start_state(p_slot, p_start, o_kv, from_slot, use_slot_state, ROWS: tl.constexpr, BV: tl.constexpr):
    """A segment's [ROWS, BV] start-state slice at offsets o_kv: from its sequence's slot (or zeros)
    for a sequence's first segment, else from the merge's h_start (the transposed walk passes
    ROWS = its BV, BV = K and transposed offsets)."""
    b_h = tl.zeros([ROWS, BV], dtype=tl.float32)
    if from_slot:
        if use_slot_state:
            b_h = tl.load(p_slot + o_kv)
    else:
        b_h = tl.load(p_start + o_kv)
    return b_h


@triton.jit
def _walk_segment(k, w, u, gcum, k_rstd, h, v_new, p_slot, p_start, use_slot_state, bos, eos, c_lo, c_hi,
                  n_chunks, c_base, i_h, i_hv, i_v, stride_k, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                  V: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr, TRANSPOSED: tl.constexpr,
                  PREFETCH: tl.constexpr, STAGE_U: tl.constexpr = False):
    """Walk chunks [c_lo, c_hi) of one sequence with the state in one register tile: h [K, BV], or hᵀ [BV, K] with
    TRANSPOSED (h_c then stored as [V, K] per chunk and head). PREFETCH: each chunk's decay factors are loaded
    during the chunk before it, as U is, instead of between its two products. STAGE_U (not TRANSPOSED): U and the
    factors are loaded in their own chunk, not carried over from the one before, so Triton's pipeliner stages them
    with W and K̂ (cp.async, num_stages - 1 chunks ahead) as fla's walk does; the same values."""
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_r = tl.arange(0, 64)
    if TRANSPOSED:
        o_kv = o_v[:, None] + o_k[None, :] * V  # [BV, K]: hᵀ's elements in a [K, V] state (slot, h_start)
        o_h = o_v[:, None] * K + o_k[None, :]  # [BV, K] in the transposed h_c
        b_h = _start_state(p_slot, p_start, o_kv, c_lo == 0, use_slot_state, BV, K)
        b_u = _load_ut(u, bos + c_lo * 64, eos, i_hv, o_v, HV, V)
    else:
        o_kv = o_k[:, None] * V + o_v[None, :]  # [K, BV] inside one head's state
        o_h = o_kv
        b_h = _start_state(p_slot, p_start, o_kv, c_lo == 0, use_slot_state, K, BV)
        if not STAGE_U:
            b_u = _load_u(u, bos + c_lo * 64, eos, i_hv, o_v, HV, V)
    pre_glast, pre_f = 0.0, 0.0  # with PREFETCH, the chunk's factors, loaded during the chunk before
    if PREFETCH and not STAGE_U:
        pre_glast, pre_f = _next_factors(gcum, k_rstd, bos + c_lo * 64, eos, i_h, i_hv, H, HV)
    for i_c in range(c_lo, c_hi):
        t0 = bos + i_c * 64
        tl.store(h + ((c_base + i_c).to(tl.int64) * HV + i_hv) * (K * V) + o_h, b_h.to(h.dtype.element_ty))
        if STAGE_U:  # this chunk's U and factors, loaded in the chunk (staged by the pipeliner, not carried)
            tl.static_assert(not TRANSPOSED, "STAGE_U walks the [K, BV] state")
            cur_glast, cur_f = _next_factors(gcum, k_rstd, t0, eos, i_h, i_hv, H, HV)
            b_vn, b_h = _walk_chunk(b_h, _load_u(u, t0, eos, i_hv, o_v, HV, V), k, w, gcum, k_rstd, t0, eos, i_h,
                                    i_hv, stride_k, H, HV, K, DOT_PREC, cur_glast, cur_f, True)
        else:
            # the next chunk's U (and with PREFETCH its factors) is loaded now, so its latency hides behind this
            # chunk's products
            if PREFETCH:
                next_glast, next_f = _next_factors(gcum, k_rstd, t0 + 64, eos, i_h, i_hv, H, HV)
            if TRANSPOSED:
                b_u_next = _load_ut(u, t0 + 64, tl.minimum(eos, bos + c_hi * 64), i_hv, o_v, HV, V)
                b_vn, b_h = _walk_chunk_t(b_h, b_u, k, w, gcum, k_rstd, t0, eos, i_h, i_hv, stride_k, H, HV, K,
                                          DOT_PREC, pre_glast, pre_f, PREFETCH)
            else:
                b_u_next = _load_u(u, t0 + 64, tl.minimum(eos, bos + c_hi * 64), i_hv, o_v, HV, V)
                b_vn, b_h = _walk_chunk(b_h, b_u, k, w, gcum, k_rstd, t0, eos, i_h, i_hv, stride_k, H, HV, K,
                                        DOT_PREC, pre_glast, pre_f, PREFETCH)
            b_u = b_u_next
            if PREFETCH:
                pre_glast, pre_f = next_glast, next_f
        o_t = (t0 + o_r).to(tl.int64)
        if TRANSPOSED:
            tl.store(v_new + (o_t[None, :] * HV + i_hv) * V + o_v[:, None], b_vn.to(v_new.dtype.element_ty),
                     mask=(t0 + o_r < eos)[None, :])
        else:
            tl.store(v_new + (o_t[:, None] * HV + i_hv) * V + o_v[None, :], b_vn.to(v_new.dtype.element_ty),
                     mask=(t0 + o_r < eos)[:, None])
    if c_hi == n_chunks:  # a sequence's last segment writes its final state back to the slot
        tl.store(p_slot + o_kv, b_h)


@triton.jit
def _walk_segment_halves(k, w, u, gcum, k_rstd, h, v_new, p_slot, p_start, use_slot_state, bos, eos, c_lo, c_hi,
                         n_chunks, c_base, i_h, i_hv, i_v, stride_k, H: tl.constexpr, HV: tl.constexpr,
                         K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr):
    """`_walk_segment` with the state as two [K/2, BV] tiles (K_HALVES)."""
    o_k = tl.arange(0, K // 2)
    o_v = i_v * BV + tl.arange(0, BV)
    o_kv = o_k[:, None] * V + o_v[None, :]  # rows of the first half; the second is K/2 rows further
    half = (K // 2) * V  # elements of the first half of the state
    b_h1 = _start_state(p_slot, p_start, o_kv, c_lo == 0, use_slot_state, K // 2, BV)
    b_h2 = _start_state(p_slot + half, p_start + half, o_kv, c_lo == 0, use_slot_state, K // 2, BV)
    o_r = tl.arange(0, 64)
    b_u = _load_u(u, bos + c_lo * 64, eos, i_hv, o_v, HV, V)
    for i_c in range(c_lo, c_hi):
        t0 = bos + i_c * 64
        p_h = h + ((c_base + i_c).to(tl.int64) * HV + i_hv) * (K * V) + o_kv
        tl.store(p_h, b_h1.to(h.dtype.element_ty))
        tl.store(p_h + half, b_h2.to(h.dtype.element_ty))
        b_u_next = _load_u(u, t0 + 64, tl.minimum(eos, bos + c_hi * 64), i_hv, o_v, HV, V)
        b_vn, b_h1, b_h2 = _walk_chunk_halves(b_h1, b_h2, b_u, k, w, gcum, k_rstd, t0, eos, i_h, i_hv, stride_k,
                                              H, HV, K, DOT_PREC)
        o_t = (t0 + o_r).to(tl.int64)
        tl.store(v_new + (o_t[:, None] * HV + i_hv) * V + o_v[None, :], b_vn.to(v_new.dtype.element_ty),
                 mask=(t0 + o_r < eos)[:, None])
        b_u = b_u_next
    if c_hi == n_chunks:
        tl.store(p_slot + o_kv, b_h1)
        tl.store(p_slot + half + o_kv, b_h2)


@triton.jit(do_not_specialize=["NUM_SEQ", "SEG_CHUNKS"])  # one build for any batch
def _gdn_chunk_walk_kernel(k, w, u, gcum, k_rstd, h, v_new, ssm_state, slots, has_initial_state, h_start,
                           cu_seqlens, cu_chunks, cu_segs, NUM_SEQ, SEG_CHUNKS, stride_k,
                           H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                           DOT_PREC: tl.constexpr, LOG_NUM_SEQ: tl.constexpr, K_HALVES: tl.constexpr,
                           TRANSPOSED: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                           STAGE_U: tl.constexpr = False):
    i_v, i_s, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if i_s >= tl.load(cu_segs + NUM_SEQ):
        return
    i_b, bos, eos, c_lo, c_hi, n_chunks, c_base = _segment_bounds(cu_seqlens, cu_chunks, cu_segs, i_s, NUM_SEQ,
                                                                  SEG_CHUNKS, LOG_NUM_SEQ)
    i_h = i_hv // (HV // H)
    p_slot = ssm_state + tl.load(slots + i_b).to(tl.int64) * (HV * K * V) + i_hv * K * V
    p_start = h_start + (i_s.to(tl.int64) * HV + i_hv) * (K * V)  # read only by later segments (c_lo > 0)
    use_slot_state = tl.load(has_initial_state + i_b).to(tl.int32) != 0
    if K_HALVES:
        _walk_segment_halves(k, w, u, gcum, k_rstd, h, v_new, p_slot, p_start, use_slot_state, bos, eos, c_lo, c_hi,
                             n_chunks, c_base, i_h, i_hv, i_v, stride_k, H, HV, K, V, BV, DOT_PREC)
    else:
        _walk_segment(k, w, u, gcum, k_rstd, h, v_new, p_slot, p_start, use_slot_state, bos, eos, c_lo, c_hi,
                      n_chunks, c_base, i_h, i_hv, i_v, stride_k, H, HV, K, V, BV, DOT_PREC, TRANSPOSED, PREFETCH,
                      STAGE_U)


@triton.jit(do_not_specialize=["NUM_SEQ", "SEG_CHUNKS"])  # one build for any batch
def _gdn_chunk_prescan_kernel(k, w, u, gcum, k_rstd, hm, cu_seqlens, cu_chunks, cu_segs, NUM_SEQ, SEG_CHUNKS,
                              stride_k, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                              BV: tl.constexpr, DOT_PREC: tl.constexpr, LOG_NUM_SEQ: tl.constexpr,
                              K_HALVES: tl.constexpr):
    i_col, i_s, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if i_s >= tl.load(cu_segs + NUM_SEQ):
        return
    i_b, bos, eos, c_lo, c_hi, n_chunks, c_base = _segment_bounds(cu_seqlens, cu_chunks, cu_segs, i_s, NUM_SEQ,
                                                                  SEG_CHUNKS, LOG_NUM_SEQ)
    if c_hi == n_chunks:  # nothing follows a sequence's last segment
        return
    i_h = i_hv // (HV // H)
    o_col = i_col * BV + tl.arange(0, BV)  # columns of [Q | P], [K, V + K]
    p_hm = hm + (i_s.to(tl.int64) * HV + i_hv) * K * (V + K)
    b_u = _load_u(u, bos + c_lo * 64, eos, i_hv, o_col, HV, V)  # zero in the P columns
    if K_HALVES:
        o_k = tl.arange(0, K // 2)
        b_h1 = tl.where(o_k[:, None] + V == o_col[None, :], 1.0, 0.0)  # Q from zero, P from the identity
        b_h2 = tl.where(o_k[:, None] + (V + K // 2) == o_col[None, :], 1.0, 0.0)
        for i_c in range(c_lo, c_hi):
            t0 = bos + i_c * 64
            b_u_next = _load_u(u, t0 + 64, tl.minimum(eos, bos + c_hi * 64), i_hv, o_col, HV, V)
            b_vn, b_h1, b_h2 = _walk_chunk_halves(b_h1, b_h2, b_u, k, w, gcum, k_rstd, t0, eos, i_h, i_hv, stride_k,
                                                  H, HV, K, DOT_PREC)
            b_u = b_u_next
        tl.store(p_hm + o_k[:, None] * (V + K) + o_col[None, :], b_h1)
        tl.store(p_hm + (K // 2 + o_k[:, None]) * (V + K) + o_col[None, :], b_h2)
    else:
        o_k = tl.arange(0, K)
        b_h = tl.where(o_k[:, None] + V == o_col[None, :], 1.0, 0.0)  # Q from zero, P from the identity
        for i_c in range(c_lo, c_hi):
            t0 = bos + i_c * 64
            b_u_next = _load_u(u, t0 + 64, tl.minimum(eos, bos + c_hi * 64), i_hv, o_col, HV, V)
            b_vn, b_h = _walk_chunk(b_h, b_u, k, w, gcum, k_rstd, t0, eos, i_h, i_hv, stride_k, H, HV, K, DOT_PREC)
            b_u = b_u_next
        tl.store(p_hm + o_k[:, None] * (V + K) + o_col[None, :], b_h)


@triton.jit
def _gdn_chunk_merge_kernel(hm, h_start, ssm_state, slots, has_initial_state, cu_segs,
                            HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                            MERGE_PREC: tl.constexpr):
    i_v, i_b, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s0 = tl.load(cu_segs + i_b)
    n_segs = tl.load(cu_segs + i_b + 1) - s0
    if n_segs <= 1:
        return
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_kv = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([K, BV], dtype=tl.float32)
    if tl.load(has_initial_state + i_b).to(tl.int32) != 0:
        b_h = tl.load(ssm_state + tl.load(slots + i_b).to(tl.int64) * (HV * K * V) + i_hv * K * V + o_kv)
    for i in range(0, n_segs - 1):
        p_hm = hm + ((s0 + i).to(tl.int64) * HV + i_hv) * (K * (V + K)) + o_k[:, None] * (V + K)
        b_p = tl.load(p_hm + V + o_k[None, :])  # [K, K]
        b_q = tl.load(p_hm + o_v[None, :])  # [K, BV]
        b_h = tl.dot(b_p, b_h, b_q, input_precision=MERGE_PREC)
        tl.store(h_start + ((s0 + i + 1).to(tl.int64) * HV + i_hv) * (K * V) + o_kv, b_h)

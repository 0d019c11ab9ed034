"""The group-factored nibble decode: per-format group decoders and the K loop that the packed-expert MoE
(moe_decode.py, config key "NIBBLE_DOT") and the dense packed GEMV (gemv_nibble.py) share.

Why: the tile path (`moe._weight_tile`, the formats' `_awq_tile` / `_ct_tile` / `_nvfp4_tile`) turns every weight
into (q - z)·s in fp32 and rounds it for tl.dot: 11-14 SASS instructions per weight in its sm_90 inner loop
(benchmarks/quant_moe_instructions.py), which bounds it at 10-16% of the copy bandwidth (benchmarks/RESULTS.md K5c).
Here the scale leaves the inner loop: for one quantization group (G inputs) of W row n,

    Σ_k x_k (q_k - z) s = s · Σ_k x_k (q_k - z),

so each K step is one group: tl.dot of x [BLOCK_M, G] with the group's unscaled codes (q - z), exact in x.dtype
(integers -15..15), then one fp32 multiply-add per accumulator element applies s to the [BLOCK_M, R] partial.
The codes are made without an integer-to-float conversion: one shift and one AND-OR per 32-bit word put two
nibbles under the exponent bits of C (0x6400 -> fp16 1024 + q; 0x4300 -> bf16 128 + q, both exact; the lop3
trick), and one packed subtract of (C + z) per pair gives q - z (`_unpack8`); with int-to-float conversions
instead (I2F, quarter rate on sm_90, one per weight) the AWQ builds measured 8.0 / 7.2 instructions per weight
against 5.4 / 5.4. The zero is subtracted in the operand
rather than after the dot as s · (Σ x (C + q) - (z + C) Σ x): the per-group Σ x is a cross-thread reduction of
the activation chunk each K step, which cost more (sm_90 down kernel, 64 rows: 15.0 SASS instructions per weight
with Σ x after the dot, 11.6 with the zero in the operand; then 5.4 with 256 rows and the word-local unpack).
fp32 activations (the fp32 models) take q exactly (2^23 + q - 2^23). NVFP4 has the same structure with no zero:
E2M1 values are exact in x.dtype, the E4M3 x global scale is applied per 16-input group after the dot.
Accuracy: no weight is rounded (the reference rounds each (q - z)·s to x.dtype); the activations are used as given.

Restrictions: tl.dot only (BLOCK_M >= 16; on sm70 tl.dot is FMA on 16 padded rows, so sm70 keeps the tile paths);
the K step divides the group (per-channel scales: steps inside the one group); K a multiple of the step (loads
are not masked along K).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import MAGIC, e2m1_to_f32, e4m3_to_f32

LAYOUTS = ("awq", "ct_int4", "nvfp4")  # the FMT constexpr of `_group` is the index here


@triton.jit
def _codes(b, DT: tl.constexpr):
    """int32 codes 0..15 -> C + code in DT (fp16: 1024 + q, bf16: 128 + q, fp32: q), exactly, with no int-to-float
    conversion: the code is OR'ed under the exponent bits of C."""
    if DT == tl.float16:
        v = (b | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    elif DT == tl.bfloat16:
        v = (b | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        v = (b | MAGIC).to(tl.float32, bitcast=True) - 8388608.0
    return v


@triton.jit
def _slot_pair(words, j: tl.constexpr, DT: tl.constexpr):
    """(C + nibble j, C + nibble j + 4) of int32 words (nibble i at bits 4i), as two tensors in DT. 16-bit DT: one
    shift and one AND-OR per word make both (the two codes land under C's exponent in the two halves of one
    32-bit register: the lop3 trick), then the halves are read as DT."""
    if DT == tl.float32:
        lo = _codes((words >> (4 * j)) & 15, DT)
        hi = _codes((words >> (4 * j + 16)) & 15, DT)
    else:
        if DT == tl.float16:
            v = ((words >> (4 * j)) & 0x000F000F) | 0x64006400
        else:
            v = ((words >> (4 * j)) & 0x000F000F) | 0x43004300
        lo = v.to(tl.int16).to(DT, bitcast=True)
        hi = (v >> 16).to(tl.int16).to(DT, bitcast=True)
    return lo, hi


@triton.jit
def _unpack8(words, zl0, zl1, zl2, zl3, zh0, zh1, zh2, zh3, DT: tl.constexpr):
    """int32 words [A, W] -> [A, 8W] in DT: position 8w + 2j + h holds nibble j + 4h of word w (nibble i at bits 4i)
    minus its zero (C + z: zl<j> for h = 0, zh<j> for h = 1; tensors that broadcast against [A, W]).
    Both halves of one 32-bit decode sit side by side and are reduced by the zero together (one packed subtract),
    and interleaving along the last dim keeps each word's 8 values in the thread that loaded it (a broadcast-and-
    reshape spreads them over threads: a shared-memory round trip per value in the sm_90 build). AWQ's pack order
    makes this column 8w + 2j + h in order; compressed-tensors' is input 8w + j + 4h (`_pair_order`)."""
    l0, h0 = _slot_pair(words, 0, DT)
    l1, h1 = _slot_pair(words, 1, DT)
    l2, h2 = _slot_pair(words, 2, DT)
    l3, h3 = _slot_pair(words, 3, DT)
    lo = tl.interleave(tl.interleave(l0 - zl0, l2 - zl2), tl.interleave(l1 - zl1, l3 - zl3))
    hi = tl.interleave(tl.interleave(h0 - zh0, h2 - zh2), tl.interleave(h1 - zh1, h3 - zh3))
    return tl.interleave(lo, hi)


@triton.jit
def _pair_order(BLOCK_K: tl.constexpr):
    """[BLOCK_K] input offsets of `_unpack8`'s positions for words packed along K in nibble order i = 0..7."""
    f = tl.arange(0, BLOCK_K)
    return (f // 8) * 8 + (f % 8) // 2 + (f % 2) * 4


@triton.jit
def _awq_group(qw, qz, n, k, N, K, G: tl.constexpr, R: tl.constexpr, BLOCK_K: tl.constexpr, DT: tl.constexpr):
    """q - z [BLOCK_K, R] in DT: inputs k.. (inside one group), rows n.. of an AutoAWQ linear (qweight [K, N/8],
    qzeros [K/G, N/8]; nibble order awq.AWQ_SHIFTS), Wᵀ as it is stored."""
    NW = N // 8
    o_k = k + tl.arange(0, BLOCK_K)
    o_w = n // 8 + tl.arange(0, R // 8)
    m_w = o_w < NW
    g = k // G
    b_q = tl.load(qw + o_k[:, None].to(tl.int64) * NW + o_w[None, :], mask=m_w[None, :], other=0)  # [BK, R/8]
    b_z = tl.load(qz + g * NW + o_w[None, :], mask=m_w[None, :], other=0)  # [1, R/8]
    zl0, zh0 = _slot_pair(b_z, 0, DT)
    zl1, zh1 = _slot_pair(b_z, 1, DT)
    zl2, zh2 = _slot_pair(b_z, 2, DT)
    zl3, zh3 = _slot_pair(b_z, 3, DT)
    return _unpack8(b_q, zl0, zl1, zl2, zl3, zh0, zh1, zh2, zh3, DT)


@triton.jit
def _awq_scale(sc, n, k, N, G: tl.constexpr, R: tl.constexpr):
    """s [R] fp32 of rows n.. in the group holding input k (scales [K/G, N])."""
    o_n = n + tl.arange(0, R)
    return tl.load(sc + (k // G) * N + o_n, mask=o_n < N, other=0.0).to(tl.float32)


@triton.jit
def _ct_group(wp, zp, n, k, N, K, G: tl.constexpr, R: tl.constexpr, BLOCK_K: tl.constexpr, HAS_ZP: tl.constexpr,
              DT: tl.constexpr):
    """`_awq_group` for compressed-tensors int4 (weight_packed [N, K/8], weight_zero_point [N/8, K/G] or the
    symmetric zero 8)."""
    KW = K // 8
    KG = K // G
    o_n = n + tl.arange(0, R)
    m_n = o_n < N
    o_w = k // 8 + tl.arange(0, BLOCK_K // 8)
    g = k // G
    b_q = tl.load(wp + o_n[:, None].to(tl.int64) * KW + o_w[None, :], mask=m_n[:, None], other=0)  # [R, BK/8]
    if HAS_ZP:
        b_z = tl.load(zp + (o_n // 8).to(tl.int64) * KG + g, mask=m_n, other=0)
        b_z = _codes((b_z >> ((o_n % 8) * 4)) & 15, DT)
    else:
        b_z = _codes(tl.full([R], 8, tl.int32), DT)
    b_z = b_z[:, None]
    return tl.trans(_unpack8(b_q, b_z, b_z, b_z, b_z, b_z, b_z, b_z, b_z, DT))


@triton.jit
def _ct_scale(sc, n, k, N, K, G: tl.constexpr, R: tl.constexpr):
    """s [R] fp32 (weight_scale [N, K/G])."""
    o_n = n + tl.arange(0, R)
    return tl.load(sc + o_n.to(tl.int64) * (K // G) + k // G, mask=o_n < N, other=0.0).to(tl.float32)


@triton.jit
def _nvfp4_group(wt, n, k, N, K, R: tl.constexpr, BLOCK_K: tl.constexpr, DT: tl.constexpr):
    """`_awq_group` for NVFP4 (BLOCK_K = 16): E2M1 values, exact in DT."""
    KB = K // 2
    o_n = n + tl.arange(0, R)
    o_b = k // 2 + tl.arange(0, BLOCK_K // 2)
    b_b = tl.load(wt + o_n[:, None].to(tl.int64) * KB + o_b[None, :], mask=(o_n < N)[:, None], other=0).to(tl.int32)
    b_c = tl.reshape(tl.join(b_b & 15, b_b >> 4), (R, BLOCK_K))  # low nibble first
    return tl.trans(e2m1_to_f32(b_c).to(DT))


@triton.jit
def _nvfp4_scale(sc, gs, n, k, N, K, rows_per_shard, INVERTED: tl.constexpr, R: tl.constexpr):
    """The 16-input group's E4M3 scale x the shard's global scale, [R] fp32."""
    o_n = n + tl.arange(0, R)
    m_n = o_n < N
    b_s = e4m3_to_f32(tl.load(sc + o_n.to(tl.int64) * (K // 16) + k // 16, mask=m_n, other=0))
    b_g = tl.load(gs + o_n // rows_per_shard, mask=m_n, other=1.0).to(tl.float32)
    if INVERTED:
        b_s = b_s / b_g
    else:
        b_s = b_s * b_g
    return b_s


@triton.jit
def _group(w0, w1, w2, n, k, N, K, FMT: tl.constexpr, G: tl.constexpr, HAS_ZP: tl.constexpr, R: tl.constexpr,
           BLOCK_K: tl.constexpr, DT: tl.constexpr):
    """Unscaled Wᵀ [BLOCK_K, R] in DT of one K step (inside one group) of W [N, K]; w0..w2: the format's three
    tensors (awq: qweight, qzeros, scales; ct_int4: weight_packed, weight_scale, zero points; nvfp4: codes, E4M3
    scale bytes, global scales)."""
    if FMT == 0:
        b_w = _awq_group(w0, w1, n, k, N, K, G, R, BLOCK_K, DT)
    elif FMT == 1:
        b_w = _ct_group(w0, w2, n, k, N, K, G, R, BLOCK_K, HAS_ZP, DT)
    else:
        b_w = _nvfp4_group(w0, n, k, N, K, R, BLOCK_K, DT)
    return b_w


@triton.jit
def _scale(w0, w1, w2, n, k, N, K, rows_per_shard, FMT: tl.constexpr, G: tl.constexpr, INVERTED: tl.constexpr,
           R: tl.constexpr):
    """The scale [R] fp32 of rows n.. in the group holding input k."""
    if FMT == 0:
        b_s = _awq_scale(w2, n, k, N, G, R)
    elif FMT == 1:
        b_s = _ct_scale(w1, n, k, N, K, G, R)
    else:
        b_s = _nvfp4_scale(w1, w2, n, k, N, K, rows_per_shard, INVERTED, R)
    return b_s


@triton.jit
def _scales(g0, g1, g2, n_g, u0, u1, u2, n_u, k, N, K, rows_per_shard, FMT: tl.constexpr, G: tl.constexpr,
            INVERTED: tl.constexpr, R: tl.constexpr, TWO: tl.constexpr):
    """(gate scales, up scales) [R] fp32 at input k; without TWO the second is the first (not loaded again)."""
    s_g = _scale(g0, g1, g2, n_g, k, N, K, rows_per_shard, FMT, G, INVERTED, R)
    s_u = s_g
    if TWO:
        s_u = _scale(u0, u1, u2, n_u, k, N, K, rows_per_shard, FMT, G, INVERTED, R)
    return s_g, s_u


@triton.jit
def _group_mac(acc, b_a, b_w, b_s):
    """acc [BM, R] += (A [BM, BK] @ (q - z)ᵀ [BK, R]) · s: one group's dot, scaled after it."""
    if b_a.dtype == tl.float32:
        p = tl.dot(b_a, b_w, input_precision="ieee")
    else:
        p = tl.dot(b_a, b_w)
    return acc + p * b_s[None, :]


@triton.jit
def _nibble_rows_matmul(a_rows, m_a, g0, g1, g2, n_g, u0, u1, u2, n_u, N, K, k_lo, k_hi, rows_per_shard,
                        FMT: tl.constexpr, G: tl.constexpr, HAS_ZP: tl.constexpr, INVERTED: tl.constexpr,
                        R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, TWO: tl.constexpr,
                        SCALE_AHEAD: tl.constexpr):
    """(A · Wg[n_g.., k_lo:k_hi]ᵀ, A · Wu[n_u.., k_lo:k_hi]ᵀ), each [BLOCK_M, R] fp32 (the second only when TWO),
    one quantization group per K step. a_rows [BLOCK_M]: row pointers of A; m_a: row mask.

    SCALE_AHEAD loads each step's scales one step ahead. They are used after the dot, and Triton's pipeliner stages
    only the loads that feed it (the codes), so loaded in their own step the scales cost a memory latency every
    step: in the aligned sm_90 build of the dense GEMV their LDG sat ~40 instructions before its first use, inside
    the step. Ahead, the use is a whole step later, at the same 56 registers (dense GEMV, 64-feature tiles): 1-3%
    faster on an H100 (RESULTS.md K6b), on by default there. The MoE kernels' builds took 25-30% more registers
    with it (128 -> 160 gate_up, 116 -> 154 down at M = 1) and ran 1.13-1.24x slower (K5e): off there."""
    DT = a_rows.dtype.element_ty
    acc = tl.zeros([BLOCK_M, R], dtype=tl.float32)
    acc2 = tl.zeros_like(acc)
    if FMT == 1:
        o_k = _pair_order(BLOCK_K)  # the K order of _ct_group's tile
    else:
        o_k = tl.arange(0, BLOCK_K)
    if SCALE_AHEAD:  # an empty slice (split-K's last) loads in bounds and uses nothing
        s_g, s_u = _scales(g0, g1, g2, n_g, u0, u1, u2, n_u, tl.minimum(k_lo, K - BLOCK_K), N, K, rows_per_shard,
                           FMT, G, INVERTED, R, TWO)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if not SCALE_AHEAD:
            s_g, s_u = _scales(g0, g1, g2, n_g, u0, u1, u2, n_u, k0, N, K, rows_per_shard, FMT, G, INVERTED, R, TWO)
        b_a = tl.load(a_rows[:, None] + (k0 + o_k)[None, :], mask=m_a[:, None], other=0.0)  # [BM, BK]
        b_w = _group(g0, g1, g2, n_g, k0, N, K, FMT, G, HAS_ZP, R, BLOCK_K, DT)
        acc = _group_mac(acc, b_a, b_w, s_g)
        if TWO:
            b_w = _group(u0, u1, u2, n_u, k0, N, K, FMT, G, HAS_ZP, R, BLOCK_K, DT)
            acc2 = _group_mac(acc2, b_a, b_w, s_u)
        if SCALE_AHEAD:  # the next step's (the last step reloads its own: stays in bounds)
            s_g, s_u = _scales(g0, g1, g2, n_g, u0, u1, u2, n_u, tl.minimum(k0 + BLOCK_K, k_hi - BLOCK_K), N, K,
                               rows_per_shard, FMT, G, INVERTED, R, TWO)
    return acc, acc2


def nibble_min_rows(layout: str, arch: int | None) -> int:
    """The fewest activation rows (BLOCK_M) a compiled nibble tile may have: 64 for NVFP4 on sm80+, else 16.
    Compiled for sm_90 (Triton 3.6, H100) the NVFP4 decode summed wrong in 16- and 32-row tiles (relative error 1-3
    against the reference, any stages / split / BLOCK_N / warps) and right in 64-row ones
    (tests/gpu/test_quant_gemv_gpu.py, test_quant_moe_gpu.py); the interpreter (arch None) computes them all right."""
    return 64 if layout == "nvfp4" and arch is not None and arch >= 80 else 16


def nibble_block_k(block_k: int, group: int, layout: str) -> int:
    """The K step of the nibble path: one group per step (NVFP4: 16), at most block_k inside a larger group
    (per-channel scales), at least 16 (tl.dot's K)."""
    if layout == "nvfp4":
        return 16
    bk = 1 << (min(block_k, group).bit_length() - 1)  # a power of two (tl.arange), e.g. 16 for a group of 24
    while group % bk:
        bk //= 2
    assert bk >= 16, (f"the nibble path needs a K step of 16, 32, ... inputs dividing the quantization group; group "
                      f"{group} has none (tl.dot needs K >= 16): quantize with a group that is a multiple of 16")
    return bk


def split_len(K: int, splits: int, block_k: int) -> int:
    """Inputs per split-K slice: a multiple of the K step."""
    return triton.cdiv(triton.cdiv(K, block_k), splits) * block_k

"""The one-row AWQ GEMV on CUDA cores, one thread per packed word column ("word-column" path; config key WORDCOL).

AutoAWQ packs 8 output features of one input row in a 32-bit word (qweight [K, N/8]). Here a thread owns one word
column (8 features) of the program's BLOCK_N / 8 and walks steps of ROWS rows (within one quantization group) in
registers: each row one 4-byte load (a warp reads 128 contiguous bytes), the activation x[k] the same for every
thread, and per weight one shift, one AND-OR and one FFMA (nibble q under the top mantissa bits of 1.0: v = 1 + q/16
exactly, no int-to-float conversion):

    p_f = Σ_k x_k v_kf  over the step,   out_f += 16 s_f (p_f - v_zf Σ_k x_k)  =  s_f Σ_k x_k (q_kf - z_f),

so the zero and the scale cost a few operations per (feature, step), not per weight, and nothing leaves the thread
until the K slice ends. The nibble path (gemv_nibble.py) instead feeds tl.dot with 16 padded rows: its decoded tile
goes through shared memory to the MMA layout, 9.4 SASS instructions per weight in the sm_90 loop at M = 1
(benchmarks/quant_gemv_instructions.py) against 4.8 here in 32-row steps and 5.6 in the default 8-row ones (the
scale and zero cost more per weight; the shorter steps buy more programs: see the default below).
Accuracy: products and sums in fp32 (no weight is rounded); p_f - v_zf Σx cancels at most the Σx term, of the size
of the signal (q/16 < 1), so a bit or two of fp32.

The K slices' fp32 partials are added in slice order by common.py's `_splitk_reduce_kernel` (as the other paths).
Several rows (asked for only) walk the weight one program row each, sharing part of it through L2; on an H100 that
was 1.2-1.6x slower than the nibble path (one read for all rows) at 5 and 8 rows on every projection (RESULTS.md
K6h), hence not a default.
The default (`use_wordcol`) for one row of 16-bit activations over AWQ weights with at least WORDCOL_MIN_N outputs
on sm80+: on an H100 (benchmarks/RESULTS.md K6c, AWQ g32, fp16, graph-replayed back-to-back calls) q_proj 16.25
against the nibble path's 21.66 us, in_proj_qkv 14.94 against 19.03, in_proj_z 11.98 against 13.08; it lost on
N <= 2560 (out_proj 14.34 against 13.94, k_proj, the expert-sized linears), whose few 256-feature programs
leave the GPU idle. Its last bits differ from the same row's in a 2-16-row call (the nibble path), so a request's
plain decode step and its speculative verify rows no longer share one sum order on those projections (batch
invariance is not promised across row counts: docs/speculative.md). sm70 keeps the tile path (built there without
spills, not timed).

HALF2 (the default for fp16 rows, `default_wordcol_config`; `wordcol_slice_half2`, kernels/quant/half2.py): the
same walk two weights an instruction on fp16 pairs (fma.rn.f16x2), with fp16 products and step sums: 2.3-3.0 SASS
instructions a weight in the sm_90 loop against 4.8-5.6 here (RESULTS.md K6f); on an H100 (K6g) 1.15-1.18x faster
than this walk on the wide projections in 32-row steps, and faster than the nibble path from 2560 x 6144 weights
(out_proj: 12.40 against 13.95 us), so fp16 rows take it from HALF2_MIN_WEIGHTS weights; bf16 rows keep this walk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..pdl import pdl_start
from .common import fixup_default, launch_gemv, splitk_fixup, store_partial
from .half2 import awq_code_pair, h2_fma, h2_hi, h2_lo, h2_splat
from .nibble import split_len

WORDCOL_PROGRAMS_PER_SM = 12  # split-K target: single-warp programs per SM (~1,500-2,500 won on an H100: K6c)
WORDCOL_MAX_SPLIT = 64  # 128 slices lost at every shape timed (K6c)
WORDCOL_ROWS = 8  # rows a step: small steps let 64 slices of K = 2560 stay whole steps (K6c: 8 rows won at 64)
WORDCOL_MIN_N = 6144  # the default from this many outputs (K6c: won at 6144-12288, lost at 2560 and below)
# fp16 rows take the fp16-pair walk from this many weights (N x K): on an H100 (RESULTS.md K6g) it also beat the nibble
# path on out_proj (2560 x 6144: 12.40 against 13.95 us) and lost on the expert-sized 1280 x 2560 and below
HALF2_MIN_WEIGHTS = 2560 * 6144
HALF2_ROWS = 32  # the fp16-pair walk's default step (K6g: 32-row steps fastest on q_proj, in_proj_qkv, out_proj)
WORDCOL_LAYOUTS = ("awq",)  # packed along N: the word-column walk
HALF2_MAX_ROWS = 32  # the fp16-pair walk's step: its partials stay under fp16's 65504 (wordcol_slice_half2)


def wordcol_config(N: int, K: int, group: int, num_sms: int, block_n: int = 256, num_warps: int = 1,
                   split: int | None = None, rows: int | None = None, prefetch: bool = False,
                   half2: bool = False) -> dict:
    """Launch config of the word-column GEMV of one row over W [N, K] (AWQ, `group` rows a group): BLOCK_N features
    a program (one word column a thread: block_n = 256 per warp), BLOCK_K = rows a step (default WORDCOL_ROWS, at
    most the group, which it divides), split-K over whole steps aiming at WORDCOL_PROGRAMS_PER_SM programs per SM (at
    most WORDCOL_MAX_SPLIT slices, at least 2 steps each) unless `split` is given. prefetch: wordcol_slice's
    PREFETCH (8-row steps). half2: the fp16-pair walk (HALF2, fp16 activations; steps of at most HALF2_MAX_ROWS)."""
    rows = rows or min(group, WORDCOL_ROWS)
    assert group % rows == 0 and (rows == 8 or not prefetch), (group, rows, prefetch)
    assert not (half2 and (prefetch or rows > HALF2_MAX_ROWS)), (rows, prefetch, half2)
    tiles = triton.cdiv(N, block_n)
    steps = triton.cdiv(K, rows)
    if split is None:
        split = 1
        while (split < WORDCOL_MAX_SPLIT and tiles * split < WORDCOL_PROGRAMS_PER_SM * num_sms
               and steps // (2 * split) >= 2):
            split *= 2
    return dict(BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=rows, SPLIT_K=split, USE_DOT=False, WORDCOL=True,
                PREFETCH=prefetch, HALF2=half2, k_per_split=split_len(K, split, rows), num_warps=num_warps,
                num_stages=1)


def use_wordcol(arch: int | None, dtype: torch.dtype, layout: str, M: int, N: int, K: int) -> bool:
    """Whether the default GEMV of M rows over a `layout` weight W [N, K] and `dtype` activations on compute
    capability `arch` (None: the interpreter) is the word-column path: one row, AWQ, 16-bit activations, sm80+, at
    least WORDCOL_MIN_N outputs, or for fp16 (the fp16-pair walk) at least HALF2_MIN_WEIGHTS weights."""
    if not (M == 1 and layout in WORDCOL_LAYOUTS and arch is not None and arch >= 80
            and dtype in (torch.float16, torch.bfloat16)):
        return False
    return N >= WORDCOL_MIN_N or (dtype == torch.float16 and N * K >= HALF2_MIN_WEIGHTS)


def default_wordcol_config(N: int, K: int, group: int, num_sms: int, dtype: torch.dtype) -> dict:
    """The word-column config one row of `dtype` takes by default: fp16 the fp16-pair walk in HALF2_ROWS-row steps
    (at most the group), bf16 the fp32 walk in WORDCOL_ROWS-row steps; split-K as wordcol_config picks, reduced
    inside the kernel where common.fixup_default() says so; the GEMV and its reduce chained by PDL where the device
    has it (sm_90: 8-9% off a one-row GEMV on an H100, RESULTS.md K6j)."""
    extra = dict(PDL=True) | (dict(FIXUP=True) if fixup_default() else {})  # PDL: sm_90 only (launch_gemv asks)
    if dtype == torch.float16:
        return wordcol_config(N, K, group, num_sms, rows=min(group, HALF2_ROWS), half2=True) | extra
    return wordcol_config(N, K, group, num_sms) | extra


@triton.jit
def _top_nibble(words, j: tl.constexpr):
    """fp32 1 + q/16 of nibble j (bits 4j..4j+3) of int32 words: the nibble moved under the mantissa's top 4 bits
    (19..22) and OR'ed into 1.0's bits, exactly."""
    if 4 * j <= 19:
        b = words << (19 - 4 * j)
    else:
        b = words >> (4 * j - 19)
    return ((b & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _feature(j: tl.constexpr):
    """The feature (0..7 within its word) that AWQ stores at nibble j (pack order 0, 2, 4, 6, 1, 3, 5, 7)."""
    return (j % 4) * 2 + j // 4


@triton.jit
def _flush(acc, p, b_z, sx, sc_row, o_w, m_w, j: tl.constexpr):
    """acc [W] += s · Σ x (q - z) for nibble j's features, from p = Σ x v (v = 1 + q/16) and sx = Σ x."""
    s = tl.load(sc_row + o_w * 8 + _feature(j), mask=m_w).to(tl.float32)
    return acc + 16.0 * s * (p - _top_nibble(b_z, j) * sx)


@triton.jit
def _store(ws, out, bias, acc, i_m, o_w, M, N, stride_om, i_s, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
           j: tl.constexpr):
    store_partial(ws, out, bias, acc[None, :], i_m + tl.arange(0, 1), o_w * 8 + _feature(j), M, N, stride_om, i_s,
                  SPLIT_K, HAS_BIAS)


@triton.jit
def _row(p0, p1, p2, p3, p4, p5, p6, p7, sx, wd, xk):
    """One row of a step: the 8 nibble positions' sums += x_k · v, Σx += x_k (xk: fp32 scalar; wd: [W] words)."""
    return (p0 + _top_nibble(wd, 0) * xk, p1 + _top_nibble(wd, 1) * xk, p2 + _top_nibble(wd, 2) * xk,
            p3 + _top_nibble(wd, 3) * xk, p4 + _top_nibble(wd, 4) * xk, p5 + _top_nibble(wd, 5) * xk,
            p6 + _top_nibble(wd, 6) * xk, p7 + _top_nibble(wd, 7) * xk, sx + xk)


@triton.jit
def _load8(rows, NW, m_w):
    """The words [W] of 8 consecutive rows from `rows` (row pointers of the first)."""
    return (tl.load(rows, mask=m_w), tl.load(rows + NW, mask=m_w), tl.load(rows + 2 * NW, mask=m_w),
            tl.load(rows + 3 * NW, mask=m_w), tl.load(rows + 4 * NW, mask=m_w), tl.load(rows + 5 * NW, mask=m_w),
            tl.load(rows + 6 * NW, mask=m_w), tl.load(rows + 7 * NW, mask=m_w))


@triton.jit
def wordcol_slice(x_row, qw, qz, sc, o_w, m_w, N, k_lo, k_hi, G: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr,
                  PREFETCH: tl.constexpr = False, HALF2: tl.constexpr = False, ASM: tl.constexpr = True):
    """x_row[k_lo:k_hi] @ W[features of words o_w, k_lo:k_hi]ᵀ for an AutoAWQ linear of N outputs (qweight [K, N/8],
    qzeros [K/G, N/8], scales [K/G, N]; k_lo, k_hi multiples of ROWS, which divides G): eight fp32 [W] sums, the j-th
    for features 8·o_w + _feature(j). m_w: the words' mask (None: all in range). A step walks ROWS rows of one
    group and flushes them with that group's scale and zero (the flush is linear in the sums, so a group may span
    steps and K slices).

    PREFETCH (ROWS 8): the next step's words are loaded before this step's are used (carried in registers), so a
    program has a step of loads in flight while it computes; without it each step waits a full memory latency,
    which is why the walk needs many programs (RESULTS.md K6c); it gained nothing there (K6d).

    HALF2 (fp16 x): wordcol_slice_half2's walk on fp16 pairs instead; ASM: its fma.rn.f16x2 as inline PTX (False:
    the interpreter's twin, half2.py)."""
    if HALF2:
        a0, a1, a2, a3, a4, a5, a6, a7 = wordcol_slice_half2(x_row, qw, qz, sc, o_w, m_w, N, k_lo, k_hi, G, W, ROWS,
                                                             ASM)
    else:
        a0, a1, a2, a3, a4, a5, a6, a7 = _wordcol_slice_f32(x_row, qw, qz, sc, o_w, m_w, N, k_lo, k_hi, G, W, ROWS,
                                                            PREFETCH)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _wordcol_slice_f32(x_row, qw, qz, sc, o_w, m_w, N, k_lo, k_hi, G: tl.constexpr, W: tl.constexpr,
                       ROWS: tl.constexpr, PREFETCH: tl.constexpr):
    """wordcol_slice's walk in fp32 (the module docstring's)."""
    tl.static_assert(ROWS == 8 or not PREFETCH, "PREFETCH walks 8-row steps")
    NW = N // 8
    a0 = tl.zeros([W], dtype=tl.float32)  # one accumulator per nibble position
    a1, a2, a3, a4, a5, a6, a7 = a0, a0, a0, a0, a0, a0, a0
    if PREFETCH:  # k0 * NW < qweight.numel() < 2^31 (the wrappers check); the clamp keeps every load in bounds
        n0, n1, n2, n3, n4, n5, n6, n7 = _load8(qw + tl.minimum(k_lo, k_hi - 8) * NW + o_w, NW, m_w)
    for k0 in range(k_lo, k_hi, ROWS):
        p0 = tl.zeros([W], dtype=tl.float32)
        p1, p2, p3, p4, p5, p6, p7 = p0, p0, p0, p0, p0, p0, p0
        sx = 0.0
        if PREFETCH:
            cs = (n0, n1, n2, n3, n4, n5, n6, n7)  # this step's words; the next step's load now
            n0, n1, n2, n3, n4, n5, n6, n7 = _load8(qw + tl.minimum(k0 + 8, k_hi - 8) * NW + o_w, NW, m_w)
            for r in tl.static_range(8):
                p0, p1, p2, p3, p4, p5, p6, p7, sx = _row(p0, p1, p2, p3, p4, p5, p6, p7, sx, cs[r],
                                                          tl.load(x_row + k0 + r).to(tl.float32))
        else:
            rows = qw + k0 * NW + o_w  # k0 * NW < qweight.numel() < 2^31 (the wrappers check)
            for r in tl.static_range(ROWS):  # independent loads the compiler issues ahead
                p0, p1, p2, p3, p4, p5, p6, p7, sx = _row(p0, p1, p2, p3, p4, p5, p6, p7, sx,
                                                          tl.load(rows + r * NW, mask=m_w),
                                                          tl.load(x_row + k0 + r).to(tl.float32))
        g = k0 // G
        b_z = tl.load(qz + g * NW + o_w, mask=m_w)  # [W]
        sc_row = sc + g * N
        a0 = _flush(a0, p0, b_z, sx, sc_row, o_w, m_w, 0)
        a1 = _flush(a1, p1, b_z, sx, sc_row, o_w, m_w, 1)
        a2 = _flush(a2, p2, b_z, sx, sc_row, o_w, m_w, 2)
        a3 = _flush(a3, p3, b_z, sx, sc_row, o_w, m_w, 3)
        a4 = _flush(a4, p4, b_z, sx, sc_row, o_w, m_w, 4)
        a5 = _flush(a5, p5, b_z, sx, sc_row, o_w, m_w, 5)
        a6 = _flush(a6, p6, b_z, sx, sc_row, o_w, m_w, 6)
        a7 = _flush(a7, p7, b_z, sx, sc_row, o_w, m_w, 7)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _flush_pair(a_lo, a_hi, p, sc_row, o_w, m_w, back, j: tl.constexpr, SCALED: tl.constexpr):
    """a_lo / a_hi [W] (features 2j / 2j + 1 of words o_w) += s · lane of the step's fp16 pair sums p (the walk
    multiplies its sums by 512 once at the end); SCALED: the step's x was scaled by 1 / back (bf16 x), undone here."""
    s_lo = tl.load(sc_row + o_w * 8 + 2 * j, mask=m_w).to(tl.float32)
    s_hi = tl.load(sc_row + o_w * 8 + 2 * j + 1, mask=m_w).to(tl.float32)
    if SCALED:
        s_lo = s_lo * back
        s_hi = s_hi * back
    return a_lo + h2_lo(p) * s_lo, a_hi + h2_hi(p) * s_hi


@triton.jit
def _step_scale(x_row, k0, ROWS: tl.constexpr):
    """(x scale, its inverse) of a step of bf16 x: the powers of two 2^(14 - e), 2^(e - 14) for the step's largest
    |x_k| in [2^e, 2^(e + 1)), so the scaled x lie within fp16's range (< 2^15) and convert to fp16 exactly (bf16's
    8 significant bits; only x under 2^-24 of the largest would lose bits)."""
    m = tl.abs(tl.load(x_row + k0).to(tl.float32))
    for r in tl.static_range(1, ROWS):
        m = tl.maximum(m, tl.abs(tl.load(x_row + k0 + r).to(tl.float32)))
    e = tl.maximum((m.to(tl.int32, bitcast=True) >> 23) & 0xFF, 15)  # biased exponent; an all-zero step: any scale
    e = tl.minimum(e, 254)  # inf / NaN stay inf / NaN
    return ((268 - e) << 23).to(tl.float32, bitcast=True), ((e - 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _step_pair(wd, j: tl.constexpr, mult, nz, xx, p, ASM: tl.constexpr):
    """p += x_k · (q - z) / 512 for the pair of features (2j, 2j + 1) of row words wd (half2.awq_code_pair)."""
    return h2_fma(h2_fma(awq_code_pair(wd, j), mult, nz, ASM), xx, p, ASM)


@triton.jit
def _neg_zeros(b_z, neg_even, neg_odd, zero, ASM: tl.constexpr):
    """-z / 512 of the zero words b_z as four fp16 pairs (exact)."""
    return (h2_fma(awq_code_pair(b_z, 0), neg_even, zero, ASM), h2_fma(awq_code_pair(b_z, 1), neg_odd, zero, ASM),
            h2_fma(awq_code_pair(b_z, 2), neg_even, zero, ASM), h2_fma(awq_code_pair(b_z, 3), neg_odd, zero, ASM))


@triton.jit
def _step_pairs(wd, m_even, m_odd, nz0, nz1, nz2, nz3, xx, p0, p1, p2, p3, ASM: tl.constexpr):
    """One row of a step: the four pair sums of row words wd += x_k · (q - z) / 512 (`_step_pair`)."""
    return (_step_pair(wd, 0, m_even, nz0, xx, p0, ASM), _step_pair(wd, 1, m_odd, nz1, xx, p1, ASM),
            _step_pair(wd, 2, m_even, nz2, xx, p2, ASM), _step_pair(wd, 3, m_odd, nz3, xx, p3, ASM))


@triton.jit
def _flush_pairs(a0, a1, a2, a3, a4, a5, a6, a7, p0, p1, p2, p3, sc_row, o_w, m_w, back, SCALED: tl.constexpr):
    """The step's four pair sums into the eight fp32 sums (`_flush_pair`; a_j: nibble j)."""
    a0, a4 = _flush_pair(a0, a4, p0, sc_row, o_w, m_w, back, 0, SCALED)
    a1, a5 = _flush_pair(a1, a5, p1, sc_row, o_w, m_w, back, 1, SCALED)
    a2, a6 = _flush_pair(a2, a6, p2, sc_row, o_w, m_w, back, 2, SCALED)
    a3, a7 = _flush_pair(a3, a7, p3, sc_row, o_w, m_w, back, 3, SCALED)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def wordcol_slice_half2(x_row, qw, qz, sc, o_w, m_w, N, k_lo, k_hi, G: tl.constexpr, W: tl.constexpr,
                        ROWS: tl.constexpr, ASM: tl.constexpr):
    """wordcol_slice (same arguments and sums) on fp16 pairs, for fp16 x. A word's 8 codes become 4 pairs with one
    shift and four ANDs (half2.awq_code_pair: subnormal codes), and each pair of weights costs two fma.rn.f16x2
    (the fp32 walk: a shift, an AND-OR and an FFMA a weight):

        d = code · 2^15 (or 2^11) - z / 512 = (q - z) / 512   (exact: a multiple of 2^-9 under 2^-5)
        p += x_k · d                                           (fp16, over the step's ROWS rows)

    and once a (feature, step) the pair goes to fp32 times s (the slice's sums times 512 at the end). Accuracy: each
    product and partial sum is rounded to fp16 (2^-11 relative, as a GEMM accumulating in fp16 over ROWS terms; the
    fp32 walk rounds nothing); the 1 / 512 keeps every partial under 65504 for any fp16 x (|Σ x d| <= 32 · 15 ·
    65504 / 512), and costs absolute precision only where |x_k (q - z)| < 2^-14 · 512 = 1/32 (subnormal products,
    2^-25 · 512 = 1.5e-5 each)."""
    a0, a1, a2, a3, a4, a5, a6, a7, _0, _1, _2, _3, _4, _5, _6, _7 = _half2_walk(
        x_row, qw, qz, sc, o_w, qw, qz, sc, o_w, m_w, N, k_lo, k_hi, G, W, ROWS, ASM, False)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def wordcol_slice2_half2(x_row, qw, qz, sc, o_w, qw2, qz2, sc2, o_w2, m_w, N, k_lo, k_hi, G: tl.constexpr,
                         W: tl.constexpr, ROWS: tl.constexpr, ASM: tl.constexpr):
    """`wordcol_slice_half2` over two weights of the same shape, K slice and word mask at once (an expert's gate and up
    rows): each step loads both weights' words (twice the loads in flight a thread, half the dependent steps of two
    walks one after the other) and x once. Returns sixteen fp32 [W] sums, the first weight's eight then the
    second's, each bitwise what wordcol_slice_half2 returns for that weight alone (the same operations in the same
    order; the two chains never mix)."""
    a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7 = _half2_walk(
        x_row, qw, qz, sc, o_w, qw2, qz2, sc2, o_w2, m_w, N, k_lo, k_hi, G, W, ROWS, ASM, True)
    return a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7


@triton.jit
def _half2_walk(x_row, qw, qz, sc, o_w, qw2, qz2, sc2, o_w2, m_w, N, k_lo, k_hi, G: tl.constexpr, W: tl.constexpr,
                ROWS: tl.constexpr, ASM: tl.constexpr, TWO: tl.constexpr):
    """The fp16-pair walk of wordcol_slice_half2 over qw (and with TWO over qw2 beside it, sharing the x loads and
    the bf16 step scales): sixteen fp32 [W] sums, qw's eight then qw2's (zeros without TWO)."""
    tl.static_assert(ROWS <= 32, "fp16 partials of at most 32 rows (HALF2_MAX_ROWS)")
    SCALED: tl.constexpr = x_row.dtype.element_ty == tl.bfloat16  # bf16 x: each step scaled into fp16 (_step_scale)
    NW = N // 8
    m_even = tl.full([W], 0x78007800, tl.int32)  # 2^15 in both lanes: awq_code_pair's j = 0, 2
    m_odd = tl.full([W], 0x68006800, tl.int32)  # 2^11: j = 1, 3
    neg_even = m_even ^ -0x7FFF8000  # -2^15 (the sign bits 0x80008000 set)
    neg_odd = m_odd ^ -0x7FFF8000  # -2^11
    zero = tl.zeros([W], dtype=tl.int32)
    a0 = tl.zeros([W], dtype=tl.float32)  # fp32 sums in nibble order (a_j: nibble j of the words)
    a1, a2, a3, a4, a5, a6, a7 = a0, a0, a0, a0, a0, a0, a0
    b0, b1, b2, b3, b4, b5, b6, b7 = a0, a0, a0, a0, a0, a0, a0, a0  # qw2's (TWO)
    for k0 in range(k_lo, k_hi, ROWS):
        g = k0 // G
        b_z = tl.load(qz + g * NW + o_w, mask=m_w)  # [W]
        nz0, nz1, nz2, nz3 = _neg_zeros(b_z, neg_even, neg_odd, zero, ASM)  # -z / 512, exact
        p0, p1, p2, p3 = zero, zero, zero, zero
        if TWO:
            b_z2 = tl.load(qz2 + g * NW + o_w2, mask=m_w)
            mz0, mz1, mz2, mz3 = _neg_zeros(b_z2, neg_even, neg_odd, zero, ASM)
            q0, q1, q2, q3 = zero, zero, zero, zero
        if SCALED:
            x_scale, back = _step_scale(x_row, k0, ROWS)
        else:
            x_scale, back = 1.0, 1.0
        rows = qw + k0 * NW + o_w  # k0 * NW < qweight.numel() < 2^31 (the wrappers check)
        if TWO:
            rows2 = qw2 + k0 * NW + o_w2
        for r in tl.static_range(ROWS):  # independent loads the compiler issues ahead
            wd = tl.load(rows + r * NW, mask=m_w)
            if TWO:
                wd2 = tl.load(rows2 + r * NW, mask=m_w)
            if SCALED:
                xx = h2_splat((tl.load(x_row + k0 + r).to(tl.float32) * x_scale).to(tl.float16))
            else:
                xx = h2_splat(tl.load(x_row + k0 + r))  # (x_k, x_k)
            p0, p1, p2, p3 = _step_pairs(wd, m_even, m_odd, nz0, nz1, nz2, nz3, xx, p0, p1, p2, p3, ASM)
            if TWO:
                q0, q1, q2, q3 = _step_pairs(wd2, m_even, m_odd, mz0, mz1, mz2, mz3, xx, q0, q1, q2, q3, ASM)
        a0, a1, a2, a3, a4, a5, a6, a7 = _flush_pairs(a0, a1, a2, a3, a4, a5, a6, a7, p0, p1, p2, p3, sc + g * N,
                                                      o_w, m_w, back, SCALED)
        if TWO:
            b0, b1, b2, b3, b4, b5, b6, b7 = _flush_pairs(b0, b1, b2, b3, b4, b5, b6, b7, q0, q1, q2, q3,
                                                          sc2 + g * N, o_w2, m_w, back, SCALED)
    # the codes' 1/512 undone once (exact: a power of two)
    return (a0 * 512.0, a1 * 512.0, a2 * 512.0, a3 * 512.0, a4 * 512.0, a5 * 512.0, a6 * 512.0, a7 * 512.0,
            b0 * 512.0, b1 * 512.0, b2 * 512.0, b3 * 512.0, b4 * 512.0, b5 * 512.0, b6 * 512.0, b7 * 512.0)


@triton.jit
def _awq_wordcol_kernel(x, qw, qz, sc, ws, out, bias, M, N, K, stride_xm, stride_om, k_per_split, G: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                        USE_DOT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr, ROWS: tl.constexpr,
                        PREFETCH: tl.constexpr, HALF2: tl.constexpr = False, ASM: tl.constexpr = True,
                        N_FIXED: tl.constexpr = 0, counters=None, FIXUP: tl.constexpr = False,
                        PDL: tl.constexpr = False):
    """out [M, N] (SPLIT_K == 1) or ws [SPLIT_K, M, N] fp32 (K slice program_id(1)) of x [M, K] @ Wᵀ, row
    program_id(2) (each row walks the weight on its own: M rows read it M times, from L2 when their programs run
    together), W as AutoAWQ's qweight [K, N/8] / qzeros [K/G, N/8] / scales [K/G, N]. BLOCK_M, BLOCK_K, USE_DOT:
    launch_gemv's argument list (1, G, False). EVEN: BLOCK_N divides N (no feature masks: ~10% fewer instructions a
    weight in the sm_90 loop). ROWS, PREFETCH, HALF2, ASM: wordcol_slice's. N_FIXED: N as a compile-time constant
    (0: not), so the walk's row offsets are immediates of its loads (a runtime row stride costs ~3 instructions a
    row: RESULTS.md K6f). FIXUP (SPLIT_K > 1): the last of a tile's K slices adds the slices' partials and writes out
    (common.splitk_fixup over int32 `counters`, one a (row, N tile)) instead of a reduce launch. PDL:
    pdl.pdl_start."""
    pdl_start(PDL)
    if N_FIXED > 0:
        N = N_FIXED
    i_n, i_s, i_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    W: tl.constexpr = BLOCK_N // 8
    o_w = i_n * W + tl.arange(0, W)
    m_w = None if EVEN else o_w < N // 8
    k_lo = i_s * k_per_split
    a0, a1, a2, a3, a4, a5, a6, a7 = wordcol_slice(x + i_m.to(tl.int64) * stride_xm, qw, qz, sc, o_w, m_w, N, k_lo,
                                                   tl.minimum(k_lo + k_per_split, K), G, W, ROWS, PREFETCH, HALF2, ASM)
    _store(ws, out, bias, a0, i_m, o_w, M, N, stride_om, i_s, SPLIT_K, HAS_BIAS, 0)
    _store(ws, out, bias, a1, i_m, o_w, M, N, stride_om, i_s, SPLIT_K, HAS_BIAS, 1)
    _store(ws, out, bias, a2, i_m, o_w, M, N, stride_om, i_s, SPLIT_K, HAS_BIAS, 2)
    _store(ws, out, bias, a3, i_m, o_w, M, N, stride_om, i_s, SPLIT_K, HAS_BIAS, 3)
    _store(ws, out, bias, a4, i_m, o_w, M, N, stride_om, i_s, SPLIT_K, HAS_BIAS, 4)
    _store(ws, out, bias, a5, i_m, o_w, M, N, stride_om, i_s, SPLIT_K, HAS_BIAS, 5)
    _store(ws, out, bias, a6, i_m, o_w, M, N, stride_om, i_s, SPLIT_K, HAS_BIAS, 6)
    _store(ws, out, bias, a7, i_m, o_w, M, N, stride_om, i_s, SPLIT_K, HAS_BIAS, 7)
    if FIXUP:  # the tile's features are BLOCK_N consecutive ones: words o_w, each its 8
        splitk_fixup(ws, out, bias, counters, i_m * tl.num_programs(0) + i_n, i_m + tl.arange(0, 1),
                     i_n * BLOCK_N + tl.arange(0, BLOCK_N), M, N, stride_om, SPLIT_K, HAS_BIAS)


def awq_wordcol_gemv(x: Tensor, qweight: Tensor, qzeros: Tensor, scales: Tensor, group: int, bias: Tensor | None,
                     cfg: dict, counters: Tensor | None = None) -> Tensor:
    """x [M, K] @ Wᵀ (+ bias) -> [M, N] in x.dtype on the word-column path (`wordcol_config`; the default for one
    row, `use_wordcol`; several rows only when asked: each walks the weight on its own)."""
    assert cfg.get("WORDCOL") and cfg["BLOCK_M"] == 1, f"the word-column GEMV takes its own config: {cfg}"
    assert qweight.numel() < 2 ** 31, "the word-column GEMV indexes qweight in int32"
    half2 = cfg.get("HALF2", False)
    assert x.dtype in (torch.float16, torch.bfloat16) or not half2, \
        f"the fp16-pair walk (HALF2) takes fp16 or bf16 activations, not {x.dtype}"
    N = scales.shape[1]
    return launch_gemv(_awq_wordcol_kernel, x, N, bias, cfg, qweight, qzeros, scales, G=group,
                       EVEN=N % cfg["BLOCK_N"] == 0, ROWS=cfg["BLOCK_K"], PREFETCH=cfg.get("PREFETCH", False),
                       HALF2=half2, ASM=x.is_cuda,  # the interpreter runs half2.py's twin of the inline PTX
                       N_FIXED=N if half2 else 0,  # a kernel per N (a layer's N is fixed): immediate row offsets
                       counters=counters)

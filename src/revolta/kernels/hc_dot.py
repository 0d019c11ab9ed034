"""HyperConnection read at 4-16 rows: the down and up passes on tl.dot (issue 19; the formulas and the
torch reference `hc_read_ref` are in kernels/hc.py, which launches these between its mix kernel).

Why: the row-streaming kernels of hc.py apply each weight tile to one row at a time (the tile re-read from
L1/L2 per row, a cross-thread reduction per row), which costs 2.6-2.9x the M = 1 time at M = 5-8 on the
H200 (RESULTS.md K7c). Here every weight tile is loaded once and multiplied against all rows of a 16-row
tile (the smallest tl.dot tile; rows past M are masked loads: no bytes move for them) in one tl.dot.

  down, grid (row tiles of [W_dn; W_inj], K splits, 16-row tiles): partial[s, m, j] = Σ_k W[j, k]·x[m, k]·(1 + w_k)
        over split s's columns, and Σx² per row; the same workspace layout as `_hc_down_rows_kernel`, so the
        mix kernel of hc.py reduces either.
  up,   grid (column tiles c of d, 16-row tiles): the rows b·d + c of W_up for every branch b form ONE
        [h·BLOCK_C, r] tile (row j <-> branch j // BLOCK_C, so a tile row's index is also its feature index
        in the wide residual); G = a @ tileᵀ in two K pieces (320 = 256 + 64), then u = (1/h) Σ_b σ(G)·n_b
        (a reshape to [16, h, BLOCK_C] and a sum over the branches).
Both load their whole weight slice before the first dot, so it is all in flight at once; the up kernel
issues those loads before it waits for the mix grid (programmatic dependent launch, sm90).

Row invariance: a row's result depends only on its own inputs (a tl.dot row reads one row of the left
operand) and on the config, which is the same for every M the dot config serves, so within that range
a row's result does not depend on the batch (it does differ from the rows kernels' rounding at M <= 3).

Dot operands are x.dtype (fp16 / bf16; fp32 with input_precision "ieee"). `x·(1 + w)` is rounded to x.dtype
for the down dot (the layer rounds N = x·rstd·(1 + w) to x.dtype before its matmul; rstd is applied in fp32
after the K reduction here). DOT_F32: the Triton interpreter multiplies bf16 as raw 16-bit integers
(np.matmul on the storage), so under it the wrapper upcasts the (already rounded) bf16 operands to fp32:
the same values, the same products.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .pdl import pdl_launch

DOT_M = 16  # rows per tile: tl.dot's smallest M (and N, K)


@triton.jit
def load_w_tile(w_down, w_inject, o_r, o_k, m_k, R, RH, stride_wd, stride_wi):
    """[len(o_r), len(o_k)] of the virtual [W_dn; W_inj] (rows [0, R) of W_dn, [R, RH) of W_inj, 0 past RH),
    x.dtype: one load through a per-row choice of matrix (two masked loads would hold twice the registers
    for the same bytes). Shared with hc.py's rows kernel."""
    p_w = tl.where((o_r < R)[:, None], w_down + o_r[:, None].to(tl.int64) * stride_wd + o_k[None, :],
                   w_inject + (o_r[:, None] - R).to(tl.int64) * stride_wi + o_k[None, :])
    return tl.load(p_w, mask=(o_r < RH)[:, None] & m_k[None, :], other=0.0)


@triton.jit
def _down_dot_chunk(x, norm_w, w_down, w_inject, comb_inj, comb_u, comb_y, b_acc, b_sq, k0, i_r, i_s, o_r, o_m, m_m, R,
                    RH, D, stride_x, stride_wd, stride_wi, stride_ci, stride_cu, stride_cy, KSPLIT: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, COMBINE: tl.constexpr):
    """One K chunk of `_hc_down_dot_kernel` for its 16-row tile -> (b_acc, b_sq)."""
    m_k = k0 + tl.arange(0, BLOCK_K) < KSPLIT  # this split's columns only
    o_k = i_s * KSPLIT + k0 + tl.arange(0, BLOCK_K)
    b_w = load_w_tile(w_down, w_inject, o_r, o_k, m_k, R, RH, stride_wd, stride_wi)  # [BR, BK] x.dtype
    m_x = m_m[:, None] & m_k[None, :]
    b_x = tl.load(x + o_m[:, None].to(tl.int64) * stride_x + o_k[None, :], mask=m_x, other=0.0)  # [BM, BK] x.dtype
    if COMBINE:
        i_b = (i_s * KSPLIT) // D  # this split's branch
        b_u = tl.load(comb_u + o_m[:, None].to(tl.int64) * stride_cu + (o_k - i_b * D)[None, :], mask=m_x,
                      other=0.0).to(tl.float32)
        b_wi = tl.load(comb_inj + o_m.to(tl.int64) * stride_ci + i_b, mask=m_m, other=0.0).to(tl.float32)
        # the fp32 product of 16-bit values is exact: one rounding, which FMA contraction cannot change
        b_x = (b_x.to(tl.float32) + b_wi[:, None] * b_u).to(b_x.dtype)
        if i_r == 0:
            tl.store(comb_y + o_m[:, None].to(tl.int64) * stride_cy + o_k[None, :], b_x, mask=m_x)
    b_x = b_x.to(tl.float32)
    b_nw = 1.0 + tl.load(norm_w + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
    b_sq += tl.sum(b_x * b_x, 1)
    b_xw = (b_x * b_nw[None, :]).to(b_w.dtype)  # the dot's operand, rounded as the layer rounds N
    if DOT_F32:
        return tl.dot(b_xw.to(tl.float32), tl.trans(b_w.to(tl.float32)), b_acc, input_precision="ieee"), b_sq
    return tl.dot(b_xw, tl.trans(b_w), b_acc, input_precision="ieee"), b_sq


@triton.jit
def _hc_down_dot_kernel(x, norm_w, w_down, w_inject, partial, sumsq, M, R, RH,
                        stride_x, stride_wd, stride_wi, stride_p, comb_inj, comb_u, comb_y, D, stride_ci, stride_cu,
                        stride_cy, KSPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr, COMBINE: tl.constexpr):
    # COMBINE: x is the residual before a block's write; each loaded [BM, BK] slice (a split lies in one branch)
    # becomes y = x + inj·u rounded once, as hc.py's rows down pass makes it, and the programs of row tile 0
    # store it to comb_y (the splits and 16-row tiles cover every element once)
    if PDL:
        gdc_launch_dependents()  # the mix kernel may start; it waits for this grid before reading
    i_r = tl.program_id(0)
    i_s = tl.program_id(1)
    i_m = tl.program_id(2)
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    m_w = o_r < RH  # rows [0, R) come from W_dn, rows [R, RH) from W_inj (RH = R without it)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < M
    b_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    if COMBINE:  # one chunk at a time (the same sums in the same order): unrolled, the write's loads spill on sm_70
        for k0 in range(0, KSPLIT, BLOCK_K):
            b_acc, b_sq = _down_dot_chunk(x, norm_w, w_down, w_inject, comb_inj, comb_u, comb_y, b_acc, b_sq, k0, i_r,
                                          i_s, o_r, o_m, m_m, R, RH, D, stride_x, stride_wd, stride_wi, stride_ci,
                                          stride_cu, stride_cy, KSPLIT, BLOCK_K, DOT_F32, True)
    else:
        for k0 in tl.static_range(0, KSPLIT, BLOCK_K):  # unrolled: every chunk's loads can be in flight at once
            b_acc, b_sq = _down_dot_chunk(x, norm_w, w_down, w_inject, comb_inj, comb_u, comb_y, b_acc, b_sq, k0, i_r,
                                          i_s, o_r, o_m, m_m, R, RH, D, stride_x, stride_wd, stride_wi, stride_ci,
                                          stride_cu, stride_cy, KSPLIT, BLOCK_K, DOT_F32, False)
    # partial: [S, M, RH] fp32 (row stride stride_p), sumsq: [S, M] fp32
    tl.store(partial + (i_s * M + o_m[:, None]).to(tl.int64) * stride_p + o_r[None, :], b_acc,
             mask=m_m[:, None] & m_w[None, :])
    if i_r == 0:
        tl.store(sumsq + i_s * M + o_m, b_sq, mask=m_m)


@triton.jit
def _dot_rows(p_a, o_k, m_m, R, b_w, b_g, DOT_F32: tl.constexpr):
    """b_g + a[:, o_k] @ b_wᵀ: a = the mix rows at p_a ([BM, len(o_k)], 0 past R and M), b_w [N, len(o_k)]."""
    b_a = tl.load(p_a + o_k[None, :], mask=m_m[:, None] & (o_k < R)[None, :], other=0.0)
    if DOT_F32:
        return tl.dot(b_a.to(tl.float32), tl.trans(b_w.to(tl.float32)), b_g, input_precision="ieee")
    return tl.dot(b_a, tl.trans(b_w), b_g, input_precision="ieee")


@triton.jit
def _hc_up_dot_kernel(x, norm_w, w_up, mix, rstd, out, M, R, D, stride_x, stride_wu, stride_o,
                      NH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K1: tl.constexpr,
                      BLOCK_K2: tl.constexpr, BLOCK_KC: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
    # BLOCK_KC = 0: W_up's K in the two pieces BLOCK_K1 + BLOCK_K2, both loaded before the wait for the mix
    # grid; BLOCK_KC > 0: K in BLOCK_KC chunks (BLOCK_K1 = their count), each loaded where it is multiplied:
    # sm_70's FMA dot holds a whole K piece per thread and spills at K = 256
    i_c = tl.program_id(0)
    i_m = tl.program_id(1)
    # tile row j: branch j // BLOCK_C, column i_c·BLOCK_C + j % BLOCK_C; o_f = its feature index in the
    # wide residual = its row of W_up
    o_j = tl.arange(0, NH * BLOCK_C)
    o_c = i_c * BLOCK_C + o_j % BLOCK_C
    o_f = (o_j // BLOCK_C) * D + o_c  # [NH·BC]
    m_f = o_c < D
    p_w = w_up + o_f[:, None].to(tl.int64) * stride_wu
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < M
    p_a = mix + o_m[:, None].to(tl.int64) * R
    b_nw = 1.0 + tl.load(norm_w + o_f, mask=m_f, other=0.0).to(tl.float32)  # [NH·BC]
    b_g = tl.zeros([BLOCK_M, NH * BLOCK_C], dtype=tl.float32)
    if BLOCK_KC == 0:
        o_k1 = tl.arange(0, BLOCK_K1)
        b_w1 = tl.load(p_w + o_k1[None, :], mask=m_f[:, None] & (o_k1 < R)[None, :], other=0.0)  # [NH·BC, K1]
        if BLOCK_K2 > 0:
            o_k2 = BLOCK_K1 + tl.arange(0, BLOCK_K2)
            b_w2 = tl.load(p_w + o_k2[None, :], mask=m_f[:, None] & (o_k2 < R)[None, :], other=0.0)  # [NH·BC, K2]
        if PDL:
            gdc_wait()  # the mix grid's `a` and rstd are complete and visible from here on; W_up is in flight
        b_g = _dot_rows(p_a, o_k1, m_m, R, b_w1, b_g, DOT_F32)
        if BLOCK_K2 > 0:
            b_g = _dot_rows(p_a, o_k2, m_m, R, b_w2, b_g, DOT_F32)
    else:
        if PDL:
            gdc_wait()
        for i_k in tl.static_range(BLOCK_K1):
            o_k = i_k * BLOCK_KC + tl.arange(0, BLOCK_KC)
            b_w = tl.load(p_w + o_k[None, :], mask=m_f[:, None] & (o_k < R)[None, :], other=0.0)  # [NH·BC, KC]
            b_g = _dot_rows(p_a, o_k, m_m, R, b_w, b_g, DOT_F32)
    b_x = tl.load(x + o_m[:, None].to(tl.int64) * stride_x + o_f[None, :], mask=m_m[:, None] & m_f[None, :],
                  other=0.0).to(tl.float32)  # [BM, NH·BC]
    b_r = tl.load(rstd + o_m[:, None] * NH + (o_j // BLOCK_C)[None, :], mask=m_m[:, None], other=0.0)
    b_p = tl.sigmoid(b_g) * (b_x * b_r * b_nw[None, :])  # [BM, NH·BC]
    b_u = tl.sum(tl.reshape(b_p, [BLOCK_M, NH, BLOCK_C]), 1) / NH  # [BM, BC]: the mean over branches
    o_cc = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    tl.store(out + o_m[:, None].to(tl.int64) * stride_o + o_cc[None, :], b_u.to(out.dtype.element_ty),
             mask=m_m[:, None] & (o_cc < D)[None, :])


def dot_k_pieces(r: int, chunk: int = 0) -> tuple[int, int]:
    """The up dot's K split (BLOCK_K1, BLOCK_K2) for the kernel's BLOCK_KC = chunk. chunk 0: two power-of-two
    pieces covering r, each at least 16 (tl.dot's smallest K): 320 -> (256, 64); 24 -> (16, 16), the second
    masked past r. chunk > 0: (the number of chunks, 0)."""
    if chunk:
        return triton.cdiv(r, chunk), 0
    k1 = max(DOT_M, 1 << (r.bit_length() - 1))
    return k1, (max(DOT_M, triton.next_power_of_2(r - k1)) if r > k1 else 0)


def down_dot_block_k(cfg: dict, ksplit: int) -> int:
    """The down dot's K chunk: the config's, at most the split (rounded up to a power of two), at least 16."""
    return max(DOT_M, min(cfg["BLOCK_K"], triton.next_power_of_2(ksplit)))


def check_dot_config(cfg: dict, hc_count: int) -> None:
    """tl.dot needs every tile dimension >= 16: BLOCK_R rows of [W_dn; W_inj], h·BLOCK_C rows of W_up."""
    if cfg["DOWN"] == "dot" and cfg["BLOCK_R"] < DOT_M:
        raise ValueError(f"hc dot down pass: BLOCK_R={cfg['BLOCK_R']} < {DOT_M} (tl.dot's smallest tile); "
                         f"use BLOCK_R >= {DOT_M} or DOWN='rows'")
    if cfg["UP"] == "dot" and cfg["UP_BLOCK_K"] and cfg["UP_BLOCK_K"] < DOT_M:
        raise ValueError(f"hc dot up pass: UP_BLOCK_K={cfg['UP_BLOCK_K']} < {DOT_M}; use 0 (two pieces) or >= {DOT_M}")
    if cfg["UP"] == "dot" and hc_count * cfg["BLOCK_C"] < DOT_M:
        raise ValueError(f"hc dot up pass: hc_count x BLOCK_C = {hc_count * cfg['BLOCK_C']} < {DOT_M}; "
                         f"use BLOCK_C >= {-(-DOT_M // hc_count)} or UP='rows'")
    if cfg["UP"] == "dot" and cfg["FUSED_MIX"]:
        raise ValueError("hc dot up pass reads `a` from the mix launch: use FUSED_MIX=False or UP='rows'")


def launch_down_dot(x, norm_w, w_down, w_inject, partial, sumsq, r, rh, S, ksplit, stride_p, cfg, dot_f32, pdl,
                    combine=None):
    """The down pass (see the module doc); w_inject None -> rows [R, RH) are empty (RH = R). combine: (inject
    [M, h], u [M, d], y [M, h·d]) of the block write applied to x first (hc.py's `hc_combine_read`)."""
    M = x.shape[0]
    has_inj = w_inject is not None
    c_inj, c_u, c_y = combine if combine is not None else (x, x, x)  # unused without COMBINE
    _hc_down_dot_kernel[(triton.cdiv(rh, cfg["BLOCK_R"]), S, triton.cdiv(M, DOT_M))](
        x, norm_w, w_down, w_inject if has_inj else w_down, partial, sumsq, M, r, rh,
        x.stride(0), w_down.stride(0), w_inject.stride(0) if has_inj else 0, stride_p, c_inj, c_u, c_y,
        x.shape[1] // (S // cfg["SPLITS_PER_BRANCH"]), c_inj.stride(0), c_u.stride(0), c_y.stride(0),
        KSPLIT=ksplit, BLOCK_M=DOT_M, BLOCK_R=cfg["BLOCK_R"], BLOCK_K=down_dot_block_k(cfg, ksplit),
        DOT_F32=dot_f32, PDL=pdl, COMBINE=combine is not None, num_warps=cfg["WARPS_DOWN"])


def launch_up_dot(x, norm_w, w_up, mix, rstd, out, h, cfg, dot_f32, pdl):
    """The up pass (see the module doc): reads `a` ([M, r], x.dtype) and rstd ([M, h] fp32) of the mix launch."""
    M, d, r = x.shape[0], out.shape[1], mix.shape[1]
    k1, k2 = dot_k_pieces(r, cfg["UP_BLOCK_K"])
    extra = pdl_launch(pdl)
    _hc_up_dot_kernel[(triton.cdiv(d, cfg["BLOCK_C"]), triton.cdiv(M, DOT_M))](
        x, norm_w, w_up, mix, rstd, out, M, r, d, x.stride(0), w_up.stride(0), out.stride(0),
        NH=h, BLOCK_M=DOT_M, BLOCK_C=cfg["BLOCK_C"], BLOCK_K1=k1, BLOCK_K2=k2, BLOCK_KC=cfg["UP_BLOCK_K"],
        DOT_F32=dot_f32, PDL=pdl,
        num_warps=cfg["WARPS_UP"], **extra)

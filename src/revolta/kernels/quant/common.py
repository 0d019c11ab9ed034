"""Pieces every packed-weight kernel shares: in-register decoders, the tile product, split-K, launch configs.

The tile-path GEMV kernels (`awq.py`, `ct_int4.py`, `nvfp4.py`; the nibble path: gemv_nibble.py) all have one
shape: a program owns BLOCK_N output features and one slice of K (split-K), walks K in BLOCK_K steps, decodes one
packed tile to fp32 in registers, and multiplies it with all BLOCK_M activation rows (`tile_product`), so
every packed byte is read once for the whole batch. Partial sums of the K slices land in an fp32 workspace that
`_splitk_reduce_kernel` adds in slice order, adding the bias and rounding once to the activation dtype; or, with
FIXUP (the word-column and nibble GEMVs), the last K slice of each tile to finish does that add itself
(`splitk_fixup`): each program counts itself in on an int32 counter of its tile (an acquire-release atomic after its
partial stores), the one that completes the count adds the partials in slice order and puts the counter back to 0.
The sum order is the slice order either way, so the output is bitwise the same whichever program finishes last
(reproducible, no floating-point atomics), and one launch per GEMV is saved. The counters are the layer's
(QuantLinear / QuantExperts own a zeroed int32 buffer that every launch leaves at 0), or zeros allocated per call.

sm70 has no fp8 arithmetic and Triton rejects OCP E4M3 there, so fp8 scales are loaded as bytes
and decoded with integer ops (`e4m3_to_f32`); E2M1 codes likewise (`e2m1_to_f32`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.nn import functional as F

from ..pdl import pdl_launch, pdl_start, use_pdl

MAX_GEMV_ROWS = 64  # above this many rows: dequantized tiles + torch matmul (cuBLAS tensor cores)
DOT_MIN_ROWS = 16  # from here on the tile product uses tl.dot (tensor cores on sm80+, FMA on sm70)
# sm80+: tl.dot from 5 rows (MTP4 verify, C8 decode). H200, AWQ g32 at the real shapes (RESULTS.md K6): the FMA
# path took 464-609 µs at M = 8 on the 6-16 MB projections (2% of copy), the dot path 66-154 µs at M = 40
DOT_MIN_ROWS_SM80 = 5
REDUCE_BLOCK = 256  # features per program of the split-K reduce: 1024 gave 8 programs for N = 8192 and 3.5 µs at
# M = 1 on an H100 under Nsight Compute, stalled on its serial loads (benchmarks/RESULTS.md K6b)
DEQUANT_CHUNK_BYTES = 64 << 20  # largest dequantized weight slice the large-M path materialises


MAGIC: tl.constexpr = tl.constexpr(0x4B000000)  # fp32 bits of 2^23: MAGIC | q reads as 2^23 + q (0 <= q < 2^23)


@triton.jit
def nibbles_f32(words, shifts):
    """int32 words [R, W] -> fp32 [R, W * S]: 2^23 + nibble s of each word (at bits `shifts[s]`, [S]).

    The offset form costs one OR instead of an int-to-float conversion (a quarter-rate instruction that would
    bound the decode below the memory bandwidth); differences of two such values are exact small integers."""
    b = (words[:, :, None] >> shifts[None, None, :]) & 15
    return tl.reshape((b | MAGIC).to(tl.float32, bitcast=True), (words.shape[0], words.shape[1] * shifts.shape[0]))


@triton.jit
def e4m3_to_f32(b):
    """OCP float8 E4M3 (fn: bias 7, no infinities) bytes (any int type, values 0..255) -> fp32, exactly.

    0x7F / 0xFF are NaN in E4M3; scales never hold them, and they decode to 480 here."""
    b = b.to(tl.int32)
    e = (b >> 3) & 15
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)  # 2^(e-7) * (1 + m/8)
    sub = m.to(tl.float32) * 0.001953125  # e == 0: m * 2^-9
    mag = tl.where(e == 0, sub, normal)
    return tl.where((b & 128) != 0, -mag, mag)


@triton.jit
def e2m1_to_f32(c):
    """FP4 E2M1 codes (0..15: bit 3 sign, 2 exponent bits, 1 mantissa bit) -> fp32
    (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), exactly."""
    c = c.to(tl.int32)
    e = (c >> 1) & 3
    m = c & 1
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)  # 2^(e-1) * (1 + m/2)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def tile_product(acc, b_x, b_w, W_IS_NK: tl.constexpr, USE_DOT: tl.constexpr):
    """acc [BM, BN] fp32 += b_x [BM, BK] (activation dtype) @ W, where b_w (fp32) is W [BK, BN] or,
    with W_IS_NK, W transposed [BN, BK]. USE_DOT rounds the tile to the activation dtype for tl.dot;
    otherwise the product is an fp32 broadcast-multiply-reduce on the CUDA cores."""
    if USE_DOT:
        if W_IS_NK:
            b_w = tl.trans(b_w)
        if b_x.dtype == tl.float32:  # no tf32 rounding for an fp32 model
            acc = tl.dot(b_x, b_w, acc, input_precision="ieee")
        else:
            acc = tl.dot(b_x, b_w.to(b_x.dtype), acc)
    else:
        b_xf = b_x.to(tl.float32)
        if W_IS_NK:
            acc += tl.sum(b_xf[:, None, :] * b_w[None, :, :], axis=2)
        else:
            acc += tl.sum(b_xf[:, :, None] * b_w[None, :, :], axis=1)
    return acc


@triton.jit
def load_x_tile(x, stride_xm, o_m, o_k, M, K):
    return tl.load(x + o_m[:, None].to(tl.int64) * stride_xm + o_k[None, :],
                   mask=(o_m[:, None] < M) & (o_k[None, :] < K), other=0.0)


@triton.jit
def store_partial(ws, out, bias, acc, o_m, o_n, M, N, stride_om, i_split,
                  SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    """SPLIT_K == 1: out [M, N] = acc (+ bias), rounded once; else ws [SPLIT_K, M, N] fp32 = acc."""
    mask = (o_m[:, None] < M) & (o_n[None, :] < N)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias + o_n, mask=o_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out + o_m[:, None].to(tl.int64) * stride_om + o_n[None, :], acc.to(out.dtype.element_ty), mask=mask)
    else:
        base = ws + i_split.to(tl.int64) * M * N
        tl.store(base + o_m[:, None].to(tl.int64) * N + o_n[None, :], acc, mask=mask)


@triton.jit
def splitk_last(counters, tile, SPLIT_K: tl.constexpr):
    """Whether this program is the last of the SPLIT_K programs that write partials of `tile` (int32 counters[tile],
    0 between launches): every program counts itself in once its partial stores are issued, and the one that finds
    SPLIT_K - 1 before it adds the partials (`splitk_fixup`) and puts the counter back to 0 for the next launch.
    The barrier orders all the program's threads' stores before the counting thread's release; the acquire side of
    the same atomic orders the last program's loads after every other program's release."""
    tl.debug_barrier()
    seen = tl.atomic_add(counters + tile, 1, sem="acq_rel", scope="gpu")
    last = seen == SPLIT_K - 1
    if last:
        tl.atomic_xchg(counters + tile, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def splitk_sum(p, mask, slice_stride, SPLIT_K: tl.constexpr):
    """Σ_s p[s · slice_stride] over fp32 partials at pointers p (any block shape), in slice order from 0.0 (the sums of
    _splitk_reduce_kernel); read from L2 (`.cg`: never a line an earlier load left in this SM's L1)."""
    acc = tl.zeros(p.shape, dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(p + s * slice_stride, mask=mask, other=0.0, cache_modifier=".cg")
    return acc


@triton.jit
def splitk_fixup(ws, out, bias, counters, tile, o_m, o_n, M, N, stride_om, SPLIT_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr):
    """The split-K reduce inside the GEMV: after a program stored its partial of rows o_m x features o_n to ws
    [SPLIT_K, M, N], the last of the tile's SPLIT_K programs (`splitk_last`) writes out [o_m, o_n] = Σ_s ws[s]
    (+ bias), rounded once: `_splitk_reduce_kernel`'s order and arithmetic (bitwise its output), one launch fewer."""
    if splitk_last(counters, tile, SPLIT_K):
        mask = (o_m[:, None] < M) & (o_n[None, :] < N)
        acc = splitk_sum(ws + o_m[:, None].to(tl.int64) * N + o_n[None, :], mask, M * N, SPLIT_K)
        if HAS_BIAS:
            acc += tl.load(bias + o_n, mask=o_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out + o_m[:, None].to(tl.int64) * stride_om + o_n[None, :], acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _splitk_reduce_kernel(ws, bias, out, M, N, stride_om, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    i_m = tl.program_id(0).to(tl.int64)
    o_n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = o_n < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: bitwise reproducible
        acc += tl.load(ws + (s * M + i_m) * N + o_n, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias + o_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + i_m * stride_om + o_n, acc.to(out.dtype.element_ty), mask=mask)


def device_facts(device: torch.device) -> tuple[int, int | None]:
    """(streaming multiprocessors, compute capability as 70 / 90) of `device`; off the GPU (the interpreter)
    a V100's 80 SMs and no architecture."""
    if device.type != "cuda":
        return 80, None
    major, minor = torch.cuda.get_device_capability(device)
    return torch.cuda.get_device_properties(device).multi_processor_count, 10 * major + minor


def gemv_config(M: int, N: int, K: int, k_align: int, num_sms: int, n_align: int = 1, arch: int | None = None) -> dict:
    """Launch config of a packed GEMV / skinny GEMM of M rows (1..MAX_GEMV_ROWS).

    BLOCK_K divides `k_align` (the quantization group, so a K step sees one scale per feature) or
    is a multiple of it (NVFP4's 16); BLOCK_N is a multiple of `n_align` (AWQ packs 8 features per
    word). Tiles keep BM·BK·BN <= 4K fp32 products per 4 warps on the FMA path, and the tl.dot tiles are
    narrower on sm70 (FMA there too), so sm70 builds do not spill (tests/kernels/test_quant_aot.py).
    SPLIT_K divides the K steps so there are about 2 programs per SM. Depends on M only through
    BLOCK_M/USE_DOT; the split of K is a function of (N, K, device) alone.
    """
    use_dot = M >= (DOT_MIN_ROWS_SM80 if arch is not None and arch >= 80 else DOT_MIN_ROWS)
    bm = max(16, triton.next_power_of_2(M)) if use_dot else triton.next_power_of_2(M)
    if use_dot:
        bn, bk = (32, 32) if arch == 70 else (64, 32)
    elif bm <= 2:
        bn, bk = (128 // bm, 32)
    elif bm <= 4:
        bn, bk = (32, 32)
    else:
        bn, bk = (32, 16)
    bn = max(bn, n_align)
    assert k_align % bk == 0 or bk % k_align == 0, (k_align, bk)
    bn = min(bn, max(n_align, triton.next_power_of_2(N)))
    steps = triton.cdiv(K, bk)
    tiles = triton.cdiv(N, bn)
    split = 1
    while split < 16 and tiles * split * 2 <= 2 * num_sms and steps // (split * 2) >= 4:
        split *= 2
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, USE_DOT=use_dot,
                k_per_split=triton.cdiv(steps, split) * bk, num_warps=4, num_stages=2 if use_dot else 3)


SPLITK_FIXUP_ENV = "REVOLTA_SPLITK_FIXUP"  # "1": the default GEMV / MoE configs take FIXUP (opt-in until timed)


def fixup_default() -> bool:
    """Whether the default configs of the word-column and nibble GEMVs and of the word-column MoE reduce their K
    slices inside the kernel (FIXUP): off unless the environment sets REVOLTA_SPLITK_FIXUP=1, until a GPU run times
    it against the reduce launches (benchmarks/RESULTS.md K5l); read at each config choice, so one process can
    time both."""
    return os.environ.get(SPLITK_FIXUP_ENV, "0") == "1"


def splitk_counters(tiles: int, device: torch.device, counters: Tensor | None = None) -> Tensor:
    """int32 counters for `tiles` fused split-K tiles (`splitk_fixup`): `counters` (a caller's buffer, zero between
    launches: each launch leaves its counters at 0) when it is large enough, else fresh zeros (one memset)."""
    if counters is not None and counters.numel() >= tiles:
        assert counters.dtype == torch.int32 and counters.device == device, (counters.dtype, counters.device)
        return counters
    return torch.zeros(tiles, dtype=torch.int32, device=device)


def launch_gemv(kernel, x: Tensor, N: int, bias: Tensor | None, cfg: dict, *args,
                counters: Tensor | None = None, **constexprs) -> Tensor:
    """Run a packed GEMV `kernel(x, *args, ws, out, bias, M, N, K, stride_xm, stride_om, k_per_split, ...)` over
    x [M, K] and return out [M, N] in x.dtype (split-K partials reduced in order when SPLIT_K > 1: by
    `_splitk_reduce_kernel`, or with cfg["FIXUP"] (kernels that take `counters` and FIXUP) by the last program of each
    tile, `splitk_fixup`, over `counters` (splitk_counters)). cfg["PDL"] (kernels that take PDL; pdl.use_pdl decides
    for x's device): the GEMV and its reduce launched with programmatic dependent launch, each waiting inside for the
    grid before it (kernels/pdl.py); the output does not change."""
    M, K = x.shape
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    split = cfg["SPLIT_K"]
    ws = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 else out
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), split, triton.cdiv(M, cfg["BLOCK_M"]))
    fixup = split > 1 and cfg.get("FIXUP", False)
    if fixup:
        constexprs.update(counters=splitk_counters(grid[0] * grid[2], x.device, counters), FIXUP=True)
    pdl = use_pdl(x, cfg.get("PDL", False))
    if pdl:
        assert "PDL" in kernel.arg_names, f"{kernel.fn.__name__} has no PDL chain: leave cfg['PDL'] out for it"
        constexprs.update(PDL=True)
    kernel[grid](x, *args, ws, out, bias if bias is not None else out, M, N, K, x.stride(0), out.stride(0),
                 cfg["k_per_split"], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                 SPLIT_K=split, USE_DOT=cfg["USE_DOT"], HAS_BIAS=bias is not None, num_warps=cfg["num_warps"],
                 num_stages=cfg["num_stages"], **pdl_launch(pdl), **constexprs)
    if split > 1 and not fixup:
        _splitk_reduce_kernel[(M, triton.cdiv(N, REDUCE_BLOCK))](ws, bias if bias is not None else ws, out, M, N,
                                                                out.stride(0), SPLIT_K=split,
                                                                HAS_BIAS=bias is not None, BLOCK=REDUCE_BLOCK,
                                                                PDL=pdl, num_warps=2, **pdl_launch(pdl))
    return out


def dequant_matmul(x: Tensor, N: int, dequant_rows, bias: Tensor | None = None,
                   chunk_bytes: int = DEQUANT_CHUNK_BYTES) -> Tensor:
    """The large-M path: x [M, K] @ W.T with W [N, K] dequantized `rows` at a time to x.dtype by
    `dequant_rows(n0, n1) -> [n1 - n0, K]`, each slice multiplied by torch (cuBLAS: tensor cores on
    sm70 too). At most `chunk_bytes` of dequantized weight exist at once."""
    M, K = x.shape
    rows = max(64, chunk_bytes // max(1, K * x.element_size()) // 64 * 64)
    if rows >= N:
        return F.linear(x, dequant_rows(0, N), bias)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    for n0 in range(0, N, rows):
        n1 = min(N, n0 + rows)
        out[:, n0:n1] = F.linear(x, dequant_rows(n0, n1), None if bias is None else bias[n0:n1])
    return out

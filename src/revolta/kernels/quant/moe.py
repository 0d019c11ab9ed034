"""Expert-grouped MoE over packed experts (AWQ int4, compressed-tensors int4, NVFP4) for small M.

`quant_fused_moe(x, gate_up, down, topk_ids, topk_weights, shared_expert=None)` is moe.fused_moe for routed
experts stored packed (`PackedWeights`: one packed linear per expert, stacked along a leading [E] axis);
`quant_fused_moe_ref` is its torch reference (each touched expert dequantized to x.dtype, then the
arithmetic of `moe.fused_moe_ref`).

Small M (M·k <= GROUPED_MAX_PAIRS (token, slot) pairs: decode, speculative verification) runs the pipeline of
moe_grouped.py with its grouping (`moe_group`) and its program layout: one program per (touched expert, N tile)
loops over every row that chose the expert, so each touched expert's packed bytes are read once per call. Three
decode paths (`quant_grouped_config` picks; config keys WORDCOL, NIBBLE_DOT): up to 40 tokens of AWQ experts in
16-bit activations on sm80+ take the word-column walk of moe_wordcol.py (`use_moe_wordcol`: a program row per
(token, slot) pair, so an expert several tokens chose is read once per token, and still 1.4-2.1x faster than the
grouped kernels up to 40 tokens on an H100, RESULTS.md K5h); otherwise the group-factored
path of moe_decode.py (the sm80+ default: raw codes dotted per quantization group, scales applied after the dot,
split-K), and the tile path below (sm70, and the sm80+ default before it). Tile path: the packed tile is loaded and
decoded to fp32 in registers right after the load
(`_weight_tile`: the formats' own tile decoders `_awq_tile` / `_ct_tile` / `_nvfp4_tile`), rounded to x.dtype
for tl.dot (what the reference's dequantized weight holds), or kept fp32 for the FMA tiles. No host sync,
shapes fixed by M·k and E: it captures in a CUDA graph. The shared expert rides as expert E when its three
linears are packed in the same format and group (`shared_expert` = (gate, up, down) PackedWeights of one
linear each, [I, H], [I, H], [H, I]): routed gate_up is one [2I, H] linear per expert (up rows at I), the
shared gate and up are two [I, H] linears, so a program picks its base pointers, up-row offset and row count
N once (scalars) and the tile decoders do the rest.

Large M (prefill) dequantizes each touched expert with the formats' Triton dequantizers and multiplies with
torch (cuBLAS); it syncs once on the touched ids, like every eager prefill path.

Bytes at the real shapes (H 2560, I 640, AWQ group 32; per expert gate_up 1.64 MB codes + 0.26 MB scales and
zeros, down 0.82 + 0.13 MB: 2.85 MB, 3.45x fewer than bf16): M = 1 touches 11 experts, 31 MB, 7.4 µs at
4.2 TB/s. The tile path's decode is ~5 operations per weight (shift, mask, OR with 2^23's bits, subtract the zero,
multiply by the scale; no int-to-float conversion), 11-14 SASS instructions per weight in its sm_90 inner loop with
the layout conversions, which is why BLOCK_K spans several groups there: the zeros and scales of a tile are
loaded once per group row, not per weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from ..moe import GROUPED_MAX_PAIRS, SUM_BLOCK, _arch, moe_sum
from ..moe_grouped import _mac, _pairs, _program, expected_distinct, moe_group
from ..pdl import pdl_launch, use_pdl
from . import awq, ct_int4, nvfp4
from .moe_decode import _down_operands, _gate_up_operands, _nibble_down_kernel, _nibble_gate_up_kernel
from .moe_decode import _split_act_kernel
from .moe_wordcol import _wordcol_down_kernel, _wordcol_gate_up_kernel
from .common import REDUCE_BLOCK, fixup_default, splitk_counters
from .nibble import LAYOUTS, nibble_block_k, nibble_min_rows, split_len


@dataclass(frozen=True)
class PackedWeights:
    """A packed linear of N outputs and K inputs as the kernels read it, or E of them stacked ([E, ...]).

    tensors: awq (qweight [K, N/8], qzeros [K/G, N/8], scales fp16 [K/G, N]);
             ct_int4 (weight_packed [N, K/8], weight_scale [N, K/G], weight_zero_point [N/8, K/G] or None);
             nvfp4 (codes uint8 [N, K/2], E4M3 scales as uint8 [N, K/16], global scales fp32 [S] (S row shards)).
    group: inputs per scale (16 for NVFP4); inverted: the NVFP4 global scale divides (compressed-tensors).
    counters: int32, zero between launches: the fused split-K reduces' counters of the kernels that read these
    weights (`common.splitk_counters`; a launch that needs more, or finds None, allocates zeros of its own).
    """

    layout: str
    tensors: tuple[Tensor, Tensor, Tensor | None]
    group: int
    inverted: bool = False
    counters: Tensor | None = None

    @property
    def nk(self) -> tuple[int, int]:
        """(N, K) of one linear."""
        t = self.tensors[0]
        if self.layout == "awq":
            return t.shape[-1] * awq.PACK, t.shape[-2]
        return t.shape[-2], t.shape[-1] * (ct_int4.PACK if self.layout == "ct_int4" else 2)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors if t is not None)

    def expert(self, e: int) -> PackedWeights:
        return PackedWeights(self.layout, tuple(t if t is None else t[e] for t in self.tensors), self.group,
                             self.inverted)


def dequantize_ref(p: PackedWeights, dtype: torch.dtype) -> Tensor:
    """W [N, K] in `dtype` of one packed linear (the formats' torch references)."""
    a, b, c = p.tensors
    if p.layout == "awq":
        return awq.awq_dequantize_ref(a, b, c, p.group, dtype)
    if p.layout == "ct_int4":
        return ct_int4.ct_int4_dequantize_ref(a, b, c, p.group, dtype)
    return nvfp4.nvfp4_dequantize_ref(a, b, c.reshape(-1), p.inverted, dtype)


def dequantize(p: PackedWeights, dtype: torch.dtype) -> Tensor:
    """Triton version of `dequantize_ref`."""
    a, b, c = p.tensors
    if p.layout == "awq":
        return awq.awq_dequantize(a, b, c, p.group, dtype)
    if p.layout == "ct_int4":
        return ct_int4.ct_int4_dequantize(a, b, c, p.group, dtype)
    return nvfp4.nvfp4_dequantize(a, b, c.reshape(-1), p.inverted, dtype)


def quant_fused_moe_ref(x: Tensor, gate_up: PackedWeights, down: PackedWeights, topk_ids: Tensor,
                        topk_weights: Tensor, shared_expert: tuple[PackedWeights, ...] | None = None) -> Tensor:
    """Σ_k w_k · down_e(SiLU(gate_e x) ⊙ up_e x) -> [M, H] in x.dtype, the arithmetic of `moe.fused_moe_ref`
    with each touched expert dequantized to x.dtype. x [M, H]; gate_up: E packed [2I, H] linears (gate rows
    first); down: E packed [H, I]; topk_ids / topk_weights [M, k]; shared_expert: expert number E."""
    return _expert_loop(x, gate_up, down, topk_ids, topk_weights, shared_expert, dequantize_ref)


def _expert_loop(x, gate_up, down, topk_ids, topk_weights, shared_expert, deq) -> Tensor:
    E, I = gate_up.tensors[0].shape[0], down.nk[1]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():  # the one host sync
        token_idx, slot = torch.nonzero(ids == e, as_tuple=True)
        xe = x[token_idx]  # [n, H]
        if shared_expert is not None and e == E:
            sg, su, sd = shared_expert
            gate, up = xe @ deq(sg, x.dtype).t(), xe @ deq(su, x.dtype).t()
            w_down = deq(sd, x.dtype)
        else:
            gate, up = (xe @ deq(gate_up.expert(e), x.dtype).t()).split(I, dim=-1)
            w_down = deq(down.expert(e), x.dtype)
        ye = (F.silu(gate) * up) @ w_down.t()  # [n, H]
        out.index_add_(0, token_idx, ye.float() * topk_weights[token_idx, slot, None].float())
    return out.to(x.dtype)


# ----------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _weight_tile(w0, w1, w2, n, k, N, K, rows_per_shard, FMT: tl.constexpr, G: tl.constexpr, HAS_ZP: tl.constexpr,
                 INVERTED: tl.constexpr, R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Decoded fp32 tile [R, BLOCK_K] of one packed linear W [N, K] (base pointers w0..w2): rows n.., inputs k.."""
    if FMT == 0:
        b_w = tl.trans(awq._awq_tile(w0, w1, w2, k, n, N, K, G, BLOCK_K, R))
    elif FMT == 1:
        b_w = ct_int4._ct_tile(w0, w1, w2, n, k, N, K, G, R, BLOCK_K, HAS_ZP)
    else:
        b_w = nvfp4._nvfp4_tile(w0, w1, w2, n, k, N, K, rows_per_shard, INVERTED, R, BLOCK_K)
    return b_w


@triton.jit
def _packed_rows_matmul(a_rows, m_a, g0, g1, g2, n_g, u0, u1, u2, n_u, N, K, rows_per_shard,
                        FMT: tl.constexpr, G: tl.constexpr, HAS_ZP: tl.constexpr, INVERTED: tl.constexpr,
                        R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
                        TWO: tl.constexpr):
    """(Wg[n_g.., :K] · A[BLOCK_M, :K]ᵀ, Wu[n_u.., :K] · Aᵀ), each [R, BLOCK_M] fp32 (the second only when
    TWO): moe_grouped._rows_matmul with packed weight tiles. a_rows [BLOCK_M]: row pointers; m_a: row mask."""
    if USE_DOT:
        acc = tl.zeros([R, BLOCK_M], dtype=tl.float32)
    elif BLOCK_M == 1:
        acc = tl.zeros([R, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([R, BLOCK_M], dtype=tl.float32)
    acc2 = tl.zeros_like(acc)
    for k0 in range(0, K, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < K
        if USE_DOT:
            b_a = tl.load(a_rows[None, :] + o_k[:, None], mask=m_a[None, :] & m_k[:, None], other=0.0)  # [BK, BM]
        else:
            b_a = tl.load(a_rows[:, None] + o_k[None, :], mask=m_a[:, None] & m_k[None, :], other=0.0)  # [BM, BK]
        b_w = _weight_tile(g0, g1, g2, n_g, k0, N, K, rows_per_shard, FMT, G, HAS_ZP, INVERTED, R, BLOCK_K)
        if USE_DOT:  # the weight as the reference holds it (x.dtype); fp32 models stay fp32
            b_w = b_w.to(b_a.dtype)
        acc = _mac(acc, b_w, b_a, BLOCK_M, USE_DOT)
        if TWO:
            b_w = _weight_tile(u0, u1, u2, n_u, k0, N, K, rows_per_shard, FMT, G, HAS_ZP, INVERTED, R, BLOCK_K)
            if USE_DOT:
                b_w = b_w.to(b_a.dtype)
            acc2 = _mac(acc2, b_w, b_a, BLOCK_M, USE_DOT)
    if USE_DOT:
        pass
    elif BLOCK_M == 1:
        acc = tl.sum(acc, 1, keep_dims=True)
        acc2 = tl.sum(acc2, 1, keep_dims=True)
    return acc, acc2


@triton.jit
def _quant_gate_up_kernel(x, w0, w1, w2, sg0, sg1, sg2, su0, su1, su2, act, topk_ids, order, slot_expert, slot_start,
                          slot_end, num_routed, H, I, stride_xm, stride_e0, stride_e1, stride_e2, stride_am,
                          FMT: tl.constexpr, G: tl.constexpr, HAS_ZP: tl.constexpr, INVERTED: tl.constexpr,
                          TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          USE_DOT: tl.constexpr, HAS_SHARED: tl.constexpr, SORTED: tl.constexpr):
    i_n, i_e, start, end = _program(topk_ids, slot_expert, slot_start, slot_end, SORTED)
    if i_e < 0:
        return
    g0, g1, g2, n_g, u0, u1, u2, n_u, N = _gate_up_operands(w0, w1, w2, sg0, sg1, sg2, su0, su1, su2, i_e, i_n,
                                                            num_routed, I, stride_e0, stride_e1, stride_e2, BLOCK_N,
                                                            HAS_SHARED)
    o_n = n_g + tl.arange(0, BLOCK_N)
    m_n = o_n < I
    for m0 in range(start, end, BLOCK_M):
        b_pair, m_p = _pairs(order, m0, end, BLOCK_M, SORTED)
        a_rows = x + (b_pair // TOP_K) * stride_xm
        b_g, b_u = _packed_rows_matmul(a_rows, m_p, g0, g1, g2, n_g, u0, u1, u2, n_u, N, H, I, FMT, G, HAS_ZP,
                                       INVERTED, BLOCK_N, BLOCK_M, BLOCK_K, USE_DOT, True)  # [BN, BM] each
        b_a = b_g * tl.sigmoid(b_g) * b_u
        p_a = act + b_pair[None, :] * stride_am + o_n[:, None]
        tl.store(p_a, b_a.to(act.dtype.element_ty), mask=m_n[:, None] & m_p[None, :])


@triton.jit
def _quant_down_kernel(act, w0, w1, w2, sd0, sd1, sd2, topk_weights, y, topk_ids, order, slot_expert, slot_start,
                       slot_end, num_routed, H, I, stride_am, stride_e0, stride_e1, stride_e2, stride_ym,
                       FMT: tl.constexpr, G: tl.constexpr, HAS_ZP: tl.constexpr, INVERTED: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       USE_DOT: tl.constexpr, HAS_SHARED: tl.constexpr, SORTED: tl.constexpr):
    i_n, i_e, start, end = _program(topk_ids, slot_expert, slot_start, slot_end, SORTED)
    if i_e < 0:
        return
    d0, d1, d2 = _down_operands(w0, w1, w2, sd0, sd1, sd2, i_e, num_routed, stride_e0, stride_e1, stride_e2,
                                HAS_SHARED)
    n = i_n * BLOCK_N
    o_n = n + tl.arange(0, BLOCK_N)
    m_n = o_n < H
    for m0 in range(start, end, BLOCK_M):
        b_pair, m_p = _pairs(order, m0, end, BLOCK_M, SORTED)
        acc, _ = _packed_rows_matmul(act + b_pair * stride_am, m_p, d0, d1, d2, n, d0, d1, d2, n, H, I, H, FMT, G,
                                     HAS_ZP, INVERTED, BLOCK_N, BLOCK_M, BLOCK_K, USE_DOT, False)  # [BN, BM]
        b_rw = tl.load(topk_weights + b_pair, mask=m_p, other=0.0).to(tl.float32)
        p_y = y + b_pair[None, :] * stride_ym + o_n[:, None]
        tl.store(p_y, acc * b_rw[None, :], mask=m_n[:, None] & m_p[None, :])


# ----------------------------------------------------------------------------------------------
# launch


# the fp32 walk (one bf16 token's default until K5l) of AWQ experts on sm80+ (use_moe_wordcol): single-warp programs
# of 256 features, 8-row steps, gate_up in 64 K slices and down in 16. H200, bf16 (RESULTS.md K5g): 42.4 us at the
# real shapes against the nibble path's 47.9 and the same walk in 32-row steps' 47.6 (H100, K5f: 44.2 against 47.3)
MOE_WORDCOL = dict(WORDCOL=True, NIBBLE_DOT=False, BLOCK_M=1, USE_DOT=False, BLOCK_N_UP=256, BLOCK_N_DOWN=256,
                   SPLIT_UP=64, SPLIT_DOWN=16, ROWS=8, PREFETCH=False, HALF2=False, num_warps=1, num_stages=1)
# the word-column walk's defaults (RESULTS.md K5h, H100; K5g for one bf16 token), by (one token or several, dtype):
# one fp16 token on fp16 pairs in 16-row steps (36.2 against 42.8 µs), several tokens a program row per pair in
# 16-row steps and 16 / 4 K slices (fp16 pairs: 76 / 109 / 405 µs at M = 5 / 8 / 40 against the nibble path's
# 153 / 226 / 840; bf16, the fp32 walk: 102 / 143 / 590 against 153 / 226 / 836)
MOE_WORDCOL_HALF2 = MOE_WORDCOL | dict(SPLIT_UP=32, SPLIT_DOWN=8, ROWS=16, HALF2=True)
# the launches of one token's walk chained by programmatic dependent launch (sm_90) and its split-act / slot-sum
# launches on 64-feature programs (110 / 40 programs instead of 33 / 10): on an H100 (RESULTS.md K5n) one fp16 token
# 33.3-33.9 µs with either against 36.3
MOE_WORDCOL_CHAIN = dict(PDL=True, ACT_BLOCK=64, SUM_BLOCK=64)
# one bf16 token on fp16 pairs (each step's x scaled into fp16 by a power of two), gate and up in one walk (JOINT:
# one step scale for both), chained: H100 (K5n) 32.4 µs against 39.1 with the reduces inside the kernels (K5l's)
MOE_WORDCOL_BF16_PAIRS = MOE_WORDCOL_HALF2 | dict(JOINT=True) | MOE_WORDCOL_CHAIN
MOE_WORDCOL_PAIRS = MOE_WORDCOL | dict(SPLIT_UP=16, SPLIT_DOWN=4, ROWS=16)
# several fp16 tokens on fp16 pairs (the fp32 walk, MOE_WORDCOL_PAIRS, stays a variant; JOINT, which needs about
# twice the registers, was 4-17% slower here at 8 / 40 tokens: K5n)
MOE_WORDCOL_PAIRS_HALF2 = MOE_WORDCOL_PAIRS | dict(HALF2=True)
# several bf16 tokens on fp16 pairs in 32-row steps (half the step scales), gate and up in one walk, chained: H100
# (K5n) 108.2 / 423.8 µs at M = 8 / 40 against 16-row steps' 122.9 / 434.2 (K5m: the fp32 walk 142.6 / 584.7)
MOE_WORDCOL_BF16_PAIRS_ROWS = MOE_WORDCOL_PAIRS_HALF2 | dict(JOINT=True, ROWS=32) | MOE_WORDCOL_CHAIN
MOE_WORDCOL_MAX_TOKENS = 40  # the per-pair walk reads an expert once per token that chose it: timed up to 40 tokens
# (1.6x the distinct experts' bytes there, still 2.1x faster than the grouped nibble path)


def use_moe_wordcol(arch: int | None, dtype: torch.dtype, layout: str, M: int) -> bool:
    """Whether M tokens' packed MoE takes the word-column walk by default: 1 <= M <= MOE_WORDCOL_MAX_TOKENS, AWQ
    experts (packed along N), 16-bit activations, sm80+ (None: the interpreter keeps the nibble path, as the dense
    GEMV's use_wordcol does)."""
    return (1 <= M <= MOE_WORDCOL_MAX_TOKENS and layout == "awq" and arch is not None and arch >= 80
            and dtype in (torch.float16, torch.bfloat16))


def moe_wordcol_config(M: int, dtype: torch.dtype) -> dict:
    """The word-column config M tokens of `dtype` take by default (a copy: callers may edit it)."""
    half2 = dtype == torch.float16
    fixup = dict(FIXUP=True) if fixup_default() else {}  # the reduces inside the kernels (opt-in: RESULTS.md K5l)
    if M == 1:
        return (MOE_WORDCOL_HALF2 | MOE_WORDCOL_CHAIN if half2 else dict(MOE_WORDCOL_BF16_PAIRS)) | fixup
    return dict(MOE_WORDCOL_PAIRS_HALF2 if half2 else MOE_WORDCOL_BF16_PAIRS_ROWS) | fixup


def quant_grouped_config(M: int, top_k: int, num_experts: int, arch: int | None = None,
                         nibble: bool | None = None, layout: str = "awq", dtype: torch.dtype | None = None) -> dict:
    """Launch config of the packed grouped kernels (the benchmark times variants beside it).

    Tile path (nibble=False), sm80+: moe_grouped's tl.dot tiles (16 rows, 2 x 32 gate + up rows, 64 down rows,
    128 inputs per K step: 4 groups of 32 per decoded tile). sm70: broadcast-FMA tiles with BLOCK_M from the
    expected rows per touched expert, narrower than moe_grouped's because the decoded tile is held in fp32
    beside the accumulator (no spills in the sm_70 build, tests/kernels/test_quant_moe_aot.py).
    nibble (default: sm80+ and the interpreter): the group-factored decode path (moe_decode.py), 2 x 64 gate + up
    rows and 128 down rows per program, one group (32) per K step, 3 stages (4 on sm90 until the H100 run of
    RESULTS.md K5e: 3 was 1-5% faster at M = 1 / 8 / 40); gate_up in 4 K splits and down in 2 at every M (at M = 8
    and 40 first without: on an H100, bf16, RESULTS.md K5f, the splits took 230 / 835 µs against 254 / 914). Its
    sm_90 inner loop is 5.4-6.1 SASS instructions per weight against the tile path's 11.2-14.5
    (benchmarks/quant_moe_instructions.py); on the H200 (RESULTS.md K5c, bf16) it took 49.6 / 238 / 886 µs at M = 1 /
    8 / 40 against the tile path's 71.2 / 416 / 1585, and these 64 / 128-row tiles beat 128 / 256 (57.2 / 250 / 1033)
    at every M. On sm70 tl.dot is FMA over 16 padded rows (36-68 PTX instructions per weight in narrow tiles that do
    not spill), so sm70 keeps the tile path.
    NVFP4 (`layout`) keeps the tile path on a GPU: compiled, the nibble path's 16-row NVFP4 tiles summed wrong
    (relative error ~3 at M = 1 / 8 / 40 on an H100) while the tile path matched; a nibble config asked for NVFP4
    gets `nibble_min_rows` (64) rows, which matched too (rows past M are masked).
    WORDCOL (up to MOE_WORDCOL_MAX_TOKENS tokens of AWQ experts, `use_moe_wordcol`, when `dtype` is given and nibble
    is None): the word-column walk on CUDA cores (moe_wordcol.py), `moe_wordcol_config`: MOE_WORDCOL's keys
    BLOCK_N_UP / BLOCK_N_DOWN (256 a warp), SPLIT_UP / SPLIT_DOWN, ROWS, PREFETCH, HALF2 (fp16 pairs), and optional
    JOINT (gate and up in one walk), PDL (the launches chained, sm_90), ACT_BLOCK / SUM_BLOCK (features a program of
    the split-act / slot-sum launches), FIXUP, EXPERT_ORDER (moe_wordcol.py).
    """
    if nibble is None and dtype is not None and use_moe_wordcol(arch, dtype, layout, M):
        return moe_wordcol_config(M, dtype)
    if nibble is None:
        nibble = (arch is None or arch >= 80) and nibble_min_rows(layout, arch) == 16  # NVFP4 on a GPU: tiles
    if nibble:
        wide = arch is None or arch >= 80
        return dict(BLOCK_M=nibble_min_rows(layout, arch), BLOCK_N_UP=64 if wide else 16, BLOCK_K_UP=32,
                    BLOCK_N_DOWN=128 if wide else 32,
                    BLOCK_K_DOWN=32, USE_DOT=True, num_warps=4, num_stages=3, NIBBLE_DOT=True,
                    SPLIT_UP=4, SPLIT_DOWN=2,
                    SCALE_AHEAD=False)  # timed 1.13-1.24x slower here (RESULTS.md K5e: +25-30% registers)
    if arch is None or arch >= 80:
        return dict(BLOCK_M=16, BLOCK_N_UP=32, BLOCK_K_UP=128, BLOCK_N_DOWN=64, BLOCK_K_DOWN=128, USE_DOT=True,
                    num_warps=4, num_stages=4 if arch is not None and arch >= 90 else 3)
    rho = M * top_k / max(1.0, expected_distinct(M, top_k, num_experts))
    bm = 1 if M == 1 else min(8, triton.next_power_of_2(int(rho + 0.999)))
    (bn_up, bk_up), (bn_dn, bk_dn) = {1: ((16, 128), (32, 128)), 2: ((16, 64), (32, 64)),
                                      4: ((16, 32), (32, 32)), 8: ((8, 32), (16, 32))}[bm]
    return dict(BLOCK_M=bm, BLOCK_N_UP=bn_up, BLOCK_K_UP=bk_up, BLOCK_N_DOWN=bn_dn, BLOCK_K_DOWN=bk_dn,
                USE_DOT=False, num_warps=4, num_stages=2)


def fit_block_k(block_k: int, group: int) -> int:
    """The largest BLOCK_K <= block_k that one tile decoder can take: a divisor or a multiple of the group."""
    while group % block_k and block_k % group:
        block_k //= 2
    return block_k


def _kernel_args(p: PackedWeights) -> tuple[list[Tensor], dict]:
    """(the three tensors as the kernels take them, format constexprs)."""
    a, b, c = p.tensors
    if p.layout == "nvfp4":
        b = b.view(torch.uint8)
    has_zp = c is not None
    return [a, b, c if has_zp else a], dict(FMT=LAYOUTS.index(p.layout), G=p.group, HAS_ZP=has_zp, INVERTED=p.inverted)


def _check(x, gate_up, down, topk_ids, topk_weights, shared_expert) -> tuple[int, int, int, int]:
    assert x.dim() == 2 and x.stride(-1) == 1, (x.shape, x.stride())
    M, H = x.shape
    assert gate_up.layout in LAYOUTS and down.layout == gate_up.layout and down.inverted == gate_up.inverted, (
        gate_up.layout, down.layout)
    E = gate_up.tensors[0].shape[0]
    (two_i, h1), (h2, I) = gate_up.nk, down.nk
    assert two_i == 2 * I and h1 == h2 == H and down.tensors[0].shape[0] == E, (gate_up.nk, down.nk, H, E)
    assert all(t is None or t.is_contiguous() for p in (gate_up, down) for t in p.tensors)
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == M, (topk_ids.shape, topk_weights.shape)
    assert topk_ids.dtype in (torch.int32, torch.int64) and topk_weights.dtype == torch.float32
    if shared_expert is not None:
        ok = (len(shared_expert) == 3 and [p.nk for p in shared_expert] == [(I, H), (I, H), (H, I)]
              and all(p.layout == gate_up.layout and p.group == routed.group and p.inverted == gate_up.inverted
                      and (p.tensors[2] is None) == (routed.tensors[2] is None)
                      and all(t is None or t.is_contiguous() for t in p.tensors)
                      for p, routed in zip(shared_expert, (gate_up, gate_up, down))))
        assert ok, ("shared_expert must be (gate [I, H], up [I, H], down [H, I]) packed like the routed experts; got "
                    f"{[(p.layout, p.nk, p.group) for p in shared_expert]}; a shared expert stored otherwise runs as "
                    "its own SwiGLU")
    return M, H, E, I


def quant_fused_moe(x: Tensor, gate_up: PackedWeights, down: PackedWeights, topk_ids: Tensor, topk_weights: Tensor,
                    shared_expert: tuple[PackedWeights, PackedWeights, PackedWeights] | None = None,
                    config: dict | None = None) -> Tensor:
    """Triton version of `quant_fused_moe_ref` (paths: module docstring). `config` forces the grouped kernels."""
    M, H, E, I = _check(x, gate_up, down, topk_ids, topk_weights, shared_expert)
    k = topk_ids.shape[1]
    out = torch.empty(M, H, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    if config is None and M * k > GROUPED_MAX_PAIRS:
        return _expert_loop(x, gate_up, down, topk_ids, topk_weights, shared_expert, dequantize)
    cfg = config or quant_grouped_config(M, k, E + (shared_expert is not None), _arch(x.device),
                                         layout=gate_up.layout, dtype=x.dtype)
    y = _grouped_expert_mlp(x, gate_up, down, topk_ids, topk_weights, shared_expert, cfg, out)
    if y is out:  # the word-column down kernel summed the slots itself (FIXUP)
        return out
    # y [M·k·SPLIT_DOWN, H]; the word-column path's chain may end in a PDL launch (its PDL key) and set the block
    return moe_sum(y, out, y.shape[0] // M, cfg.get("SUM_BLOCK", SUM_BLOCK), use_pdl(x, cfg.get("PDL", False)))


def _grouped_expert_mlp(x, gate_up, down, topk_ids, topk_weights, shared_expert, cfg, out=None) -> Tensor:
    """Per pair w_pair · down_e(SiLU(gate_e x) ⊙ up_e x) in fp32: y [M·k, H] (row token·k + slot); or `out` [M, H]
    itself, its slots summed, where the word-column path's FIXUP did that inside its down kernel."""
    M, H = x.shape
    E, I = gate_up.tensors[0].shape[0], down.nk[1]
    k = topk_ids.shape[1]
    T = M * k
    assert not cfg["USE_DOT"] or cfg["BLOCK_M"] >= 16, f"tl.dot needs BLOCK_M >= 16, got {cfg}"
    ids = topk_ids.contiguous()
    num_slots = min(T, E + (shared_expert is not None))
    wordcol = cfg.get("WORDCOL", False)  # a program row per pair: no grouping
    sort = M > 1 and not wordcol  # one row: every pair is a distinct expert already
    if sort:
        order, slot_expert, slot_start, slot_end = moe_group(ids, num_slots)
    else:
        order = slot_expert = slot_start = slot_end = ids
    w_up, fmt_up = _kernel_args(gate_up)
    w_dn, fmt_dn = _kernel_args(down)
    if shared_expert is not None:
        s_gate, s_up, s_down = (_kernel_args(p)[0] for p in shared_expert)
    else:
        s_gate = s_up = w_up
        s_down = w_dn
    act = torch.empty(T, I, dtype=x.dtype, device=x.device)
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if wordcol:
        return _wordcol_expert_mlp(x, gate_up, down, w_up, w_dn, s_gate, s_up, s_down, act, ids, topk_weights,
                                   shared_expert is not None, cfg, out)
    if cfg.get("NIBBLE_DOT", False):
        slots = (ids, order, slot_expert, slot_start, slot_end)
        return _nibble_expert_mlp(x, gate_up, down, w_up, w_dn, fmt_up, fmt_dn, s_gate, s_up, s_down, act, slots,
                                  topk_weights, num_slots, shared_expert is not None, sort, cfg, launch)
    y = torch.empty(T, H, dtype=torch.float32, device=x.device)
    flags = dict(BLOCK_M=cfg["BLOCK_M"], USE_DOT=cfg["USE_DOT"], HAS_SHARED=shared_expert is not None, SORTED=sort)
    _quant_gate_up_kernel[(num_slots, triton.cdiv(I, cfg["BLOCK_N_UP"]))](
        x, *w_up, *s_gate, *s_up, act, ids, order, slot_expert, slot_start, slot_end,
        E, H, I, x.stride(0), *(t.stride(0) for t in w_up), act.stride(0),
        TOP_K=k, BLOCK_N=cfg["BLOCK_N_UP"], BLOCK_K=fit_block_k(cfg["BLOCK_K_UP"], gate_up.group), **fmt_up,
        **flags, **launch)
    _quant_down_kernel[(num_slots, triton.cdiv(H, cfg["BLOCK_N_DOWN"]))](
        act, *w_dn, *s_down, topk_weights.contiguous(), y, ids, order, slot_expert, slot_start, slot_end,
        E, H, I, act.stride(0), *(t.stride(0) for t in w_dn), y.stride(0),
        BLOCK_N=cfg["BLOCK_N_DOWN"], BLOCK_K=fit_block_k(cfg["BLOCK_K_DOWN"], down.group), **fmt_dn, **flags, **launch)
    return y


def _nibble_expert_mlp(x, gate_up, down, w_up, w_dn, fmt_up, fmt_dn, s_gate, s_up, s_down, act, slots, topk_weights,
                       num_slots, has_shared, sort, cfg, launch) -> Tensor:
    """`_grouped_expert_mlp` on the group-factored decode path (moe_decode.py): y [M·k·SPLIT_DOWN, H] fp32."""
    M, H = x.shape
    k = slots[0].shape[1]
    T, I = M * k, act.shape[1]
    assert cfg["USE_DOT"] and cfg["BLOCK_M"] >= 16, f"the nibble path is tl.dot only (BLOCK_M >= 16), got {cfg}"
    split_up, split_dn = cfg.get("SPLIT_UP", 1), cfg.get("SPLIT_DOWN", 1)
    bk_up = nibble_block_k(cfg["BLOCK_K_UP"], gate_up.group, gate_up.layout)
    bk_dn = nibble_block_k(cfg["BLOCK_K_DOWN"], down.group, down.layout)
    ws = torch.empty(split_up, T, 2 * I, dtype=torch.float32, device=x.device) if split_up > 1 else act
    y = torch.empty(T * split_dn, H, dtype=torch.float32, device=x.device)
    flags = dict(BLOCK_M=cfg["BLOCK_M"], HAS_SHARED=has_shared, SORTED=sort, SCALE_AHEAD=cfg.get("SCALE_AHEAD", False))
    _nibble_gate_up_kernel[(num_slots, triton.cdiv(I, cfg["BLOCK_N_UP"]), split_up)](
        x, *w_up, *s_gate, *s_up, act, ws, *slots, gate_up.tensors[0].shape[0], H, I, T, x.stride(0),
        *(t.stride(0) for t in w_up), act.stride(0), split_len(H, split_up, bk_up), TOP_K=k,
        BLOCK_N=cfg["BLOCK_N_UP"], BLOCK_K=bk_up, SPLIT=split_up, **fmt_up, **flags, **launch)
    if split_up > 1:
        _split_act_kernel[(T, triton.cdiv(I, REDUCE_BLOCK))](ws, act, T, I, act.stride(0), SPLIT=split_up,
                                                             BLOCK=REDUCE_BLOCK, num_warps=2)
    _nibble_down_kernel[(num_slots, triton.cdiv(H, cfg["BLOCK_N_DOWN"]), split_dn)](
        act, *w_dn, *s_down, topk_weights.contiguous(), y, *slots, gate_up.tensors[0].shape[0], H, I,
        act.stride(0), *(t.stride(0) for t in w_dn), y.stride(0), split_len(I, split_dn, bk_dn),
        BLOCK_N=cfg["BLOCK_N_DOWN"], BLOCK_K=bk_dn, SPLIT=split_dn, **fmt_dn, **flags, **launch)
    return y


def _wordcol_expert_mlp(x, gate_up, down, w_up, w_dn, s_gate, s_up, s_down, act, ids, topk_weights, has_shared,
                        cfg, out=None) -> Tensor:
    """`_grouped_expert_mlp` on the word-column path (moe_wordcol.py; AWQ), a program row per (token, slot) pair:
    y [M·k·SPLIT_DOWN, H] fp32; with cfg["FIXUP"] and `out` [M, H] given, out itself: the gate_up kernel's last K
    slice of each tile forms act and the down kernel's last program of each (token, tile) sums the slots (no
    split-act or slot-sum launch), counting on int32 counters (common.splitk_counters: the weights' own
    `gate_up.counters` when it has enough, else fresh zeros)."""
    M, H = x.shape
    T, I = act.shape
    k = ids.shape[1]
    assert gate_up.layout == "awq", f"the word-column MoE takes AWQ experts, got {gate_up.layout}"
    assert all(t.numel() < 2 ** 31 for t in (w_up[0][0], w_dn[0][0])), "the word-column walk indexes in int32"
    # rows a step of the walk (gemv_wordcol.wordcol_slice), dividing each linear's group
    rows_up, rows_dn = (min(p.group, cfg.get("ROWS", 32)) for p in (gate_up, down))
    prefetch = cfg.get("PREFETCH", False)  # the next step's words loaded ahead (8-row steps: wordcol_slice checks)
    # the fp16-pair walk (fp16 activations, or bf16 scaled into fp16 a step at a time; half2.py's twin of its inline
    # PTX under the interpreter)
    half2 = dict(HALF2=cfg.get("HALF2", False), ASM=x.is_cuda)
    assert x.dtype in (torch.float16, torch.bfloat16) or not half2["HALF2"], \
        f"the fp16-pair walk (HALF2) takes fp16 or bf16, not {x.dtype}"
    split_up, split_dn = cfg.get("SPLIT_UP", 1), cfg.get("SPLIT_DOWN", 1)
    bn_up, bn_dn = cfg["BLOCK_N_UP"], cfg["BLOCK_N_DOWN"]
    ws = torch.empty(split_up, T, 2 * I, dtype=torch.float32, device=x.device) if split_up > 1 else act
    y = torch.empty(T * split_dn, H, dtype=torch.float32, device=x.device)
    pdl = use_pdl(x, cfg.get("PDL", False))  # the chain's launches overlap their predecessors' tails (sm_90+)
    weights = topk_weights.contiguous()  # before the chain: a copy kernel inside it would end the overlap
    launch = dict(num_warps=cfg["num_warps"], num_stages=1, **pdl_launch(pdl))
    fixup = cfg.get("FIXUP", False) and out is not None
    tiles_up, tiles_dn = triton.cdiv(I, bn_up), triton.cdiv(H, bn_dn)
    if fixup:  # the kernels run one after the other and each leaves its counters at 0: one buffer serves both
        counters = splitk_counters(max(T * tiles_up, M * tiles_dn), x.device, gate_up.counters)
        fix_up = dict(counters=counters, FIXUP=split_up > 1)
        fix_dn = dict(out=out, counters=counters, TOP_K=k, FIXUP=True)
    else:
        fix_up = fix_dn = {}
    # opt-in (untimed): program rows in expert order, the pairs of an expert several tokens chose side by side
    if cfg.get("EXPERT_ORDER", False) and M > 1:
        order = moe_group(ids, min(T, gate_up.tensors[0].shape[0] + has_shared))[0]
        fix_up, fix_dn = (dict(f, order=order, EXPERT_ORDER=True) for f in (fix_up, fix_dn))
    _wordcol_gate_up_kernel[(T, tiles_up, split_up)](
        x, *w_up, *s_gate, *s_up, act, ws, ids, gate_up.tensors[0].shape[0], H, I, T, x.stride(0),
        *(t.stride(0) for t in w_up), act.stride(0), split_len(H, split_up, rows_up), TOP_K=k, G=gate_up.group,
        BLOCK_N=bn_up, HAS_SHARED=has_shared, SPLIT=split_up, EVEN=I % bn_up == 0, ROWS=rows_up, PREFETCH=prefetch,
        JOINT=cfg.get("JOINT", False), PDL=pdl, **half2, **fix_up, **launch)
    if split_up > 1 and not fixup:
        act_block = cfg.get("ACT_BLOCK", REDUCE_BLOCK)  # features a program (the sums do not depend on it)
        _split_act_kernel[(T, triton.cdiv(I, act_block))](ws, act, T, I, act.stride(0), SPLIT=split_up,
                                                          BLOCK=act_block, PDL=pdl, num_warps=2, **pdl_launch(pdl))
    _wordcol_down_kernel[(T, tiles_dn, split_dn)](
        act, *w_dn, *s_down, weights, y, ids, gate_up.tensors[0].shape[0], H, I, act.stride(0),
        *(t.stride(0) for t in w_dn), y.stride(0), split_len(I, split_dn, rows_dn), G=down.group, BLOCK_N=bn_dn,
        HAS_SHARED=has_shared, SPLIT=split_dn, EVEN=H % bn_dn == 0, ROWS=rows_dn, PREFETCH=prefetch, PDL=pdl, **half2,
        **fix_dn, **launch)
    return out if fixup else y

"""Expert-grouped MoE GEMMs for small M (decode and speculative verification): every touched expert's
weights are read once per call, however many of the M rows chose it.

Why the (token, slot)-pair kernels of moe.py miss the memory roofline at small M (benchmarks/RESULTS.md K5):
their programs own BLOCK_M pairs of one expert, and BLOCK_M was 1..8 with no `tl.dot` below 12 rows per
expert, so an expert chosen by r rows is streamed ceil(r / BLOCK_M) times; their GEMV tiles (16 x 32..256)
reduce across the tile every K step and keep little in flight; and alignment costs three launches.
Here a program owns one touched expert ("slot") and one N tile, and loops over that expert's rows
BLOCK_M at a time against weight tiles that come through one loader (`_load_weight_tile`, the place a
quantized-weights variant dequantizes).

Pipeline (device only, no host sync; every shape depends only on M·k and E, so it captures in a CUDA graph):
  1. `moe_group` (one program): sort the T = M·k (token, slot) pairs by (expert, pair); slot s < S =
     min(T, #experts) gets the s-th distinct expert in ascending id and the range [start, end) of its
     pairs in `order`; slots past the distinct count get expert -1 (their programs return at once).
     At M = 1 the pairs are already distinct experts and this launch is skipped (SORTED=False).
  2. gate_up, grid (S, I / BLOCK_N_UP): gate rows n and up rows n of one N tile in the same K loop, so
     SiLU(gate)·up is formed in the epilogue; act = SiLU(gate)·up rounded once -> [T, I].
  3. down, grid (S, H / BLOCK_N_DOWN): w_pair · (act @ down_e.T) in fp32 -> y [T, H] (fp32),
     then moe.py's fixed-order sum over the k slots of each token (bitwise reproducible, no atomics).
The GEMM tile is [weight rows, BLOCK_M rows] ("swap AB"): the weights are the wide operand, so tl.dot
(sm80+) pads only the rows to 16, and the sm70 path (USE_DOT=False) does broadcast FMA on CUDA cores
(at BLOCK_M = 1 the products accumulate elementwise and are reduced once after the K loop).
The shared expert is one more expert: id `num_routed` selects the `shared_expert` tensors.

Bytes and programs at the real shapes (hidden H 2560, expert ffn I 640, bf16, 512 experts + shared, top-10
+ shared; per expert gate_up 2·I·H·2 B = 6.55 MB, down H·I·2 B = 3.28 MB, 9.83 MB in all; copy ~4.3 TB/s):
  M = 1:  11 experts, 108 MB, floor 25 µs. gate_up 11 x 640/16 = 440 programs of 164 KB (BLOCK_N_UP 16);
          down 11 x 2560/32 = 880 programs of 41 KB (BLOCK_N_DOWN 32): 3.3 / 6.7 programs per SM on 132 SMs.
  M = 8:  S = 88 slots, ~75.6 experts (74.6 routed under uniform routing + shared), 743 MB, floor 173 µs;
          3,520 / 7,040 programs (~3,020 / 6,050 live).
  M = 40: S = 440, ~280 experts, 2.76 GB, floor 641 µs; 17,600 / 35,200 programs (~11,200 / 22,400 live).
Bytes in flight: 4.3 TB/s x ~1.5 µs of DRAM latency is ~6.5 MB, ~50 KB per SM. tl.dot's loads pipeline
through shared memory (num_stages), so a gate_up program keeps 2-3 K steps of 2 x 16 x 128 weights (8 KB
each) in flight, and at 36 KB of shared memory per program up to 6 programs share an SM. No split-K is
needed to fill the machine: N = 2·I = 1,280 and N = H = 2,560 already give >= 40 tiles per
expert. The weights are the only traffic that grows with the experts: x ([M, H]), act ([T, I]) and y
([T, H] fp32) are < 1% of it at these M.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

# ----------------------------------------------------------------------------------------------
# grouping of the (token, slot) pairs by expert


def moe_group_ref(topk_ids: Tensor, num_slots: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """topk_ids: [M, k] int -> (order [T] int32, slot_expert [S] int32, slot_start [S] int32, slot_end [S] int32).

    T = M·k flat pairs (token·k + slot). `order` lists them sorted by (expert, pair); slot s < #distinct
    holds the s-th distinct expert (ascending) and its pairs order[start:end]; slots past that hold
    expert -1 and start = end = 0. num_slots = S >= the number of distinct experts (min(T, E) always is).
    """
    flat = topk_ids.reshape(-1).long()
    T = flat.numel()
    order = torch.sort(flat * T + torch.arange(T, device=flat.device)).values % T
    experts, counts = torch.unique(flat, sorted=True, return_counts=True)
    n = experts.numel()
    assert n <= num_slots, (n, num_slots)
    slot_expert = torch.full((num_slots,), -1, dtype=torch.int32, device=flat.device)
    slot_start = torch.zeros(num_slots, dtype=torch.int32, device=flat.device)
    slot_end = torch.zeros(num_slots, dtype=torch.int32, device=flat.device)
    slot_expert[:n] = experts.to(torch.int32)
    slot_end[:n] = torch.cumsum(counts, 0).to(torch.int32)
    slot_start[:n] = slot_end[:n] - counts.to(torch.int32)
    return order.to(torch.int32), slot_expert, slot_start, slot_end


@triton.jit
def _moe_group_kernel(topk_ids, order, slot_expert, slot_start, slot_end, sorted_expert, T, S,
                      BLOCK_T: tl.constexpr):
    o = tl.arange(0, BLOCK_T)
    m = o < T
    b_e = tl.load(topk_ids + o, mask=m, other=0).to(tl.int32)
    # one key per pair, unique: expert-major, pair-minor; padding sorts last
    b_key = tl.sort(tl.where(m, b_e * BLOCK_T + o, 2147483647))
    b_e = b_key // BLOCK_T
    tl.store(order + o, b_key % BLOCK_T, mask=m)
    # neighbours in sorted order through memory: a register tensor cannot be shifted
    tl.store(sorted_expert + o, b_e, mask=m)
    tl.debug_barrier()
    b_prev = tl.load(sorted_expert + o - 1, mask=m & (o > 0), other=-1)
    b_next = tl.load(sorted_expert + o + 1, mask=o + 1 < T, other=-1)
    is_start = m & (b_e != b_prev)
    is_end = m & (b_e != b_next)
    b_slot = tl.cumsum(is_start.to(tl.int32), 0) - 1
    num_distinct = tl.sum(is_start.to(tl.int32), 0)
    tl.store(slot_expert + b_slot, b_e, mask=is_start)
    tl.store(slot_start + b_slot, o, mask=is_start)
    tl.store(slot_end + b_slot, o + 1, mask=is_end)
    m_empty = (o >= num_distinct) & (o < S)
    tl.store(slot_expert + o, tl.full([BLOCK_T], -1, tl.int32), mask=m_empty)
    tl.store(slot_start + o, tl.zeros([BLOCK_T], tl.int32), mask=m_empty)
    tl.store(slot_end + o, tl.zeros([BLOCK_T], tl.int32), mask=m_empty)


GROUP_MAX_PAIRS = 4096  # one program sorts all pairs in registers


def moe_group(topk_ids: Tensor, num_slots: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Triton version of `moe_group_ref` (identical outputs): one program, no host sync."""
    assert topk_ids.dtype in (torch.int32, torch.int64) and topk_ids.is_contiguous(), (topk_ids.dtype, topk_ids.stride())
    T = topk_ids.numel()
    assert 1 <= T <= GROUP_MAX_PAIRS and 1 <= num_slots <= T, (
        f"moe_group takes 1..{GROUP_MAX_PAIRS} pairs and 1..T slots, got T={T}, S={num_slots}; "
        "larger batches go through moe_align (fused_moe's pairs path)")
    dev = topk_ids.device
    order = torch.empty(T, dtype=torch.int32, device=dev)
    slot_expert, slot_start, slot_end = (torch.empty(num_slots, dtype=torch.int32, device=dev) for _ in range(3))
    scratch = torch.empty(T, dtype=torch.int32, device=dev)
    block_t, warps = group_launch(T)
    _moe_group_kernel[(1,)](topk_ids, order, slot_expert, slot_start, slot_end, scratch, T, num_slots,
                            BLOCK_T=block_t, num_warps=warps)
    return order, slot_expert, slot_start, slot_end


def group_launch(T: int) -> tuple[int, int]:
    """(BLOCK_T, num_warps) of `moe_group` for T pairs: <= 8 keys per thread."""
    block_t = max(16, triton.next_power_of_2(T))
    return block_t, max(1, min(16, block_t // 256))


# ----------------------------------------------------------------------------------------------
# the two GEMMs


@triton.jit
def _load_weight_tile(rows, o_k, m_rows, m_k):
    """[R, BLOCK_K] weight tile: row pointers `rows` [R], columns `o_k` [BLOCK_K], in the weights' dtype.

    Every weight byte of the grouped kernels is read here: a quantized variant (int4 / FP4 codes plus
    group scales) loads its packed tile and dequantizes to the activation dtype in this function."""
    return tl.load(rows[:, None] + o_k[None, :], mask=m_rows[:, None] & m_k[None, :], other=0.0)


@triton.jit
def _gate_up_bases(w, shared_gate, shared_up, i_e, num_routed, I, stride_we, stride_wn, HAS_SHARED: tl.constexpr):
    """Pointers to gate row 0 and up row 0 of expert i_e: routed [E, 2I, H] (up rows after the gate rows),
    or the shared expert's own [I, H] gate and up weights when i_e == num_routed."""
    p_gate = w + i_e * stride_we
    p_up = p_gate + I * stride_wn
    if HAS_SHARED:
        if i_e == num_routed:
            p_gate = shared_gate
            p_up = shared_up
    return p_gate, p_up


@triton.jit
def _down_base(w, shared_down, i_e, num_routed, stride_we, HAS_SHARED: tl.constexpr):
    """Pointer to row 0 of expert i_e's down projection ([H, I]), the shared expert's at i_e == num_routed."""
    p_w = w + i_e * stride_we
    if HAS_SHARED:
        if i_e == num_routed:
            p_w = shared_down
    return p_w


@triton.jit
def _mac(acc, b_w, b_a, BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr):
    """acc += W·Aᵀ for one K step. b_w [R, BK]; b_a [BK, BM] (USE_DOT) or [BM, BK]; one row without
    tl.dot (GEMV): acc [R, BK] of elementwise products, reduced once after the K loop."""
    if USE_DOT:
        acc = tl.dot(b_w, b_a, acc, input_precision="ieee")
    elif BLOCK_M == 1:
        acc += b_w.to(tl.float32) * b_a.to(tl.float32)
    else:
        acc += tl.sum(b_w.to(tl.float32)[:, None, :] * b_a.to(tl.float32)[None, :, :], 2)
    return acc


@triton.jit
def _rows_matmul(w_rows, w2_rows, m_w, a_rows, m_a, K, R: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, TWO: tl.constexpr):
    """(W[R, :K] · A[BLOCK_M, :K]ᵀ, W2[R, :K] · A[BLOCK_M, :K]ᵀ), each [R, BLOCK_M] fp32 (the second
    only when TWO). w_rows / w2_rows [R] and a_rows [BLOCK_M]: row pointers; m_w / m_a: row masks.
    Each weight row set has a scalar base plus row offsets, so its tiles vectorise along K and
    tl.dot's loads pipeline (a per-row select between two bases defeats both)."""
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
        acc = _mac(acc, _load_weight_tile(w_rows, o_k, m_w, m_k), b_a, BLOCK_M, USE_DOT)
        if TWO:
            acc2 = _mac(acc2, _load_weight_tile(w2_rows, o_k, m_w, m_k), b_a, BLOCK_M, USE_DOT)
    if USE_DOT:
        pass
    elif BLOCK_M == 1:
        acc = tl.sum(acc, 1, keep_dims=True)
        acc2 = tl.sum(acc2, 1, keep_dims=True)
    return acc, acc2


@triton.jit
def _program(topk_ids, slot_expert, slot_start, slot_end, SORTED: tl.constexpr):
    """This program's (N tile, expert, first, end): grid axis 0 is the slot, whose pairs are a range of
    `order`, or pair i_s itself when not SORTED (M = 1); expert -1 marks a slot past the distinct experts."""
    i_s = tl.program_id(0)
    i_n = tl.program_id(1)
    if SORTED:
        i_e = tl.load(slot_expert + i_s).to(tl.int64)
        start = tl.load(slot_start + i_s)
        end = tl.load(slot_end + i_s)
    else:
        i_e = tl.load(topk_ids + i_s).to(tl.int64)
        start = i_s
        end = i_s + 1
    return i_n, i_e, start, end


@triton.jit
def _pairs(order, m0, end, BLOCK_M: tl.constexpr, SORTED: tl.constexpr):
    """The next BLOCK_M pairs of a slot (flat token·k + slot indices) and their mask."""
    o_p = m0 + tl.arange(0, BLOCK_M)
    m_p = o_p < end
    if SORTED:
        o_p = tl.load(order + o_p, mask=m_p, other=0)
    return o_p.to(tl.int64), m_p


@triton.jit
def _grouped_gate_up_kernel(x, w, shared_gate, shared_up, act, topk_ids, order, slot_expert, slot_start, slot_end,
                            num_routed, H, I, stride_xm, stride_we, stride_wn, stride_am,
                            TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            USE_DOT: tl.constexpr, HAS_SHARED: tl.constexpr, SORTED: tl.constexpr):
    i_n, i_e, start, end = _program(topk_ids, slot_expert, slot_start, slot_end, SORTED)
    if i_e < 0:
        return
    p_gate, p_up = _gate_up_bases(w, shared_gate, shared_up, i_e, num_routed, I, stride_we, stride_wn, HAS_SHARED)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < I
    off_n = o_n.to(tl.int64) * stride_wn
    for m0 in range(start, end, BLOCK_M):
        b_pair, m_p = _pairs(order, m0, end, BLOCK_M, SORTED)
        a_rows = x + (b_pair // TOP_K) * stride_xm
        b_g, b_u = _rows_matmul(p_gate + off_n, p_up + off_n, m_n, a_rows, m_p, H, BLOCK_N, BLOCK_M, BLOCK_K,
                                USE_DOT, True)  # [BN, BM] each
        b_a = b_g * tl.sigmoid(b_g) * b_u
        p_a = act + b_pair[None, :] * stride_am + o_n[:, None]
        tl.store(p_a, b_a.to(act.dtype.element_ty), mask=m_n[:, None] & m_p[None, :])


@triton.jit
def _grouped_down_kernel(act, w, shared_down, topk_weights, y, topk_ids, order, slot_expert, slot_start, slot_end,
                         num_routed, H, I, stride_am, stride_we, stride_wn, stride_ym,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         USE_DOT: tl.constexpr, HAS_SHARED: tl.constexpr, SORTED: tl.constexpr):
    i_n, i_e, start, end = _program(topk_ids, slot_expert, slot_start, slot_end, SORTED)
    if i_e < 0:
        return
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < H
    w_rows = _down_base(w, shared_down, i_e, num_routed, stride_we, HAS_SHARED) + o_n.to(tl.int64) * stride_wn
    for m0 in range(start, end, BLOCK_M):
        b_pair, m_p = _pairs(order, m0, end, BLOCK_M, SORTED)
        acc, _ = _rows_matmul(w_rows, w_rows, m_n, act + b_pair * stride_am, m_p, I, BLOCK_N, BLOCK_M, BLOCK_K,
                              USE_DOT, False)  # [BN, BM]
        b_rw = tl.load(topk_weights + b_pair, mask=m_p, other=0.0).to(tl.float32)
        p_y = y + b_pair[None, :] * stride_ym + o_n[:, None]
        tl.store(p_y, acc * b_rw[None, :], mask=m_n[:, None] & m_p[None, :])


def expected_distinct(M: int, top_k: int, num_experts: int) -> float:
    """Distinct experts that M rows touch under uniform top-k routing: E·(1 - (1 - k/E)^M)."""
    return num_experts * (1.0 - (1.0 - min(top_k, num_experts) / num_experts) ** M)


def grouped_config(M: int, top_k: int, num_experts: int, arch: int | None = None) -> dict:
    """Launch config of the grouped path (also used by the AOT compile tests and the benchmark).

    sm80+ (and the interpreter): tl.dot tiles of 16 rows (tensor cores; padding 1..15 rows to 16 costs
    no weight bytes); 2 x 32 gate + up rows and 64 down rows per program, 128 per K step (measured on the H200,
    benchmarks/RESULTS.md K5b: 71% of copy at M = 1, 94-96% at M = 8 / 40 with 512 experts, against 59% / 86% /
    89% with 16 / 32 rows per program).
    sm70: tl.dot would be FMA on 16 padded rows, so BLOCK_M follows the expected rows per touched expert
    ρ (1, 2, 4, 8) with broadcast FMA tiles of <= 4K fp32 products per 128 threads (no spills).
    """
    if arch is None or arch >= 80:
        return dict(GROUPED=True, BLOCK_M=16, BLOCK_N_UP=32, BLOCK_K_UP=128, BLOCK_N_DOWN=64, BLOCK_K_DOWN=128,
                    USE_DOT=True, num_warps=4, num_stages=4 if arch is not None and arch >= 90 else 3)
    rho = M * top_k / max(1.0, expected_distinct(M, top_k, num_experts))
    bm = 1 if M == 1 else min(8, triton.next_power_of_2(math.ceil(rho - 1e-6)))
    (bn_up, bk_up), (bn_dn, bk_dn) = {1: ((16, 256), (32, 128)), 2: ((16, 64), (32, 64)),
                                      4: ((16, 32), (32, 32)), 8: ((8, 32), (16, 32))}[bm]
    return dict(GROUPED=True, BLOCK_M=bm, BLOCK_N_UP=bn_up, BLOCK_K_UP=bk_up, BLOCK_N_DOWN=bn_dn, BLOCK_K_DOWN=bk_dn,
                USE_DOT=False, num_warps=4, num_stages=2)


def grouped_expert_mlp(x: Tensor, gate_up_proj: Tensor, down_proj: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                       shared_expert: tuple[Tensor, Tensor, Tensor] | None, cfg: dict) -> Tensor:
    """Per pair w_pair · down_e(SiLU(gate_e x) ⊙ up_e x) in fp32: y [M·k, H] (row token·k + slot).

    Arguments as `moe.fused_moe` (already checked there); ids must lie in [0, E) (+ E with `shared_expert`).
    """
    M, H = x.shape
    E, two_i, _ = gate_up_proj.shape
    I = two_i // 2
    k = topk_ids.shape[1]
    T = M * k
    assert not cfg["USE_DOT"] or cfg["BLOCK_M"] >= 16, f"tl.dot needs BLOCK_M >= 16, got {cfg}"
    ids = topk_ids.contiguous()
    weights = topk_weights.contiguous()
    num_slots = min(T, E + (shared_expert is not None))
    sort = M > 1  # one row: every pair is a distinct expert already
    if sort:
        order, slot_expert, slot_start, slot_end = moe_group(ids, num_slots)
    else:
        order = slot_expert = slot_start = slot_end = ids
    sg, su, sd = shared_expert if shared_expert is not None else (gate_up_proj, gate_up_proj, down_proj)
    act = torch.empty(T, I, dtype=x.dtype, device=x.device)
    y = torch.empty(T, H, dtype=torch.float32, device=x.device)
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    flags = dict(BLOCK_M=cfg["BLOCK_M"], USE_DOT=cfg["USE_DOT"], HAS_SHARED=shared_expert is not None, SORTED=sort)
    _grouped_gate_up_kernel[(num_slots, triton.cdiv(I, cfg["BLOCK_N_UP"]))](
        x, gate_up_proj, sg, su, act, ids, order, slot_expert, slot_start, slot_end,
        E, H, I, x.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1), act.stride(0),
        TOP_K=k, BLOCK_N=cfg["BLOCK_N_UP"], BLOCK_K=cfg["BLOCK_K_UP"], **flags, **launch)
    _grouped_down_kernel[(num_slots, triton.cdiv(H, cfg["BLOCK_N_DOWN"]))](
        act, down_proj, sd, weights, y, ids, order, slot_expert, slot_start, slot_end,
        E, H, I, act.stride(0), down_proj.stride(0), down_proj.stride(1), y.stride(0),
        BLOCK_N=cfg["BLOCK_N_DOWN"], BLOCK_K=cfg["BLOCK_K_DOWN"], **flags, **launch)
    return y

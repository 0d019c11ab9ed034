"""Fused mixture of experts: routing, token sorting by expert, grouped SwiGLU GEMMs (spec/model.md §6).

Pipeline for one MoE block, x: [M, H] block input, E experts, top-k:

    ids, w   = moe_route(x @ gate.T, k[, shared_logits])     # softmax over all E in fp32, top-k, renormalise
    out      = fused_moe(x, gate_up_proj, down_proj, ids, w[, shared_expert=])  # Σ_k w_k · down_e(SiLU(gate_e x) · up_e x)

`fused_moe` computes y [M·k, H] fp32 (w_pair · expert output per (token, slot) pair) with one of two
kernel families, then a sum kernel adds the k slots of each token in a fixed order with one rounding
-> [M, H]. The fixed-order sum (instead of fp32 atomics) makes the output bitwise reproducible.

Paths (`fused_moe(..., path=)`):
  * "triton" (= "triton_grouped" up to GROUPED_MAX_PAIRS (token, slot) pairs, else "triton_pairs").
  * "triton_grouped" (decode, speculative verification): moe_grouped.py. One program per (touched
    expert, N tile) loops over all rows that chose the expert, so each expert's weights are read once;
    tl.dot on sm80+, CUDA-core FMA on sm70. No host sync, fixed shapes: CUDA-graph safe.
  * "triton_pairs" (prefill): `moe_align` groups the pairs by expert, padded to BLOCK_M per expert;
    one program per (block of BLOCK_M pairs, N tile) for gate_up (gate and up rows of one expert, act =
    SiLU(gate)·up rounded once -> [M·k, I]) and for down. tl.dot tiles (tensor cores on sm80+; FMA on
    sm70, where below 12 rows per expert GEMV tiles without tl.dot waste less).
  * "torch": tokens sorted by expert with torch ops, then per expert torch.matmul (cuBLAS, the sm70
    tensor cores; one host sync for the counts) or `torch._grouped_mm` where it exists (sm90, bf16).
  * "auto" (default): "torch" on sm < 80 when the expert GEMMs are large enough for tensor cores
    (M·k / E >= 16 rows per expert on average), else "triton".

The shared expert (spec §6: σ(w_sg·x) · SwiGLU_s(x)) rides along as expert number E: pass its weights
as `shared_expert=(gate [I, H], up [I, H], down [H, I])` (the SwiGLU module's own tensors, no copy) and
`shared_logits` (= x @ shared_expert_gate.T) to `moe_route`, which appends slot k with id E and weight
σ(logit). Then `fused_moe` returns routed + shared with one rounding, the numerics of `MoE.forward`.
Stacking its weights after the routed ones ([E+1, 2I, H], [E+1, H, I]) works the same without
`shared_expert`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from .moe_grouped import _down_base, _gate_up_bases, _load_weight_tile, grouped_config, grouped_expert_mlp
from .pdl import pdl_launch, pdl_start

# ----------------------------------------------------------------------------------------------
# routing


def moe_route_ref(router_logits: Tensor, top_k: int, renormalize: bool = True,
                  shared_logits: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """router_logits: [M, E] -> (topk_ids [M, k] int32, topk_weights [M, k] fp32), k = top_k (+1 with shared).

    Softmax over all E in fp32 before the top-k, then renormalise (MoE.route). With `shared_logits`
    [M], slot k is the shared expert: id E, weight σ(logit) in fp32.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    if shared_logits is not None:
        E = router_logits.shape[-1]
        ids = torch.cat([ids, torch.full_like(ids[:, :1], E)], dim=-1)
        weights = torch.cat([weights, torch.sigmoid(shared_logits.float().reshape(-1, 1))], dim=-1)
    return ids.to(torch.int32), weights


@triton.jit
def _moe_route_kernel(logits, shared, ids_out, w_out, E, stride_l, stride_s, stride_o,
                      TOP_K: tl.constexpr, NUM_OUT: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_K: tl.constexpr, RENORM: tl.constexpr, HAS_SHARED: tl.constexpr):
    i_m = tl.program_id(0).to(tl.int64)
    o_e = tl.arange(0, BLOCK_E)
    b_l = tl.load(logits + i_m * stride_l + o_e, mask=o_e < E, other=float("-inf")).to(tl.float32)
    b_p = tl.exp(b_l - tl.max(b_l, 0))
    b_p = b_p / tl.sum(b_p, 0)  # [BLOCK_E] softmax over all experts
    o_k = tl.arange(0, BLOCK_K)
    b_ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    b_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    b_p = tl.where(o_e < E, b_p, -1.0)
    for j in tl.static_range(TOP_K):
        # ties go to the lowest expert id
        i_best = tl.argmax(b_p, 0, tie_break_left=True)
        p_best = tl.max(b_p, 0)
        b_ids = tl.where(o_k == j, i_best.to(tl.int32), b_ids)
        b_w = tl.where(o_k == j, p_best, b_w)
        b_p = tl.where(o_e == i_best, -1.0, b_p)
    if RENORM:
        b_w = b_w / tl.sum(b_w, 0)
    if HAS_SHARED:
        s = tl.load(shared + i_m * stride_s).to(tl.float32)
        b_ids = tl.where(o_k == TOP_K, E, b_ids)
        b_w = tl.where(o_k == TOP_K, tl.sigmoid(s + tl.zeros([BLOCK_K], dtype=tl.float32)), b_w)
    tl.store(ids_out + i_m * stride_o + o_k, b_ids, mask=o_k < NUM_OUT)
    tl.store(w_out + i_m * stride_o + o_k, b_w, mask=o_k < NUM_OUT)


def moe_route(router_logits: Tensor, top_k: int, renormalize: bool = True,
              shared_logits: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Triton version of `moe_route_ref`: one program per token row (E <= 4096)."""
    assert router_logits.dim() == 2 and router_logits.stride(-1) == 1, (router_logits.shape, router_logits.stride())
    M, E = router_logits.shape
    assert 1 <= top_k <= E <= 4096, (top_k, E)
    num_out = top_k + (shared_logits is not None)
    if shared_logits is not None:
        assert shared_logits.shape[0] == M and shared_logits.numel() == M, shared_logits.shape
    ids = torch.empty(M, num_out, dtype=torch.int32, device=router_logits.device)
    weights = torch.empty(M, num_out, dtype=torch.float32, device=router_logits.device)
    if M == 0:
        return ids, weights
    stride_s = shared_logits.stride(0) if shared_logits is not None else 0
    _moe_route_kernel[(M,)](
        router_logits, shared_logits if shared_logits is not None else router_logits, ids, weights,
        E, router_logits.stride(0), stride_s, num_out,
        TOP_K=top_k, NUM_OUT=num_out, BLOCK_E=triton.next_power_of_2(E),
        BLOCK_K=triton.next_power_of_2(num_out), RENORM=renormalize, HAS_SHARED=shared_logits is not None,
        num_warps=4 if E >= 256 else 1)
    return ids, weights


# ----------------------------------------------------------------------------------------------
# token sorting by expert


def moe_align_max_padded(num_slots: int, num_experts: int, block_m: int) -> int:
    """Upper bound of num_tokens_post_pad: every non-empty expert pads by at most block_m - 1."""
    return num_slots + min(num_slots, num_experts) * (block_m - 1)


def moe_align_ref(topk_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """Group the M·k (token, slot) pairs by expert, each group padded to a multiple of block_m.

    topk_ids: [M, k] int. Returns
      sorted_token_ids [P_max] int32: flat slot indices (token·k + slot) grouped by expert in ascending
        expert order, padding entries = M·k; entries at or past num_tokens_post_pad are unspecified;
      expert_ids [P_max / block_m] int32: the expert of each block, -1 past the end;
      num_tokens_post_pad [1] int32.
    Within one expert the slots are in ascending order here; the Triton version may permute them.
    """
    flat = topk_ids.reshape(-1).long()
    T = flat.numel()
    p_max = moe_align_max_padded(T, num_experts, block_m)
    num_blocks = triton.cdiv(p_max, block_m)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    order = torch.sort(flat, stable=True).indices
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(T, device=flat.device) - first_of_expert[flat[order]]
    sorted_ids = torch.full((num_blocks * block_m,), T, dtype=torch.int32, device=flat.device)
    sorted_ids[starts[flat[order]] + rank] = order.to(torch.int32)
    total = int(padded.sum())
    expert_ids = torch.full((num_blocks,), -1, dtype=torch.int32, device=flat.device)
    expert_ids[: total // block_m] = torch.repeat_interleave(torch.arange(num_experts, device=flat.device),
                                                           padded // block_m).to(torch.int32)
    return sorted_ids, expert_ids, torch.tensor([total], dtype=torch.int32, device=flat.device)


@triton.jit
def _moe_count_kernel(topk_ids, counts, ranks, T, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = o < T
    b_e = tl.load(topk_ids + o, mask=mask, other=0)
    # the old count is this slot's rank inside its expert group (order across programs is arbitrary)
    b_r = tl.atomic_add(counts + b_e, 1, mask=mask)
    tl.store(ranks + o, b_r, mask=mask)


@triton.jit
def _moe_prefix_kernel(counts, starts, sorted_ids, expert_ids, num_post_pad, T, E, num_blocks,
                       BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr,
                       BLOCK_P: tl.constexpr):
    o_e = tl.arange(0, BLOCK_E)
    b_c = tl.load(counts + o_e, mask=o_e < E, other=0)
    b_pad = (b_c + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    b_end = tl.cumsum(b_pad, 0)
    tl.store(starts + o_e, b_end - b_pad, mask=o_e < E)
    total = tl.sum(b_pad, 0)
    tl.store(num_post_pad, total)
    b_end = tl.where(o_e < E, b_end, 2147483647)
    for b0 in range(0, num_blocks, BLOCK_B):
        o_b = b0 + tl.arange(0, BLOCK_B)
        pos = o_b * BLOCK_M
        # the owning expert is the first one whose (padded) end lies past pos
        b_owner = tl.sum((b_end[None, :] <= pos[:, None]).to(tl.int32), 1)
        tl.store(expert_ids + o_b, tl.where(pos < total, b_owner, -1), mask=o_b < num_blocks)
    # every position below total starts as padding; the scatter kernel overwrites the real slots
    for p0 in range(0, total, BLOCK_P):
        o_p = p0 + tl.arange(0, BLOCK_P)
        tl.store(sorted_ids + o_p, tl.zeros([BLOCK_P], dtype=tl.int32) + T, mask=o_p < total)


@triton.jit
def _moe_scatter_kernel(topk_ids, ranks, starts, sorted_ids, T, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = o < T
    b_e = tl.load(topk_ids + o, mask=mask, other=0)
    b_r = tl.load(ranks + o, mask=mask, other=0)
    b_s = tl.load(starts + b_e, mask=mask, other=0)
    tl.store(sorted_ids + b_s + b_r, o.to(tl.int32), mask=mask)


def moe_align(topk_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """Triton version of `moe_align_ref` (same outputs up to the order of slots inside one expert).

    Three launches (count with atomics, one-program prefix sum, scatter), no host sync; the output
    sizes depend only on M·k, E and block_m, so it can be captured in a CUDA graph.
    """
    assert topk_ids.dtype in (torch.int32, torch.int64) and topk_ids.is_contiguous(), (topk_ids.dtype, topk_ids.stride())
    assert num_experts <= 8192 and block_m >= 1, (num_experts, block_m)
    dev = topk_ids.device
    T = topk_ids.numel()
    p_max = moe_align_max_padded(T, num_experts, block_m)
    num_blocks = triton.cdiv(p_max, block_m)
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    num_post_pad = torch.empty(1, dtype=torch.int32, device=dev)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    ranks = torch.empty(T, dtype=torch.int32, device=dev)
    starts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    BLOCK = 1024
    grid = (max(triton.cdiv(T, BLOCK), 1),)
    _moe_count_kernel[grid](topk_ids, counts, ranks, T, BLOCK=BLOCK)
    block_e = triton.next_power_of_2(num_experts)
    _moe_prefix_kernel[(1,)](counts, starts, sorted_ids, expert_ids, num_post_pad, T, num_experts, num_blocks,
                             BLOCK_E=block_e, BLOCK_M=block_m, BLOCK_B=max(1, min(64, 16384 // block_e)),
                             BLOCK_P=1024, num_warps=4)
    _moe_scatter_kernel[grid](topk_ids, ranks, starts, sorted_ids, T, BLOCK=BLOCK)
    return sorted_ids, expert_ids, num_post_pad


# ----------------------------------------------------------------------------------------------
# grouped SwiGLU GEMMs


def fused_moe_ref(x: Tensor, gate_up_proj: Tensor, down_proj: Tensor, topk_ids: Tensor,
                  topk_weights: Tensor, shared_expert: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
    """Σ_k w_k · down_e(SiLU(gate_e x) ⊙ up_e x) with the numerics of `Experts.forward`.

    x: [M, H]; gate_up_proj: [E, 2I, H] (gate rows first); down_proj: [E, H, I];
    topk_ids: [M, k] int; topk_weights: [M, k] fp32. Each expert's GEMMs round to x.dtype (torch
    matmul), the weighted sum over k is fp32, rounded once to x.dtype at the end. Returns [M, H].
    shared_expert: (gate [I, H], up [I, H], down [H, I]), the weights of expert number E (one past the
    routed ones); moe_route(..., shared_logits=) gives every token that slot with weight σ(logit).
    """
    E, I = down_proj.shape[0], down_proj.shape[-1]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        token_idx, slot = torch.nonzero(ids == e, as_tuple=True)
        xe = x[token_idx]
        if shared_expert is not None and e == E:
            ye = _swiglu(xe, *shared_expert)
        else:
            gate, up = (xe @ gate_up_proj[e].t()).split(I, dim=-1)
            ye = (F.silu(gate) * up) @ down_proj[e].t()
        out.index_add_(0, token_idx, ye.float() * topk_weights[token_idx, slot, None].float())
    return out.to(x.dtype)


def _swiglu(x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """down(SiLU(x @ gate.T) ⊙ (x @ up.T)), each GEMM rounded to x.dtype as in the reference."""
    return (F.silu(x @ gate.t()) * (x @ up.t())) @ down.t()


@triton.jit
def _moe_gate_up_kernel(x, w, shared_gate, shared_up, act, sorted_ids, expert_ids, T, num_routed, H, I,
                        stride_xm, stride_we, stride_wn, stride_am,
                        TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, HAS_SHARED: tl.constexpr):
    i_b = tl.program_id(0)
    i_n = tl.program_id(1)
    i_e = tl.load(expert_ids + i_b).to(tl.int64)
    if i_e < 0:
        return
    b_sid = tl.load(sorted_ids + i_b * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM] flat slot ids, T = padding
    m_row = b_sid < T
    b_tok = (b_sid // TOP_K).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < I
    p_x = x + b_tok[:, None] * stride_xm
    p_gate, p_up = _gate_up_bases(w, shared_gate, shared_up, i_e, num_routed, I, stride_we, stride_wn, HAS_SHARED)
    p_g = p_gate + o_n.to(tl.int64) * stride_wn  # [BN] row pointers
    p_u = p_up + o_n.to(tl.int64) * stride_wn
    b_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    b_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < H
        b_x = tl.load(p_x + o_k[None, :], mask=m_row[:, None] & m_k[None, :], other=0.0)  # [BM, BK]
        b_wg = _load_weight_tile(p_g, o_k, m_n, m_k)  # [BN, BK]
        b_wu = _load_weight_tile(p_u, o_k, m_n, m_k)
        if USE_DOT:
            b_g = tl.dot(b_x, tl.trans(b_wg), b_g, input_precision="ieee")
            b_u = tl.dot(b_x, tl.trans(b_wu), b_u, input_precision="ieee")
        else:
            b_xf = b_x.to(tl.float32)[:, None, :]
            b_g += tl.sum(b_xf * b_wg.to(tl.float32)[None, :, :], 2)
            b_u += tl.sum(b_xf * b_wu.to(tl.float32)[None, :, :], 2)
    b_a = b_g * tl.sigmoid(b_g) * b_u
    p_a = act + b_sid[:, None].to(tl.int64) * stride_am + o_n[None, :]
    tl.store(p_a, b_a.to(act.dtype.element_ty), mask=m_row[:, None] & m_n[None, :])


@triton.jit
def _moe_down_kernel(act, w, shared_down, topk_weights, y, sorted_ids, expert_ids, T, num_routed, H, I,
                     stride_am, stride_we, stride_wn, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     USE_DOT: tl.constexpr, HAS_SHARED: tl.constexpr):
    i_b = tl.program_id(0)
    i_n = tl.program_id(1)
    i_e = tl.load(expert_ids + i_b).to(tl.int64)
    if i_e < 0:
        return
    b_sid = tl.load(sorted_ids + i_b * BLOCK_M + tl.arange(0, BLOCK_M))
    m_row = b_sid < T
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < H
    p_a = act + b_sid[:, None].to(tl.int64) * stride_am
    p_w = _down_base(w, shared_down, i_e, num_routed, stride_we, HAS_SHARED) + o_n.to(tl.int64) * stride_wn
    b_y = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < I
        b_a = tl.load(p_a + o_k[None, :], mask=m_row[:, None] & m_k[None, :], other=0.0)  # [BM, BK]
        b_w = _load_weight_tile(p_w, o_k, m_n, m_k)  # [BN, BK]
        if USE_DOT:
            b_y = tl.dot(b_a, tl.trans(b_w), b_y, input_precision="ieee")
        else:
            b_y += tl.sum(b_a.to(tl.float32)[:, None, :] * b_w.to(tl.float32)[None, :, :], 2)
    b_rw = tl.load(topk_weights + b_sid, mask=m_row, other=0.0).to(tl.float32)
    b_y = b_y * b_rw[:, None]
    p_y = y + b_sid[:, None].to(tl.int64) * stride_ym + o_n[None, :]
    tl.store(p_y, b_y, mask=m_row[:, None] & m_n[None, :])


@triton.jit
def _moe_sum_kernel(y, out, H, stride_ym, stride_om, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                    PDL: tl.constexpr = False):
    pdl_start(PDL)
    i_m = tl.program_id(0).to(tl.int64)
    o_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < H
    b_o = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        b_o += tl.load(y + (i_m * TOP_K + j) * stride_ym + o_n, mask=m_n, other=0.0)
    tl.store(out + i_m * stride_om + o_n, b_o.to(out.dtype.element_ty), mask=m_n)


SUM_BLOCK = 256  # features per program of the slot sum: 10 programs a token at hidden 2560 (1024 gave 3, and
# 8.4 µs at M = 1 on an H100 under Nsight Compute, stalled on its serial loads: benchmarks/RESULTS.md K5d)


def moe_sum(y: Tensor, out: Tensor, slots: int, block: int = SUM_BLOCK, pdl: bool = False) -> Tensor:
    """out [M, H] = Σ_j y[m·slots + j] (fp32, slots in order, rounded once to out.dtype); y [M·slots, H] fp32.
    block: features a program (the sums do not depend on it); pdl: launched with programmatic dependent launch
    (pdl.use_pdl decides)."""
    M, H = out.shape
    _moe_sum_kernel[(M, triton.cdiv(H, block))](y, out, H, y.stride(0), out.stride(0), TOP_K=slots, BLOCK_N=block,
                                                PDL=pdl, num_warps=2, **pdl_launch(pdl))
    return out


GROUPED_MAX_PAIRS = 1024  # (token, slot) pairs up to which fused_moe takes the expert-grouped kernels


def moe_config(M: int, top_k: int, num_experts: int, arch: int | None = None) -> dict:
    """Launch config of the Triton path for M tokens (also used by the AOT compile tests).

    Up to GROUPED_MAX_PAIRS pairs (decode, speculative verification): the expert-grouped kernels of
    moe_grouped (`grouped_config`), which read each touched expert once. Beyond: the pairs kernels
    (`pairs_config`), whose programs own BLOCK_M pairs of one expert each, so a heavily chosen expert's
    row blocks run in parallel. num_experts counts the shared expert when it rides along.
    """
    if M * top_k <= GROUPED_MAX_PAIRS:
        return grouped_config(M, top_k, num_experts, arch)
    return pairs_config(M, top_k, num_experts, arch)


def pairs_config(M: int, top_k: int, num_experts: int, arch: int | None = None) -> dict:
    """Config of the pairs kernels. Rows per active expert ρ = M·k / min(M·k, E) sets BLOCK_M.

    sm70 below 12 rows per expert: GEMV-like tiles (no tl.dot, whose sm70 form pads M to 16 FMA rows;
    BLOCK_M of 1..8, BM·BN·BK <= 4K fp32 products per 128 threads so that nothing spills), then tl.dot
    tiles (FMA on sm70). sm80+: tl.dot tiles (tensor cores) at every ρ.
    """
    T = M * top_k
    rho = T / max(1, min(T, num_experts))
    stages = 2 if arch == 70 else 3
    if arch is not None and arch < 80 and rho < 12:
        bm = 1 if rho <= 1.0 else min(8, triton.next_power_of_2(int(rho + 0.999)))
        (bn_up, bk_up), (bn_dn, bk_dn) = {1: ((16, 256), (32, 256)), 2: ((16, 128), (32, 128)),
                                          4: ((16, 64), (32, 64)), 8: ((16, 32), (32, 32))}[bm]
        return dict(GROUPED=False, BLOCK_M=bm, BLOCK_N_UP=bn_up, BLOCK_K_UP=bk_up, BLOCK_N_DOWN=bn_dn,
                    BLOCK_K_DOWN=bk_dn, USE_DOT=False, num_warps=4, num_stages=stages)
    if arch is not None and arch < 80:
        return dict(GROUPED=False, BLOCK_M=32, BLOCK_N_UP=32, BLOCK_K_UP=32, BLOCK_N_DOWN=32, BLOCK_K_DOWN=32,
                    USE_DOT=True, num_warps=4, num_stages=stages)
    if rho < 48:
        return dict(GROUPED=False, BLOCK_M=16, BLOCK_N_UP=64, BLOCK_K_UP=64, BLOCK_N_DOWN=128, BLOCK_K_DOWN=64,
                    USE_DOT=True, num_warps=4, num_stages=stages)
    return dict(GROUPED=False, BLOCK_M=64, BLOCK_N_UP=64, BLOCK_K_UP=64, BLOCK_N_DOWN=128, BLOCK_K_DOWN=64,
                USE_DOT=True, num_warps=8, num_stages=stages)


def _check_moe_args(x, gate_up_proj, down_proj, topk_ids, topk_weights, shared_expert=None):
    assert x.dim() == 2 and x.stride(-1) == 1, (x.shape, x.stride())
    M, H = x.shape
    E, two_i, H2 = gate_up_proj.shape
    assert H2 == H and two_i % 2 == 0 and gate_up_proj.stride(-1) == 1, (gate_up_proj.shape, x.shape)
    I = two_i // 2
    assert down_proj.shape == (E, H, I) and down_proj.stride(-1) == 1, (down_proj.shape, (E, H, I))
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == M, (topk_ids.shape, topk_weights.shape)
    assert topk_ids.dtype in (torch.int32, torch.int64) and topk_weights.dtype == torch.float32
    assert x.dtype == gate_up_proj.dtype == down_proj.dtype, (x.dtype, gate_up_proj.dtype, down_proj.dtype)
    if shared_expert is not None:
        sg, su, sd = shared_expert
        # the kernels address the shared expert's rows with the routed experts' row strides
        ok = (sg.shape == su.shape == (I, H) and sd.shape == (H, I) and sg.dtype == su.dtype == sd.dtype == x.dtype
              and sg.stride() == su.stride() == (gate_up_proj.stride(1), 1) and sd.stride() == (down_proj.stride(1), 1))
        assert ok, ("shared_expert must be (gate [I, H], up [I, H], down [H, I]) in x's dtype with the routed experts' "
                    f"row strides; got {[(t.shape, t.stride(), t.dtype) for t in shared_expert]}, I={I}, H={H}; "
                    "a shared expert of another width runs as its own SwiGLU")
    return M, H, E, I


def _arch(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def fused_moe(x: Tensor, gate_up_proj: Tensor, down_proj: Tensor, topk_ids: Tensor, topk_weights: Tensor,
              path: str = "auto", config: dict | None = None,
              shared_expert: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
    """Triton (or torch-grouped) version of `fused_moe_ref`; see the module docstring for paths."""
    M, H, E, I = _check_moe_args(x, gate_up_proj, down_proj, topk_ids, topk_weights, shared_expert)
    k = topk_ids.shape[1]
    num_experts = E + (shared_expert is not None)
    arch = _arch(x.device)
    if path == "auto":
        # sm70: tl.dot has no tensor cores, so big batches go to cuBLAS
        path = "torch" if arch is not None and arch < 80 and M * k >= 16 * num_experts else "triton"
    if path == "torch":
        return fused_moe_torch(x, gate_up_proj, down_proj, topk_ids, topk_weights, shared_expert=shared_expert)
    choose = {"triton": moe_config, "triton_grouped": grouped_config, "triton_pairs": pairs_config}
    assert path in choose, f"fused_moe path={path!r}; use auto, torch or one of {list(choose)}"
    out = torch.empty(M, H, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    cfg = config or choose[path](M, k, num_experts, arch)
    if cfg["GROUPED"]:
        y = grouped_expert_mlp(x, gate_up_proj, down_proj, topk_ids, topk_weights, shared_expert, cfg)
    else:
        y = _pairs_expert_mlp(x, gate_up_proj, down_proj, topk_ids, topk_weights, shared_expert, cfg)
    return moe_sum(y, out, k)


def _pairs_expert_mlp(x, gate_up_proj, down_proj, topk_ids, topk_weights, shared_expert, cfg) -> Tensor:
    """The pairs kernels: y [M·k, H] fp32, w_pair · expert output per (token, slot) pair."""
    M, H = x.shape
    E, two_i, _ = gate_up_proj.shape
    I = two_i // 2
    k = topk_ids.shape[1]
    bm = cfg["BLOCK_M"]
    sorted_ids, expert_ids, _ = moe_align(topk_ids.contiguous(), E + (shared_expert is not None), bm)
    T = M * k
    num_blocks = expert_ids.shape[0]
    sg, su, sd = shared_expert if shared_expert is not None else (gate_up_proj, gate_up_proj, down_proj)
    act = torch.empty(T, I, dtype=x.dtype, device=x.device)
    y = torch.empty(T, H, dtype=torch.float32, device=x.device)
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    flags = dict(BLOCK_M=bm, USE_DOT=cfg["USE_DOT"], HAS_SHARED=shared_expert is not None)
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(I, cfg["BLOCK_N_UP"]))](
        x, gate_up_proj, sg, su, act, sorted_ids, expert_ids, T, E, H, I,
        x.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1), act.stride(0),
        TOP_K=k, BLOCK_N=cfg["BLOCK_N_UP"], BLOCK_K=cfg["BLOCK_K_UP"], **flags, **launch)
    _moe_down_kernel[(num_blocks, triton.cdiv(H, cfg["BLOCK_N_DOWN"]))](
        act, down_proj, sd, topk_weights.contiguous(), y, sorted_ids, expert_ids, T, E, H, I,
        act.stride(0), down_proj.stride(0), down_proj.stride(1), y.stride(0),
        BLOCK_N=cfg["BLOCK_N_DOWN"], BLOCK_K=cfg["BLOCK_K_DOWN"], **flags, **launch)
    return y


def fused_moe_torch(x: Tensor, gate_up_proj: Tensor, down_proj: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                    use_grouped_mm: bool | None = None,
                    shared_expert: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
    """The tensor-core path for sm70 prefill: sort slots by expert, cuBLAS GEMMs per expert group.

    Same numerics as `fused_moe_ref` (GEMM outputs rounded to x.dtype, fp32 weighted sum over k in
    slot order, one rounding). `use_grouped_mm` (default: when `torch._grouped_mm` exists, x is bf16
    and the device is sm90+) runs all experts in two launches instead of a loop; the loop needs the
    per-expert counts on the host (one sync). The shared expert (id E) runs as dense GEMMs over all M
    rows (a token holds id E at most once) and replaces the routed result at its pairs.
    """
    M, H, E, I = _check_moe_args(x, gate_up_proj, down_proj, topk_ids, topk_weights, shared_expert)
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices  # slots grouped by expert; shared (id E) last
    xs = x[order // k]  # [M·k, H]
    # scatter_add, not bincount: no host sync, so the grouped path can be captured in a CUDA graph;
    # the shared expert's pairs fall out of the counts (its bin is dropped)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))[:E]
    arch = _arch(x.device)
    if use_grouped_mm is None:
        use_grouped_mm = hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16 and arch is not None and arch >= 90
    if use_grouped_mm:
        offs = torch.cumsum(counts, 0).to(torch.int32)
        gu = torch._grouped_mm(xs, gate_up_proj.transpose(-2, -1), offs=offs)  # [M·k, 2I]
        gate, up = gu.split(I, dim=-1)
        ys = torch._grouped_mm((F.silu(gate) * up).contiguous(), down_proj.transpose(-2, -1), offs=offs)
    else:
        ys = torch.zeros(M * k, H, dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                gate, up = (xs[start:start + n] @ gate_up_proj[e].t()).split(I, dim=-1)
                ys[start:start + n] = (F.silu(gate) * up) @ down_proj[e].t()
                start += n
    y = torch.empty(M * k, H, dtype=torch.float32, device=x.device)
    y[order] = ys.float()
    y = y.view(M, k, H)
    if shared_expert is not None:
        shared = _swiglu(x, *shared_expert).float()  # [M, H]
        y = torch.where((topk_ids == E)[..., None], shared[:, None, :], y)
    return (y * topk_weights[..., None]).sum(1).to(x.dtype)

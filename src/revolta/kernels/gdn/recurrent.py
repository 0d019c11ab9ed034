"""Gated delta rule, token-by-token Triton kernels on a slot-indexed state pool: decode,
speculative verify, commit and replay-commit (spec/model.md §3.5, spec/performance.md §2.3-2.4).

One kernel does all recurrent work: a program owns one (sequence, value head, BV slice of V),
keeps its [K, BV] fp32 slice of the state in registers and walks the tokens. Flags choose what
leaves the program: outputs, the state after every position (verify, kept for rollback), the
final state written back into the slot (decode, replay). Because verify and replay run this
same code with the same launch configuration, a replayed state is bitwise the kept one.

Pool contract: ssm_state [num_slots, HV, K, V] fp32 contiguous, slots int32 [B], slot 0 a dummy
that padded rows may point at. Inputs: q, k raw per q/k head (GVA: value head i reads q/k head
i // (HV // H)); with use_qk_l2norm they are normalised in fp32 in the kernel,
x / sqrt(Σx² + 1e-6), then q · scale (spec §11.11). g (log decay <= 0) and beta are fp32.
References with the same signatures live in ref.py.

Rollback schemes:
* keep: `gdn_verify(..., draft_states=buf or draft slots)` writes the state after each of the T
  positions (T x 3 MiB per sequence per layer at the real shape), `gdn_commit` copies the accepted
  one into the slot (or the cache simply re-points the slot at the draft slot).
* replay: `gdn_verify(..., draft_states=None)` writes nothing but outputs; `gdn_replay_commit`
  re-runs the accepted prefix from the slot and stores the final state (one extra read of the
  state, no T-fold writes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .gates import gate_values

DRAFT_NONE, DRAFT_BUFFER, DRAFT_SLOTS = 0, 1, 2


@triton.jit
def _gdn_recurrent_fwd_kernel(q, k, v, g, beta, o, ssm_state, slots, draft, draft_slots, num_steps, A_log, dt_bias,
                              scale, T,
                              stride_q_b, stride_q_t, stride_k_b, stride_k_t, stride_v_b, stride_v_t,
                              stride_g_b, stride_g_t, stride_beta_b, stride_beta_t,
                              H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                              BK: tl.constexpr, BV: tl.constexpr, USE_L2NORM: tl.constexpr,
                              STORE_OUTPUT: tl.constexpr, STORE_FINAL: tl.constexpr, DRAFT_MODE: tl.constexpr,
                              LIMIT_STEPS: tl.constexpr, RAW_GATES: tl.constexpr):
    # RAW_GATES: g and beta hold the in-projections' raw a and b; the gates are computed here (gates.py)
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b = (i_bh // HV).to(tl.int64)
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    o_h = i_hv * K * V + o_k[:, None] * V + o_v[None, :]  # [BK, BV] offsets inside one slot

    slot = tl.load(slots + i_b).to(tl.int64)
    b_h = tl.load(ssm_state + slot * (HV * K * V) + o_h, mask=m_h, other=0.0).to(tl.float32)
    n = T
    if LIMIT_STEPS:
        n = tl.minimum(tl.load(num_steps + i_b), T)
    p_q = q + i_b * stride_q_b + i_h * K + o_k
    p_k = k + i_b * stride_k_b + i_h * K + o_k
    p_v = v + i_b * stride_v_b + i_hv * V + o_v
    p_g = g + i_b * stride_g_b + i_hv
    p_beta = beta + i_b * stride_beta_b + i_hv
    if RAW_GATES:
        b_A = tl.load(A_log + i_hv).to(tl.float32)
        b_dt = tl.load(dt_bias + i_hv).to(tl.float32)
    for t in range(0, n):
        b_q = tl.load(p_q + t * stride_q_t, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(p_k + t * stride_k_t, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(p_v + t * stride_v_t, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(p_g + t * stride_g_t).to(tl.float32)
        b_beta = tl.load(p_beta + t * stride_beta_t).to(tl.float32)
        if RAW_GATES:
            b_g, b_beta = gate_values(b_g, b_beta, b_A, b_dt)
        if USE_L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
        b_q = b_q * scale
        # decay first, then the delta update, then the read (spec §3.5)
        b_h = b_h * tl.exp(b_g)
        b_delta = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))  # [BV]
        b_h = b_h + b_k[:, None] * b_delta[None, :]
        i_bt = i_b * T + t
        if STORE_OUTPUT:
            b_o = tl.sum(b_h * b_q[:, None], 0)
            tl.store(o + (i_bt * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        if DRAFT_MODE == 1:
            tl.store(draft + i_bt * (HV * K * V) + o_h, b_h, mask=m_h)
        if DRAFT_MODE == 2:
            d_slot = tl.load(draft_slots + i_bt).to(tl.int64)
            tl.store(ssm_state + d_slot * (HV * K * V) + o_h, b_h, mask=m_h)
    if STORE_FINAL:
        if n > 0:
            tl.store(ssm_state + slot * (HV * K * V) + o_h, b_h, mask=m_h)


@triton.jit
def _gdn_commit_kernel(draft, ssm_state, slots, draft_slots, num_accepted, T, NUMEL: tl.constexpr,
                       DRAFT_MODE: tl.constexpr, BLOCK: tl.constexpr):
    i_blk, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    n = tl.load(num_accepted + i_b)
    if n > 0:
        o_x = i_blk * BLOCK + tl.arange(0, BLOCK)
        m_x = o_x < NUMEL
        src_pos = i_b * T + tl.minimum(n, T) - 1
        if DRAFT_MODE == 1:
            p_src = draft + src_pos * NUMEL
        else:
            p_src = ssm_state + tl.load(draft_slots + src_pos).to(tl.int64) * NUMEL
        b_x = tl.load(p_src + o_x, mask=m_x)
        slot = tl.load(slots + i_b).to(tl.int64)
        tl.store(ssm_state + slot * NUMEL + o_x, b_x, mask=m_x)


def recurrent_config(num_rows: int, V: int, K: int) -> tuple[int, int]:
    """(BV, num_warps) for num_rows = B·HV (sequence, value head) pairs.

    Small batches split V finely so there are enough programs to fill the GPU; each program's
    [K, BV] fp32 state slice stays at <= 32 fp32 registers per thread. Depends only on the
    batch shape, so verify and replay of the same batch use the same configuration (bitwise
    identical states).
    """
    for bv in (64, 32, 16):
        if num_rows * triton.cdiv(V, bv) >= 1024:
            break
    else:
        bv = 8
    bv = min(bv, triton.next_power_of_2(V))
    num_warps = max(1, min(4, triton.next_power_of_2(K) * bv // 1024))
    return bv, num_warps


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ssm_state: Tensor, slots: Tensor,
                  lead: int, raw_gates: tuple[Tensor, Tensor] | None = None):
    """lead = number of leading batch dims (1: [B, ...], 2: [B, T, ...]); raw_gates: (A_log, dt_bias) when g and
    beta are the raw in-projections (any float dtype)."""
    names = "[B, T, " if lead == 2 else "[B, "
    assert q.dim() == lead + 2 and k.shape == q.shape, \
        f"q, k must be {names}H, K], got {tuple(q.shape)} and {tuple(k.shape)}"
    H, K = q.shape[-2:]
    assert v.dim() == lead + 2 and v.shape[:lead] == q.shape[:lead], f"v must be {names}HV, V], got {tuple(v.shape)}"
    HV, V = v.shape[-2:]
    assert HV % H == 0, f"value heads ({HV}) must be a multiple of q/k heads ({H})"
    assert g.shape == v.shape[:-1] and beta.shape == v.shape[:-1], \
        f"g, beta must be {names}HV={HV}], got {tuple(g.shape)} and {tuple(beta.shape)}"
    assert raw_gates is not None or g.dtype == beta.dtype == torch.float32, \
        f"g, beta must be fp32, got {g.dtype}, {beta.dtype}"
    if raw_gates is not None:
        A_log, dt_bias = raw_gates
        assert A_log.shape == dt_bias.shape == (v.shape[-2],) and A_log.dtype == dt_bias.dtype == torch.float32 \
            and A_log.is_contiguous() and dt_bias.is_contiguous(), \
            f"A_log, dt_bias must be contiguous fp32 [HV={v.shape[-2]}], got {A_log.dtype} {tuple(A_log.shape)}"
    assert q.dtype == k.dtype == v.dtype and v.dtype in (torch.float16, torch.bfloat16, torch.float32), \
        f"q, k, v must share one of fp16/bf16/fp32, got {q.dtype}, {k.dtype}, {v.dtype}"
    for name, x, inner in (("q", q, K), ("k", k, K), ("v", v, V)):
        assert x.stride(-1) == 1 and x.stride(-2) == inner, \
            f"{name} must have contiguous heads (strides [..., {inner}, 1]), got {x.stride()}"
    for name, x in (("g", g), ("beta", beta)):
        assert x.stride(-1) == 1, f"{name} must be contiguous over heads, got strides {x.stride()}"
    assert ssm_state.dtype == torch.float32 and ssm_state.dim() == 4 and ssm_state.shape[1:] == (HV, K, V) \
        and ssm_state.is_contiguous(), \
        f"ssm_state must be contiguous fp32 [num_slots, {HV}, {K}, {V}], got {ssm_state.dtype} {tuple(ssm_state.shape)}"
    B = q.shape[0]
    assert slots.dtype == torch.int32 and slots.shape == (B,), \
        f"slots must be int32 [B={B}], got {slots.dtype} {tuple(slots.shape)}"
    devs = {x.device for x in (q, k, v, g, beta, ssm_state, slots)}
    assert len(devs) == 1, f"all tensors must be on one device, got {devs}"
    return B, H, HV, K, V


def _launch(q, k, v, g, beta, o, ssm_state, slots, draft, draft_slots, num_steps, scale, T, store_output,
            store_final, draft_mode, use_qk_l2norm, lead, gates=None):
    B, H, K = q.shape[0], q.shape[-2], q.shape[-1]
    HV, V = v.shape[-2:]
    if B == 0 or T == 0:
        return
    BV, num_warps = recurrent_config(B * HV, V, K)

    def st(x):  # (batch stride, token stride)
        return (x.stride(0), x.stride(1) if lead == 2 else 0)

    dummy = slots
    _gdn_recurrent_fwd_kernel[(triton.cdiv(V, BV), B * HV)](
        q, k, v, g, beta, o if o is not None else v, ssm_state, slots,
        draft if draft is not None else ssm_state, draft_slots if draft_slots is not None else dummy,
        num_steps if num_steps is not None else dummy, *(gates if gates is not None else (g, g)),
        float(K**-0.5 if scale is None else scale), T,
        *st(q), *st(k), *st(v), *st(g), *st(beta),
        H=H, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV, USE_L2NORM=use_qk_l2norm,
        STORE_OUTPUT=store_output, STORE_FINAL=store_final, DRAFT_MODE=draft_mode,
        LIMIT_STEPS=num_steps is not None, RAW_GATES=gates is not None, num_warps=num_warps)


def gdn_recurrent_update(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ssm_state: Tensor,
                         slots: Tensor, scale: float | None = None, use_qk_l2norm: bool = True,
                         gates: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Decode: one token per sequence; the state at slots[b] is read and written in place.

    q, k: [B, H, K]; v: [B, HV, V]; g, beta: [B, HV] fp32; ssm_state [num_slots, HV, K, V] fp32;
    slots int32 [B]; scale defaults to K^-1/2. Returns o [B, HV, V] in v.dtype.
    gates: (A_log, dt_bias) [HV] fp32: g and beta are then the raw in-projections a and b [B, HV] (any float
    dtype, rows may be strided) and the kernel computes the gates as `gdn_gates` does, bit for bit (no launch).
    """
    B, H, HV, K, V = _check_inputs(q, k, v, g, beta, ssm_state, slots, lead=1, raw_gates=gates)
    o = torch.empty(B, HV, V, dtype=v.dtype, device=v.device)
    _launch(q, k, v, g, beta, o, ssm_state, slots, None, None, None, scale, 1, True, True, DRAFT_NONE,
            use_qk_l2norm, lead=1, gates=gates)
    return o



def _draft_mode(draft_states: Tensor | None, B: int, T: int, HV: int, K: int, V: int, device) -> int:
    if draft_states is None:
        return DRAFT_NONE
    assert draft_states.device == device, "draft_states must be on the state pool's device"
    if draft_states.dtype == torch.int32:
        assert draft_states.shape == (B, T) and draft_states.is_contiguous(), \
            f"draft slots must be contiguous int32 [B={B}, T={T}], got {tuple(draft_states.shape)}"
        return DRAFT_SLOTS
    assert draft_states.dtype == torch.float32 and draft_states.shape == (B, T, HV, K, V) \
        and draft_states.is_contiguous(), \
        f"draft_states must be contiguous fp32 [B={B}, T={T}, {HV}, {K}, {V}] or int32 draft slots [B, T], " \
        f"got {draft_states.dtype} {tuple(draft_states.shape)}"
    return DRAFT_BUFFER


def gdn_verify(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ssm_state: Tensor, slots: Tensor,
               scale: float | None = None, draft_states: Tensor | None = None,
               use_qk_l2norm: bool = True) -> Tensor:
    """Speculative verify: T tokens per sequence from the committed state, which is NOT modified.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV] fp32. draft_states chooses the
    rollback scheme: a fp32 buffer [B, T, HV, K, V] (state after every position), int32 draft
    slots [B, T] into ssm_state (vLLM-style; they must differ from `slots`), or None (replay:
    keep nothing, then `gdn_replay_commit`). Returns o [B, T, HV, V] in v.dtype.
    """
    B, H, HV, K, V = _check_inputs(q, k, v, g, beta, ssm_state, slots, lead=2)
    T = q.shape[1]
    mode = _draft_mode(draft_states, B, T, HV, K, V, v.device)
    o = torch.empty(B, T, HV, V, dtype=v.dtype, device=v.device)
    _launch(q, k, v, g, beta, o, ssm_state, slots, draft_states if mode == DRAFT_BUFFER else None,
            draft_states if mode == DRAFT_SLOTS else None, None, scale, T, True, False, mode, use_qk_l2norm, lead=2)
    return o


def gdn_commit(draft_states: Tensor, ssm_state: Tensor, slots: Tensor, num_accepted: Tensor) -> None:
    """ssm_state[slots[b]] <- state after position num_accepted[b] - 1 of the verify (0 = unchanged).

    draft_states: what gdn_verify wrote, the fp32 buffer [B, T, HV, K, V] or int32 draft slots [B, T].
    num_accepted: int32 [B], values in [0, T].
    """
    assert ssm_state.dtype == torch.float32 and ssm_state.dim() == 4 and ssm_state.is_contiguous(), \
        f"ssm_state must be a contiguous fp32 [num_slots, HV, K, V] pool, got {ssm_state.dtype} {tuple(ssm_state.shape)}"
    HV, K, V = ssm_state.shape[1:]
    B = slots.shape[0]
    assert slots.dtype == torch.int32 and slots.dim() == 1, f"slots must be int32 [B], got {slots.dtype}"
    assert draft_states.dim() in (2, 5), f"draft_states must be [B, T, HV, K, V] or [B, T], got {tuple(draft_states.shape)}"
    T = draft_states.shape[1]
    mode = _draft_mode(draft_states, B, T, HV, K, V, ssm_state.device)
    assert num_accepted.dtype == torch.int32 and num_accepted.shape == (B,), \
        f"num_accepted must be int32 [B={B}], got {num_accepted.dtype} {tuple(num_accepted.shape)}"
    if B == 0 or T == 0:
        return
    numel, BLOCK = HV * K * V, 2048
    _gdn_commit_kernel[(triton.cdiv(numel, BLOCK), B)](
        draft_states if mode == DRAFT_BUFFER else ssm_state, ssm_state, slots,
        draft_states if mode == DRAFT_SLOTS else slots, num_accepted, T,
        NUMEL=numel, DRAFT_MODE=mode, BLOCK=BLOCK, num_warps=4)


def gdn_replay_commit(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ssm_state: Tensor, slots: Tensor,
                      num_accepted: Tensor, scale: float | None = None, use_qk_l2norm: bool = True) -> None:
    """Replay rollback: re-run the first num_accepted[b] of the verify tokens (same inputs as
    gdn_verify, [B, T, ...]) from the committed state and store the result in the slot
    (0 = unchanged). Bitwise equal to the state gdn_verify keeps for that position.
    """
    B, H, HV, K, V = _check_inputs(q, k, v, g, beta, ssm_state, slots, lead=2)
    assert num_accepted.dtype == torch.int32 and num_accepted.shape == (B,), \
        f"num_accepted must be int32 [B={B}], got {num_accepted.dtype} {tuple(num_accepted.shape)}"
    _launch(q, k, v, g, beta, None, ssm_state, slots, None, None, num_accepted, scale, q.shape[1], False, True,
            DRAFT_NONE, use_qk_l2norm, lead=2)

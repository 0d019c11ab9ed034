"""Causal depthwise conv1d with carried state (GDN conv, PLE dilated conv). Torch reference."""

from __future__ import annotations

import torch
from torch import Tensor


def causal_conv1d_ref(x: Tensor, weight: Tensor, state: Tensor | None, dilation: int = 1) -> tuple[Tensor, Tensor]:
    """y_t[c] = Σ_j w[c, j] · x_{t - dilation·(W-1-j)}[c]; the last tap multiplies the current input.

    x: [T, C]; weight: [C, W]; state: [S, C] with S = dilation·(W-1) earlier inputs (oldest first;
    None = zeros, i.e. sequence start). Returns (y [T, C] in fp32, no activation; new state [S, C]
    in x.dtype, the last S inputs including the history).
    """
    T, C = x.shape
    W = weight.shape[-1]
    S = dilation * (W - 1)
    if state is None:
        state = x.new_zeros(S, C)
    xs = torch.cat([state.to(x.dtype), x], dim=0)  # [S + T, C]
    xf, wf = xs.float(), weight.float()
    y = torch.zeros(T, C, dtype=torch.float32, device=x.device)
    for j in range(W):
        start = j * dilation  # tap j reads the input (W-1-j)·dilation steps back
        y += xf[start : start + T] * wf[:, j]
    return y, xs[xs.shape[0] - S :].clone()


# ---------------------------------------------------------------------------------------------
# Slot-pool ops: Triton kernels + torch references of the same signature.
#
# Storage contract (shared with cache/): conv_state [num_slots, S, C] in the activation dtype,
# S = dilation·(W-1) pre-activation inputs per slot, oldest first, channels contiguous;
# requests address it through `slots` int32 [B]; slot 0 is a reserved dummy. Token streams are
# flat: x [T, C] with cu_seqlens int32 [B+1]. A sequence of length 0 leaves its slot untouched.
#
# Rollback for speculative decoding replays instead of keeping per-position windows: verify runs
# `causal_conv1d_varlen(..., write_state=False)` over the T verify tokens, and once the number of
# accepted tokens n_b is known `causal_conv1d_commit(x, conv_state, slots, cu_seqlens, n)` rebuilds
# each slot's window from its old window and the first n_b inputs (one small launch, reads only
# S + n_b rows per channel; the caller keeps the verify step's pre-conv x until then).
# ---------------------------------------------------------------------------------------------

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

_ACTIVATIONS = (None, "silu")


def _apply_activation_ref(y: Tensor, activation: str | None) -> Tensor:
    return torch.nn.functional.silu(y) if activation == "silu" else y


def _seq_bounds(cu_seqlens: Tensor) -> list[tuple[int, int]]:
    cu = cu_seqlens.tolist()
    return list(zip(cu[:-1], cu[1:]))


def causal_conv1d_varlen_ref(x: Tensor, weight: Tensor, conv_state: Tensor, slots: Tensor, cu_seqlens: Tensor,
                             has_initial_state: Tensor, activation: str | None = "silu", dilation: int = 1,
                             write_state: bool = True, out: Tensor | None = None,
                             x_copy: Tensor | None = None) -> Tensor:
    """Torch reference of `causal_conv1d_varlen` (same contract; loops over sequences)."""
    y = _conv_out(x, out)
    if x_copy is not None:
        _check_rows("x_copy", x_copy, x)
        x_copy.copy_(x)
    for b, (bos, eos) in enumerate(_seq_bounds(cu_seqlens)):
        if eos == bos:
            continue
        slot = int(slots[b])
        init = conv_state[slot] if bool(has_initial_state[b]) else None
        yb, new_state = causal_conv1d_ref(x[bos:eos], weight, init, dilation)
        y[bos:eos] = _apply_activation_ref(yb, activation).to(x.dtype)
        if write_state:
            conv_state[slot] = new_state.to(conv_state.dtype)
    return y


def causal_conv1d_update_ref(x: Tensor, weight: Tensor, conv_state: Tensor, slots: Tensor,
                             activation: str | None = "silu", dilation: int = 1) -> Tensor:
    """Torch reference of `causal_conv1d_update` (same contract)."""
    y = torch.empty_like(x)
    for b in range(x.shape[0]):
        slot = int(slots[b])
        yb, new_state = causal_conv1d_ref(x[b : b + 1], weight, conv_state[slot], dilation)
        y[b] = _apply_activation_ref(yb[0], activation).to(x.dtype)
        conv_state[slot] = new_state.to(conv_state.dtype)
    return y


def causal_conv1d_commit_ref(x: Tensor, conv_state: Tensor, slots: Tensor, cu_seqlens: Tensor,
                             num_accepted: Tensor) -> None:
    """Torch reference of `causal_conv1d_commit` (same contract)."""
    S = conv_state.shape[1]
    for b, (bos, eos) in enumerate(_seq_bounds(cu_seqlens)):
        n = min(int(num_accepted[b]), eos - bos)
        if n <= 0:
            continue
        slot = int(slots[b])
        window = torch.cat([conv_state[slot], x[bos : bos + n].to(conv_state.dtype)], dim=0)
        conv_state[slot] = window[window.shape[0] - S :].clone()


@triton.jit
def _find_seq(cu_ptr, idx, NUM_SEQ, LOG_NUM_SEQ: tl.constexpr):
    """Largest b in [0, NUM_SEQ) with cu[b] <= idx (binary search; idx may be a scalar or a block)."""
    lo = idx * 0
    hi = lo + NUM_SEQ
    for _ in tl.static_range(LOG_NUM_SEQ):
        mid = (lo + hi) // 2
        go_right = tl.load(cu_ptr + mid) <= idx
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@triton.jit
def _causal_conv1d_varlen_fwd_kernel(x, weight, conv_state, slots, cu_seqlens, has_initial_state, y, x_copy,
                                     T, C, NUM_SEQ, stride_x, stride_y, stride_slot, stride_xc,
                                     W: tl.constexpr, DIL: tl.constexpr, ACT: tl.constexpr,
                                     LOG_NUM_SEQ: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                                     COPY_X: tl.constexpr):
    i_t, i_c = tl.program_id(0), tl.program_id(1)
    S: tl.constexpr = DIL * (W - 1)
    o_t = i_t * BT + tl.arange(0, BT)  # [BT] flat token index
    o_c = i_c * BC + tl.arange(0, BC)  # [BC]
    m_t = o_t < T
    m_c = o_c < C
    i_seq = _find_seq(cu_seqlens, tl.where(m_t, o_t, 0), NUM_SEQ, LOG_NUM_SEQ)
    bos = tl.load(cu_seqlens + i_seq)
    slot = tl.load(slots + i_seq).to(tl.int64)
    init = tl.load(has_initial_state + i_seq).to(tl.int32) != 0
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        src = o_t - DIL * (W - 1 - j)  # token this tap reads; before bos it comes from the slot's window
        in_seq = src >= bos
        b_x = tl.load(x + src.to(tl.int64)[:, None] * stride_x + o_c[None, :],
                      mask=(m_t & in_seq)[:, None] & m_c[None, :], other=0.0)
        if COPY_X and j == W - 1:  # the last tap reads the tile's own inputs: keep them for the commit
            tl.store(x_copy + o_t.to(tl.int64)[:, None] * stride_xc + o_c[None, :], b_x,
                     mask=m_t[:, None] & m_c[None, :])
        b_x = b_x.to(tl.float32)
        row = S + src - bos  # in [0, S) when src < bos
        b_s = tl.load(conv_state + slot[:, None] * stride_slot + row.to(tl.int64)[:, None] * C + o_c[None, :],
                      mask=(m_t & (~in_seq) & init)[:, None] & m_c[None, :], other=0.0).to(tl.float32)
        b_w = tl.load(weight + o_c * W + j, mask=m_c, other=0.0).to(tl.float32)
        acc += (b_x + b_s) * b_w[None, :]
    if ACT:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + o_t.to(tl.int64)[:, None] * stride_y + o_c[None, :], acc.to(y.dtype.element_ty),
             mask=m_t[:, None] & m_c[None, :])


@triton.jit
def _causal_conv1d_state_kernel(x, conv_state, slots, cu_seqlens, has_initial_state, num_keep,
                                C, stride_x, stride_slot,
                                S: tl.constexpr, BS: tl.constexpr, BC: tl.constexpr,
                                USE_INIT_FLAGS: tl.constexpr, USE_NUM_KEEP: tl.constexpr):
    """Slot window <- the last S inputs of [window (or zeros), x[bos : bos + n]]; n = 0 leaves it."""
    i_b, i_c = tl.program_id(0), tl.program_id(1)
    bos = tl.load(cu_seqlens + i_b)
    n = tl.load(cu_seqlens + i_b + 1) - bos
    if USE_NUM_KEEP:
        n = tl.minimum(n, tl.load(num_keep + i_b))
    if n <= 0:
        return
    slot = tl.load(slots + i_b).to(tl.int64)
    o_r = tl.arange(0, BS)  # [BS] new window row
    # a block, not a scalar: the interpreter cannot mix scalar and block masks
    init = o_r >= 0
    if USE_INIT_FLAGS:
        init = (o_r * 0 + tl.load(has_initial_state + i_b).to(tl.int32)) != 0
    o_c = i_c * BC + tl.arange(0, BC)
    m_r = o_r < S
    m_c = o_c < C
    src = n - S + o_r  # position in the sequence this row comes from; < 0 means the old window
    from_x = src >= 0
    b_x = tl.load(x + (bos + src).to(tl.int64)[:, None] * stride_x + o_c[None, :],
                  mask=(m_r & from_x)[:, None] & m_c[None, :], other=0.0)
    b_s = tl.load(conv_state + slot * stride_slot + (S + src).to(tl.int64)[:, None] * C + o_c[None, :],
                  mask=(m_r & (~from_x) & init)[:, None] & m_c[None, :], other=0.0)
    b_new = tl.where(from_x[:, None], b_x.to(tl.float32), b_s.to(tl.float32))
    # every thread must have read the old window before any thread overwrites it (rows shift)
    tl.debug_barrier()
    tl.store(conv_state + slot * stride_slot + o_r[:, None] * C + o_c[None, :],
             b_new.to(conv_state.dtype.element_ty), mask=m_r[:, None] & m_c[None, :])


@triton.jit
def _causal_conv1d_update_kernel(x, weight, conv_state, slots, y, C, stride_x, stride_y, stride_slot,
                                 W: tl.constexpr, DIL: tl.constexpr, ACT: tl.constexpr,
                                 BS: tl.constexpr, BC: tl.constexpr):
    i_b, i_c = tl.program_id(0), tl.program_id(1)
    S: tl.constexpr = DIL * (W - 1)
    slot = tl.load(slots + i_b).to(tl.int64)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    p_state = conv_state + slot * stride_slot
    b_x = tl.load(x + i_b.to(tl.int64) * stride_x + o_c, mask=m_c, other=0.0)
    acc = b_x.to(tl.float32) * tl.load(weight + o_c * W + (W - 1), mask=m_c, other=0.0).to(tl.float32)
    for j in tl.static_range(W - 1):
        b_s = tl.load(p_state + (j * DIL) * C + o_c, mask=m_c, other=0.0).to(tl.float32)
        acc += b_s * tl.load(weight + o_c * W + j, mask=m_c, other=0.0).to(tl.float32)
    if ACT:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + i_b.to(tl.int64) * stride_y + o_c, acc.to(y.dtype.element_ty), mask=m_c)
    # shift the window by one: rows 1..S-1 move up, x becomes the newest row
    o_r = tl.arange(0, BS)
    m_r = o_r < S - 1
    b_keep = tl.load(p_state + (o_r + 1)[:, None] * C + o_c[None, :], mask=m_r[:, None] & m_c[None, :], other=0.0)
    tl.debug_barrier()
    tl.store(p_state + o_r[:, None] * C + o_c[None, :], b_keep, mask=m_r[:, None] & m_c[None, :])
    tl.store(p_state + (S - 1) * C + o_c, b_x.to(conv_state.dtype.element_ty), mask=m_c)


def _check_conv_args(x: Tensor, weight: Tensor, conv_state: Tensor, slots: Tensor, activation, dilation: int):
    assert x.dim() == 2 and x.stride(-1) == 1, f"x must be [T, C] with contiguous channels, got {tuple(x.shape)} " \
                                              f"strides {x.stride()}"
    C = x.shape[1]
    assert weight.dim() == 2 and weight.shape[0] == C and weight.is_contiguous(), \
        f"weight must be contiguous [C={C}, W], got {tuple(weight.shape)}"
    W = weight.shape[1]
    S = dilation * (W - 1)
    assert W >= 2 and dilation >= 1, (W, dilation)
    assert conv_state.dim() == 3 and conv_state.shape[1:] == (S, C) and conv_state.stride()[1:] == (C, 1), \
        f"conv_state must be [num_slots, {S}, {C}] with rows/channels contiguous, got {tuple(conv_state.shape)} " \
        f"strides {conv_state.stride()}"
    assert slots.dtype == torch.int32 and slots.dim() == 1, f"slots must be int32 [B], got {slots.dtype} {tuple(slots.shape)}"
    assert activation in _ACTIVATIONS, f"activation must be one of {_ACTIVATIONS}, got {activation!r}"
    assert x.device == weight.device == conv_state.device == slots.device, "all tensors on one device"
    return C, W, S


def _check_cu_seqlens(cu_seqlens: Tensor, num_seqs: int, device) -> None:
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.dim() == 1 and cu_seqlens.shape[0] == num_seqs + 1, \
        f"cu_seqlens must be int32 [B+1={num_seqs + 1}], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
    assert cu_seqlens.device == device, "cu_seqlens must be on the tensors' device"


def _check_rows(name: str, t: Tensor, x: Tensor) -> None:
    assert t.shape == x.shape and t.dtype == x.dtype and t.stride(-1) == 1 and t.device == x.device, \
        f"{name} must be [T, C] = {tuple(x.shape)} {x.dtype} with contiguous channels, got {tuple(t.shape)} " \
        f"{t.dtype} strides {t.stride()}"


def _conv_out(x: Tensor, out: Tensor | None) -> Tensor:
    if out is None:
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    _check_rows("out", out, x)
    return out


def causal_conv1d_varlen(x: Tensor, weight: Tensor, conv_state: Tensor, slots: Tensor, cu_seqlens: Tensor,
                         has_initial_state: Tensor, activation: str | None = "silu", dilation: int = 1,
                         write_state: bool = True, out: Tensor | None = None,
                         x_copy: Tensor | None = None) -> Tensor:
    """Causal depthwise conv over a flat varlen batch, with per-slot carried windows.

    x: [T, C] (channels contiguous; a column slice of a wider buffer is fine); weight: [C, W]
    (last tap multiplies the current input); conv_state: [num_slots, S, C], S = dilation·(W-1);
    slots: int32 [B]; cu_seqlens: int32 [B+1]; has_initial_state: bool [B] (False = the sequence
    starts here, its window is read as zeros). Returns y [T, C] in x.dtype (fp32 accumulation,
    then the activation). With write_state, slot b's window becomes the last S inputs of
    sequence b (including the old window when the sequence is shorter than S); without it the
    pool is only read (speculative verify; see `causal_conv1d_commit`).
    out: optional [T, C] storage for y (rows may be strided, channels contiguous); x_copy: optional
    [T, C] that also receives x, in the same launch (a verify keeps its pre-conv inputs for the commit
    in storage that outlives the step, spec/graphs.py).
    """
    C, W, S = _check_conv_args(x, weight, conv_state, slots, activation, dilation)
    B = slots.shape[0]
    _check_cu_seqlens(cu_seqlens, B, x.device)
    assert has_initial_state.dtype == torch.bool and has_initial_state.shape == (B,), \
        f"has_initial_state must be bool [B={B}], got {has_initial_state.dtype} {tuple(has_initial_state.shape)}"
    T = x.shape[0]
    y = _conv_out(x, out)
    if x_copy is not None:
        _check_rows("x_copy", x_copy, x)
    if T > 0 and B > 0:
        BT, BC = 16, min(128, triton.next_power_of_2(C))
        grid = (triton.cdiv(T, BT), triton.cdiv(C, BC))
        _causal_conv1d_varlen_fwd_kernel[grid](
            x, weight, conv_state, slots, cu_seqlens, has_initial_state, y, x_copy if x_copy is not None else y,
            T, C, B, x.stride(0), y.stride(0), conv_state.stride(0), (x_copy if x_copy is not None else y).stride(0),
            W=W, DIL=dilation, ACT=activation == "silu", LOG_NUM_SEQ=max(1, (B - 1).bit_length()),
            BT=BT, BC=BC, COPY_X=x_copy is not None, num_warps=4)
        if write_state:
            _launch_state_update(x, conv_state, slots, cu_seqlens, has_initial_state, None, S)
    return y


def _launch_state_update(x, conv_state, slots, cu_seqlens, has_initial_state, num_keep, S):
    B, C = slots.shape[0], x.shape[1]
    BC = min(256, triton.next_power_of_2(C))
    _causal_conv1d_state_kernel[(B, triton.cdiv(C, BC))](
        x, conv_state, slots, cu_seqlens, has_initial_state if has_initial_state is not None else slots,
        num_keep if num_keep is not None else slots, C, x.stride(0), conv_state.stride(0),
        S=S, BS=triton.next_power_of_2(S), BC=BC,
        USE_INIT_FLAGS=has_initial_state is not None, USE_NUM_KEEP=num_keep is not None, num_warps=4)


def causal_conv1d_commit(x: Tensor, conv_state: Tensor, slots: Tensor, cu_seqlens: Tensor,
                         num_accepted: Tensor) -> None:
    """After a verify step run with write_state=False: advance each slot's window by the first
    num_accepted[b] inputs of sequence b (0 = unchanged). x: [T, C] the verify step's pre-conv
    inputs; num_accepted: int32 [B]. In place.
    """
    assert x.dim() == 2 and x.stride(-1) == 1, f"x must be [T, C] with contiguous channels, got {tuple(x.shape)}"
    C = x.shape[1]
    assert conv_state.dim() == 3 and conv_state.shape[2] == C and conv_state.stride()[1:] == (C, 1), \
        f"conv_state must be [num_slots, S, C={C}] rows/channels contiguous, got {tuple(conv_state.shape)}"
    B = slots.shape[0]
    assert slots.dtype == torch.int32 and slots.dim() == 1, f"slots must be int32 [B], got {slots.dtype}"
    _check_cu_seqlens(cu_seqlens, B, x.device)
    assert num_accepted.dtype == torch.int32 and num_accepted.shape == (B,), \
        f"num_accepted must be int32 [B={B}], got {num_accepted.dtype} {tuple(num_accepted.shape)}"
    if B > 0:
        _launch_state_update(x, conv_state, slots, cu_seqlens, None, num_accepted, conv_state.shape[1])


def causal_conv1d_update(x: Tensor, weight: Tensor, conv_state: Tensor, slots: Tensor,
                         activation: str | None = "silu", dilation: int = 1) -> Tensor:
    """Decode step: one new input per sequence. x: [B, C]; conv_state [num_slots, S, C] is advanced
    in place by one input at slots[b]. Returns y [B, C] in x.dtype.
    """
    C, W, S = _check_conv_args(x, weight, conv_state, slots, activation, dilation)
    B = x.shape[0]
    assert slots.shape[0] == B, f"slots must have B={B} entries, got {slots.shape[0]}"
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if B > 0:
        BC = min(256, triton.next_power_of_2(C))
        _causal_conv1d_update_kernel[(B, triton.cdiv(C, BC))](
            x, weight, conv_state, slots, y, C, x.stride(0), y.stride(0), conv_state.stride(0),
            W=W, DIL=dilation, ACT=activation == "silu", BS=triton.next_power_of_2(max(S - 1, 1)), BC=BC,
            num_warps=4)
    return y

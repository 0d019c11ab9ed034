"""Torch references of the gated delta rule for one sequence, fp32 throughout.

Inputs are already prepared: q and k L2-normalised (q also scaled by K^-1/2), heads
expanded to the value heads. State layout is [HV, K, V] (FLA's and HF's default).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .gates import gdn_gates_ref


def recurrent_gated_delta_rule_ref(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                                   state: Tensor) -> tuple[Tensor, Tensor]:
    """Token-by-token definition: S <- e^g S; S <- S + k (β (v - Sᵀk))ᵀ; o = Sᵀ q.

    q, k: [T, HV, K]; v: [T, HV, V]; g, beta: [T, HV]; state: [HV, K, V].
    Returns (o [T, HV, V] fp32, final state [HV, K, V] fp32). The input state is not modified.
    """
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    s = state.float().clone()
    out = []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        kv_mem = torch.einsum("hkv,hk->hv", s, k[t])
        delta = beta[t][:, None] * (v[t] - kv_mem)  # [HV, V]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(out) if out else v.new_zeros(v.shape, dtype=torch.float32), s


def chunk_gated_delta_rule_ref(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                               chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """Chunked (WY/UT) form of the same recurrence; equal up to float reassociation.

    Same shapes and contract as `recurrent_gated_delta_rule_ref`, with optional leading batch dims on every
    argument (q, k: [..., T, HV, K], state: [..., HV, K, V]: independent sequences of equal length, e.g. a
    training batch). Differentiable (autograd), so training runs on it.
    """
    *lead, T, HV, K = k.shape
    V = v.shape[-1]
    C = chunk_size
    pad = (-T) % C
    # [..., HV, T, *] head-major; padding rows have k = v = 0, β = 0, g = 0 and change nothing
    q, k, v = (torch.nn.functional.pad(t.float(), (0, 0, 0, 0, 0, pad)).transpose(-3, -2) for t in (q, k, v))
    g, beta = (torch.nn.functional.pad(t.float(), (0, 0, 0, pad)).transpose(-1, -2) for t in (g, beta))
    s = state.float().clone()
    out = torch.empty(*lead, HV, T + pad, V, dtype=torch.float32, device=v.device)
    eye = torch.eye(C, dtype=torch.float32, device=v.device)
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=v.device), diagonal=-1)
    incl = torch.tril(torch.ones(C, C, dtype=torch.bool, device=v.device))
    for c0 in range(0, T + pad, C):
        qc, kc, vc = (t[..., c0 : c0 + C, :] for t in (q, k, v))  # [..., HV, C, *]
        gc, bc = g[..., c0 : c0 + C], beta[..., c0 : c0 + C]  # [..., HV, C]
        gam = gc.cumsum(-1)  # γ_i = Σ_{j<=i} g_j
        diff = (gam[..., :, None] - gam[..., None, :]).masked_fill(~incl, float("-inf"))
        decay = diff.exp()  # Γ_ij = e^{γ_i - γ_j} for i >= j, else 0
        a = (bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * decay).masked_fill(~strict, 0.0)
        t_inv = torch.linalg.solve_triangular(eye + a, eye.expand(*lead, HV, C, C), upper=False, unitriangular=True)
        u = t_inv @ (bc[..., None] * vc)  # new values
        w = t_inv @ ((bc * gam.exp())[..., None] * kc)  # decayed keys
        v_new = u - w @ s  # [..., HV, C, V]
        attn = (qc @ kc.transpose(-1, -2)) * decay  # includes the diagonal
        out[..., c0 : c0 + C, :] = (qc * gam.exp()[..., None]) @ s + attn @ v_new
        last = gam[..., -1:]  # γ_C
        s = s * last.exp()[..., None] + (kc * (last - gam).exp()[..., None]).transpose(-1, -2) @ v_new
    return out[..., :T, :].transpose(-3, -2), s


# ---------------------------------------------------------------------------------------------
# Slot-pool / varlen wrappers: the torch references of the Triton ops in recurrent.py and
# chunk.py, with the same signatures. The pool `ssm_state [num_slots, HV, K, V]` fp32 is
# addressed by `slots` int32 [B]; q/k are raw (per q/k head, not expanded to the value heads)
# and, with use_qk_l2norm, normalised here: x / sqrt(Σx² + 1e-6), then q · scale.
# ---------------------------------------------------------------------------------------------


def _prepare_qk(q: Tensor, k: Tensor, num_v_heads: int, scale: float | None, use_qk_l2norm: bool):
    """[..., H, K] raw q, k -> fp32 [..., HV, K] normalised, q scaled, heads repeat-interleaved."""
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    rep = num_v_heads // q.shape[-2]
    return (q * scale).repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)


def gdn_recurrent_update_ref(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ssm_state: Tensor,
                             slots: Tensor, scale: float | None = None, use_qk_l2norm: bool = True,
                             gates: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """One decode token per sequence. q, k: [B, H, K]; v: [B, HV, V]; g, beta: [B, HV] fp32;
    ssm_state: [num_slots, HV, K, V] fp32, updated in place at slots[b]. Returns o [B, HV, V] (v.dtype).
    gates: (A_log, dt_bias): g and beta are the raw in-projections a and b (gates.gdn_gates_ref makes the gates).
    """
    if gates is not None:
        g, beta = gdn_gates_ref(g, beta, *gates)
    o = gdn_verify_ref(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], ssm_state, slots, scale,
                       None, use_qk_l2norm, _commit_all=True)
    return o[:, 0]


def gdn_verify_ref(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ssm_state: Tensor, slots: Tensor,
                   scale: float | None = None, draft_states: Tensor | None = None, use_qk_l2norm: bool = True,
                   _commit_all: bool = False) -> Tensor:
    """T tokens per sequence from the committed state, which stays unmodified.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV]. draft_states: None (keep nothing: the
    replay scheme), a fp32 buffer [B, T, HV, K, V] that receives the state after every position, or
    int32 [B, T] draft slots into ssm_state that receive them. Returns o [B, T, HV, V] (v.dtype).
    """
    B, T, HV = v.shape[:3]
    qe, ke = _prepare_qk(q, k, HV, scale, use_qk_l2norm)
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for b in range(B):
        s = ssm_state[int(slots[b])]
        for t in range(T):
            ob, s = recurrent_gated_delta_rule_ref(qe[b, t : t + 1], ke[b, t : t + 1], v[b, t : t + 1],
                                                   g[b, t : t + 1], beta[b, t : t + 1], s)
            o[b, t] = ob[0].to(v.dtype)
            if draft_states is not None and draft_states.is_floating_point():
                draft_states[b, t] = s
            elif draft_states is not None:
                ssm_state[int(draft_states[b, t])] = s
        if _commit_all and T > 0:
            ssm_state[int(slots[b])] = s
    return o


def gdn_commit_ref(draft_states: Tensor, ssm_state: Tensor, slots: Tensor, num_accepted: Tensor) -> None:
    """ssm_state[slots[b]] <- the state after position num_accepted[b] - 1 (0 = unchanged).

    draft_states: the fp32 buffer [B, T, HV, K, V] or the int32 [B, T] draft slots given to gdn_verify.
    """
    for b in range(slots.shape[0]):
        n = int(num_accepted[b])
        if n <= 0:
            continue
        src = draft_states[b, n - 1] if draft_states.is_floating_point() else ssm_state[int(draft_states[b, n - 1])]
        ssm_state[int(slots[b])] = src


def gdn_replay_commit_ref(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ssm_state: Tensor,
                          slots: Tensor, num_accepted: Tensor, scale: float | None = None,
                          use_qk_l2norm: bool = True) -> None:
    """Re-run the first num_accepted[b] tokens of each sequence (inputs as in gdn_verify) from the
    committed state and store the result in place (0 = unchanged). Produces no output."""
    B, T, HV = v.shape[:3]
    qe, ke = _prepare_qk(q, k, HV, scale, use_qk_l2norm)
    for b in range(B):
        n = min(int(num_accepted[b]), T)
        if n <= 0:
            continue
        slot = int(slots[b])
        s = ssm_state[slot]
        for t in range(n):  # token by token, like the kernel
            _, s = recurrent_gated_delta_rule_ref(qe[b, t : t + 1], ke[b, t : t + 1], v[b, t : t + 1],
                                                  g[b, t : t + 1], beta[b, t : t + 1], s)
        ssm_state[slot] = s


def gdn_chunk_prefill_ref(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                          ssm_state: Tensor, slots: Tensor, has_initial_state: Tensor, scale: float | None = None,
                          use_qk_l2norm: bool = True, host_cu_seqlens: Sequence[int] | None = None) -> Tensor:
    """Varlen prefill. q, k: [T, H, K]; v: [T, HV, V]; g, beta: [T, HV] fp32; cu_seqlens int32 [B+1];
    has_initial_state bool [B] (False: start from zeros). Final states are written to slots[b]
    (a sequence of length 0 leaves its slot untouched). Returns o [T, HV, V] (v.dtype).
    host_cu_seqlens: the kernel's scheduling hint (chunk.py), unused here.
    """
    HV = v.shape[1]
    qe, ke = _prepare_qk(q, k, HV, scale, use_qk_l2norm)
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    cu = cu_seqlens.tolist()
    for b in range(len(cu) - 1):
        bos, eos = cu[b], cu[b + 1]
        if eos == bos:
            continue
        slot = int(slots[b])
        s0 = ssm_state[slot] if bool(has_initial_state[b]) else torch.zeros_like(ssm_state[slot])
        ob, s = chunk_gated_delta_rule_ref(qe[bos:eos], ke[bos:eos], v[bos:eos], g[bos:eos], beta[bos:eos], s0)
        o[bos:eos] = ob.to(v.dtype)
        ssm_state[slot] = s
    return o

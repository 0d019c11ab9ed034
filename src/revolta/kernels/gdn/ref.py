"""Torch references of the gated delta rule for one sequence, fp32 throughout.

Inputs are already prepared: q and k L2-normalised (q also scaled by K^-1/2), heads
expanded to the value heads. State layout is [HV, K, V] (FLA's and HF's default).
"""

from __future__ import annotations

import torch
from torch import Tensor


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

    Same shapes and contract as `recurrent_gated_delta_rule_ref`.
    """
    T, HV, K = k.shape
    V = v.shape[-1]
    C = chunk_size
    pad = (-T) % C
    # [HV, T, *] head-major; padding rows have k = v = 0, β = 0, g = 0 and change nothing
    q, k, v = (torch.nn.functional.pad(t.float(), (0, 0, 0, 0, 0, pad)).transpose(0, 1) for t in (q, k, v))
    g, beta = (torch.nn.functional.pad(t.float(), (0, 0, 0, pad)).t() for t in (g, beta))
    s = state.float().clone()
    out = torch.empty(HV, T + pad, V, dtype=torch.float32, device=v.device)
    eye = torch.eye(C, dtype=torch.float32, device=v.device)
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=v.device), diagonal=-1)
    incl = torch.tril(torch.ones(C, C, dtype=torch.bool, device=v.device))
    for c0 in range(0, T + pad, C):
        qc, kc, vc = q[:, c0 : c0 + C], k[:, c0 : c0 + C], v[:, c0 : c0 + C]  # [HV, C, *]
        gc, bc = g[:, c0 : c0 + C], beta[:, c0 : c0 + C]  # [HV, C]
        gam = gc.cumsum(-1)  # γ_i = Σ_{j<=i} g_j
        diff = (gam[:, :, None] - gam[:, None, :]).masked_fill(~incl, float("-inf"))
        decay = diff.exp()  # Γ_ij = e^{γ_i - γ_j} for i >= j, else 0
        a = (bc[:, :, None] * (kc @ kc.transpose(-1, -2)) * decay).masked_fill(~strict, 0.0)
        t_inv = torch.linalg.solve_triangular(eye + a, eye.expand(HV, C, C), upper=False, unitriangular=True)
        u = t_inv @ (bc[..., None] * vc)  # new values
        w = t_inv @ ((bc * gam.exp())[..., None] * kc)  # decayed keys
        v_new = u - w @ s  # [HV, C, V]
        attn = (qc @ kc.transpose(-1, -2)) * decay  # includes the diagonal
        out[:, c0 : c0 + C] = (qc * gam.exp()[..., None]) @ s + attn @ v_new
        last = gam[:, -1:]  # γ_C
        s = s * last.exp()[..., None] + (kc * (last - gam).exp()[..., None]).transpose(-1, -2) @ v_new
    return out[:, :T].transpose(0, 1), s

"""Gated DeltaNet mixer (spec/model.md §3), torch path.

Per token: in-projections -> causal depthwise conv (q, k, v only) + SiLU -> L2-normed q, k
-> gated delta rule with fp32 state -> RMS-normed output gated by act(z) -> out_proj.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import TextConfig
from ..forward import ForwardMeta, GDNRecord
from ..kernels.conv1d import causal_conv1d_ref
from ..kernels.gdn import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref
from ..state import GDNState
from .merged_linear import MergedLinear, MergedQuant, merge_linears, merge_quant_linears, project
from .norm import GatedRMSNorm


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(Σx² + eps) over the last dim, fp32 (eps on the sum, spec §11.11)."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int):
        super().__init__()
        self.state_key, self.layer_idx = f"gdn{layer_idx}", layer_idx
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim, self.conv_dim = cfg.gdn_key_dim, cfg.gdn_value_dim, cfg.gdn_conv_dim
        self.conv_kernel = cfg.linear_conv_kernel_dim
        d = cfg.hidden_size
        self.in_proj_qkv = nn.Linear(d, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(d, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(d, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(d, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel, groups=self.conv_dim, bias=False)
        # decay parameters stay fp32 whatever the model dtype (spec §2.6); see FlashNextModel.to_dtype
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps, cfg.output_gate_type)
        self.out_proj = nn.Linear(self.value_dim, d, bias=False)
        self.merged_in_proj: MergedLinear | None = None  # see merge_projections (not a parameter: names unchanged)
        self.merged_packed_in_proj: MergedQuant | None = None  # the packed (quantized) parts' merge

    def in_projections(self) -> tuple[nn.Module, ...]:
        """The projections that read the block input, in the order `forward` unpacks them."""
        return self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a

    def merge_projections(self) -> None:
        """One GEMM for the four input projections from now on, and one packed GEMV for those stored quantized
        (layers/merged_linear.py); call after the weights are loaded (ModelRunner and the loaders do). Idempotent."""
        parts = self.in_projections()
        self.merged_in_proj = merge_linears(parts, self.merged_in_proj)
        self.merged_packed_in_proj = merge_quant_linears(parts, self.merged_packed_in_proj)

    def new_state(self, device, dtype) -> GDNState:
        return GDNState(
            conv=torch.zeros(self.conv_kernel - 1, self.conv_dim, device=device, dtype=dtype),
            recurrent=torch.zeros(self.num_v_heads, self.head_k_dim, self.head_v_dim, device=device,
                                  dtype=torch.float32),
        )

    def forward(self, x: Tensor, meta: ForwardMeta) -> Tensor:
        """x: [T, d] block input of all sequences -> [T, d]."""
        # [T, conv_dim] pre-conv q ‖ k ‖ v, [T, value_dim], [T, HV] x 2: column views of one GEMM once merged
        mixed, z, b, a = project(self.in_projections(), (self.merged_in_proj, self.merged_packed_in_proj), x)
        ops = meta.paged.ops if meta.paged is not None else None
        if ops is not None and ops.gdn_gates is not None and meta.paged.is_decode:
            g, beta = a, b  # raw: the recurrent decode kernel makes the gates
        elif ops is not None and ops.gdn_gates is not None:  # one launch instead of eight tiny ones
            g, beta = ops.gdn_gates(a, b, self.A_log, self.dt_bias)
        else:
            beta = torch.sigmoid(b.float())  # [T, HV]
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # [T, HV]
        if meta.paged is not None and meta.paged.spec is not None:
            out = self._mix_verify(mixed, g, beta, meta)
        elif meta.paged is not None:
            out = self._mix_paged(mixed, g, beta, meta)
        elif meta.uniform_fresh:
            out = self._mix_batch(mixed, g, beta, meta)
        else:
            out = self._mix_states(mixed, g, beta, meta)
        z = z.unflatten(-1, (self.num_v_heads, self.head_v_dim))
        if ops is not None and ops.gated_rms_norm is not None:  # the fused kernel, one rounding; z goes strided
            y = ops.gated_rms_norm(out.contiguous(), self.norm.weight, z, self.norm.eps, self.norm.activation)
        else:
            y = self.norm(out, z.float())  # [T, HV, V], fp32 chain
        return self.out_proj(y.to(x.dtype).flatten(-2))

    def _mix_paged(self, mixed: Tensor, g: Tensor, beta: Tensor, meta: ForwardMeta) -> Tensor:
        """Conv + delta rule on the slot-indexed state pools of the paged cache -> o [T, HV, V]."""
        pm = meta.paged
        cache = pm.storage.gdn[self.layer_idx]
        conv_w = self.conv1d.weight[:, 0, :]
        T = mixed.shape[0]
        if pm.is_decode:  # one token per sequence: the in-place update kernels
            conv_out = pm.ops.causal_conv1d_update(mixed, conv_w, cache.conv_state, pm.slots, activation="silu")
        else:
            conv_out = pm.ops.causal_conv1d_varlen(mixed, conv_w, cache.conv_state, pm.slots, pm.cu_seqlens,
                                                   pm.has_initial_state, activation="silu")
        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(T, self.num_k_heads, self.head_k_dim)
        k = k.reshape(T, self.num_k_heads, self.head_k_dim)
        v = v.reshape(T, self.num_v_heads, self.head_v_dim)
        scale = self.head_k_dim**-0.5
        if pm.is_decode:  # with the gate kernel, g and beta are the raw projections (see forward)
            gates = (self.A_log, self.dt_bias) if pm.ops.gdn_gates is not None else None
            return pm.ops.gdn_recurrent_update(q, k, v, g, beta, cache.ssm_state, pm.slots, scale, gates=gates)
        return pm.ops.gdn_chunk_prefill(q, k, v, g, beta, pm.cu_seqlens, cache.ssm_state, pm.slots,
                                        pm.has_initial_state, scale, host_cu_seqlens=meta.cu_seqlens)

    def _mix_verify(self, mixed: Tensor, g: Tensor, beta: Tensor, meta: ForwardMeta) -> Tensor:
        """Speculative verify on the paged cache: every row computed like a single-token decode
        (token-by-token recurrence from the committed state), nothing committed -> o [T, HV, V].
        The commit (spec/commit.py) uses what this records, kept where the conv and stack write it
        (VerifyMeta.record_buffer: no copies in the round graphs)."""
        pm, sv = meta.paged, meta.paged.spec
        cache = pm.storage.gdn[self.layer_idx]
        conv_w = self.conv1d.weight[:, 0, :]
        T, HV, key, replay = mixed.shape[0], self.num_v_heads, self.state_key, sv.draft_slots is None
        kept = sv.record_buffer(f"{key}.mixed", mixed.shape, mixed.dtype, mixed.device)
        conv_out = sv.record_buffer(f"{key}.conv_out", mixed.shape, mixed.dtype, mixed.device) if replay else None
        conv_out = pm.ops.causal_conv1d_varlen(mixed, conv_w, cache.conv_state, pm.slots, pm.cu_seqlens,
                                               pm.has_initial_state, activation="silu", write_state=False,
                                               out=conv_out, x_copy=kept)
        if replay:  # g and beta side by side in one record: [T, 2, HV]
            g, beta = torch.stack((g, beta), dim=1, out=sv.record_buffer(f"{key}.g_beta", (T, 2, HV), g.dtype,
                                                                         g.device)).unbind(1)
        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = sv.pad(q.unflatten(-1, (self.num_k_heads, self.head_k_dim)))  # [B, R, H, K]
        k = sv.pad(k.unflatten(-1, (self.num_k_heads, self.head_k_dim)))
        v = sv.pad(v.unflatten(-1, (HV, self.head_v_dim)))  # [B, R, HV, V]
        g, beta = sv.pad(g), sv.pad(beta)  # [B, R, HV] fp32
        scale = self.head_k_dim**-0.5
        o = pm.ops.gdn_verify(q, k, v, g, beta, cache.ssm_state, pm.slots, scale, draft_states=sv.draft_slots)
        sv.record[key] = GDNRecord(self.layer_idx, kept, (q, k, v, g, beta) if replay else None, scale)
        return sv.unpad(o)

    def _mix_states(self, mixed: Tensor, g: Tensor, beta: Tensor, meta: ForwardMeta) -> Tensor:
        """Conv + delta rule with per-sequence state objects (the simple torch path) -> o [T, HV, V]."""
        out = torch.empty(mixed.shape[0], self.num_v_heads, self.head_v_dim, dtype=torch.float32,
                          device=mixed.device)
        conv_w = self.conv1d.weight[:, 0, :]  # [conv_dim, W]
        for _, start, end, seq in meta.seq_slices():
            st = seq.layers.get(self.state_key)
            if st is None:
                st = seq.layers[self.state_key] = self.new_state(mixed.device, mixed.dtype)
            conv_out, st.conv = causal_conv1d_ref(mixed[start:end], conv_w, st.conv)
            q, k, v = F.silu(conv_out).to(mixed.dtype).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
            n = end - start
            rep = self.num_v_heads // self.num_k_heads  # v-head i reads k-head i // rep (repeat-interleave)
            q = l2_normalize(q.reshape(n, self.num_k_heads, self.head_k_dim)) * self.head_k_dim**-0.5
            k = l2_normalize(k.reshape(n, self.num_k_heads, self.head_k_dim))
            q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
            v = v.reshape(n, self.num_v_heads, self.head_v_dim)
            rule = recurrent_gated_delta_rule_ref if n == 1 else chunk_gated_delta_rule_ref
            o, st.recurrent = rule(q, k, v, g[start:end], beta[start:end], st.recurrent)
            out[start:end] = o
        return out

    def _mix_batch(self, mixed: Tensor, g: Tensor, beta: Tensor, meta: ForwardMeta) -> Tensor:
        """`_mix_states` for B fresh sequences of equal length S, run as one [B, S] batch (training) -> o [T, HV, V].
        Same arithmetic as the per-sequence path (zero conv history, zero state); the states are kept as there."""
        B = meta.num_seqs
        S = mixed.shape[0] // B
        W = self.conv_kernel
        x = mixed.view(B, S, -1)
        xs = F.pad(x, (0, 0, W - 1, 0))  # [B, W - 1 + S, C]: zero history, as causal_conv1d_ref with no state
        xf, wf = xs.float(), self.conv1d.weight[:, 0, :].float()
        conv_out = sum(xf[:, j : j + S] * wf[:, j] for j in range(W))  # [B, S, C] fp32
        q, k, v = F.silu(conv_out).to(mixed.dtype).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        rep = self.num_v_heads // self.num_k_heads
        q = l2_normalize(q.unflatten(-1, (self.num_k_heads, self.head_k_dim))) * self.head_k_dim**-0.5
        k = l2_normalize(k.unflatten(-1, (self.num_k_heads, self.head_k_dim)))
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        v = v.unflatten(-1, (self.num_v_heads, self.head_v_dim))
        state = torch.zeros(B, self.num_v_heads, self.head_k_dim, self.head_v_dim, device=mixed.device)
        o, s = chunk_gated_delta_rule_ref(q, k, v, g.view(B, S, -1), beta.view(B, S, -1), state)
        for b, _, _, seq in meta.seq_slices():
            seq.layers[self.state_key] = GDNState(conv=xs[b, xs.shape[1] - (W - 1):].clone(), recurrent=s[b])
        return o.flatten(0, 1)

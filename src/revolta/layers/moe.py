"""Mixture of experts with a sigmoid-gated shared expert (spec §6). Torch reference path."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .merged_linear import MergedLinear, merge_linears, project


class SwiGLU(nn.Module):
    """A dense SwiGLU MLP: down(silu(gate(x)) * up(x)). Names match `shared_expert.*`."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """Routed experts in the checkpoint's grouped layout ([out, in] per expert).

    gate_up_proj: [E, 2I, H] (gate rows, then up rows); down_proj: [E, H, I].
    """

    packed = False  # MoE.forward: kernel_weights() go to ops.fused_moe (quant_moe.QuantExperts: ops.quant_fused_moe)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.intermediate_size = intermediate_size

    def kernel_weights(self) -> tuple[Tensor, Tensor]:
        """What kernels.moe.fused_moe takes: gate_up [E, 2I, H], down [E, H, I]."""
        return self.gate_up_proj, self.down_proj

    def kernel_shared(self, se: SwiGLU) -> tuple[Tensor, Tensor, Tensor] | None:
        """The shared expert's (gate, up, down) weights when it can ride in fused_moe as expert E (16-bit, the
        routed experts' width), else None (it runs as its own SwiGLU)."""
        width = (self.intermediate_size, self.gate_up_proj.shape[-1])
        if type(se.gate_proj) is nn.Linear and se.gate_proj.weight.shape == width:
            return se.gate_proj.weight, se.up_proj.weight, se.down_proj.weight
        return None

    def forward(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        """x: [T, H]; topk_ids/topk_weights: [T, k] -> Σ_k w_k E_{id_k}(x), accumulated in fp32, [T, H] fp32."""
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        # loop over experts that received tokens (the torch reference; kernels come later)
        for e in torch.unique(topk_ids).tolist():
            token_idx, slot = torch.nonzero(topk_ids == e, as_tuple=True)
            xe = x[token_idx]  # [n, H]
            gate, up = (xe @ self.gate_up_proj[e].t()).split(self.intermediate_size, dim=-1)
            ye = (F.silu(gate) * up) @ self.down_proj[e].t()  # [n, H]
            # a token picks an expert at most once, so token_idx has no repeats and a plain indexed add is
            # exact; on CPU it is ~100x faster than index_add_ at decode sizes
            out[token_idx] += ye.float() * topk_weights[token_idx, slot, None]
        return out


class MoE(nn.Module):
    """softmax(router) over all experts -> top-k -> renormalise; plus σ(w·x)-gated shared expert."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 shared_intermediate_size: int, norm_topk_prob: bool = True):
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden_size, intermediate_size)
        self.shared_expert = SwiGLU(hidden_size, shared_intermediate_size)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.merged_router: MergedLinear | None = None  # see merge_projections (not a parameter: names unchanged)

    def router_projections(self) -> tuple[nn.Module, nn.Module]:
        """The router and the shared expert's gate: both read the block input (logits [T, E] and [T, 1])."""
        return self.gate, self.shared_expert_gate

    def merge_projections(self) -> None:
        """One GEMM for the router and the shared-expert gate on the kernel path (layers/merged_linear.py: a
        launch fewer per MoE block at decode); call after the weights are loaded. Idempotent."""
        self.merged_router = merge_linears(self.router_projections(), self.merged_router)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x: [T, H] -> (topk_ids [T, k] long, topk_weights [T, k] fp32)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # over all experts, before top-k
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return ids, weights

    def forward(self, x: Tensor, ops=None) -> Tensor:
        """x: [T, H] -> [T, H]. ops: a kernels.ops.KernelOps whose routing and fused expert GEMMs
        (Triton; packed experts: quant_fused_moe) replace the torch reference."""
        if ops is not None and ops.fused_moe is not None:
            return self._fused(x, ops)
        ids, weights = self.route(x)
        routed = self.experts(x, ids, weights)  # [T, H] fp32
        shared = torch.sigmoid(self.shared_expert_gate(x).float()) * self.shared_expert(x).float()
        return (routed + shared).to(x.dtype)

    def _fused(self, x: Tensor, ops) -> Tensor:
        # the routing kernel reads the logits in their dtype and converts as it loads (no cast launch; exact) and
        # takes row strides: once merged, logits [T, E] and the shared gate's [T, 1] are column views of one GEMM
        x = x.contiguous()
        logits, shared_logit = project(self.router_projections(), self.merged_router, x)
        fused_moe = ops.quant_fused_moe if self.experts.packed else ops.fused_moe
        gate_up, down = self.experts.kernel_weights()
        shared = self.experts.kernel_shared(self.shared_expert)
        if shared is not None:
            # the shared expert rides in the same launches as expert number E (one rounding at the end)
            ids, weights = ops.moe_route(logits, self.top_k, self.norm_topk_prob, shared_logits=shared_logit[:, 0])
            return fused_moe(x, gate_up, down, ids, weights, shared_expert=shared)
        ids, weights = ops.moe_route(logits, self.top_k, self.norm_topk_prob)
        routed = fused_moe(x, gate_up, down, ids, weights).float()
        shared = torch.sigmoid(shared_logit.float()) * self.shared_expert(x).float()
        return (routed + shared).to(x.dtype)

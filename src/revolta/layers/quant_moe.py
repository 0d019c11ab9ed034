"""Routed experts stored packed (revolta.quant formats), in the grouped layout of `moe.Experts`.

gate_up_proj / down_proj hold one packed linear per expert, stacked: gate_up_proj is the [2I, H] linear of
gate rows then up rows (per-linear values such as NVFP4 global scales kept per projection, [E, 2]),
down_proj the [H, I] linear. On disk either layout loads: per expert
(`experts.{e}.{gate,up,down}_proj.<tensor>`, assembled by `disk_piece`) or fused
(`experts.gate_up_proj.<tensor>` [E, ...], `experts.down_proj.<tensor>` [E, ...]).

forward is the torch reference: only the experts that received tokens are dequantized (one at a time, to
the activation dtype) and multiplied, with exactly the arithmetic of `moe.Experts` (it syncs on the touched
expert ids). On the Triton op table `MoE.forward` instead passes `kernel_weights()` (the packed tensors as
kernels.quant.moe.PackedWeights) to `quant_fused_moe`, which decodes each weight tile right after loading it,
reads each touched expert's packed bytes once per call and has no host sync at decode sizes, so quantized MoE
layers run inside CUDA graphs; a shared expert packed in the same format rides along as expert E
(`kernel_shared`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels.quant.moe import PackedWeights
from ..quant.format import TensorSpec, WeightFormat
from .linear import QuantLinear

SPLITK_COUNTERS = 4096  # int32 counters a packed MoE layer owns for its kernels' fused split-K reduces


class PackedExpertWeights(nn.Module):
    """One packed linear per expert: every tensor of the format's `specs` with a leading [E] axis."""

    def __init__(self, num_experts: int, specs: dict[str, TensorSpec]):
        super().__init__()
        self.specs = specs
        for name, spec in specs.items():
            self.register_buffer(name, torch.empty((num_experts, *spec.shape), dtype=spec.dtype))

    @property
    def disk_dtype_tensors(self) -> tuple[str, ...]:
        return tuple(self.specs)

    def packed(self, e: int | None = None) -> dict[str, Tensor]:
        """All experts' tensors, or expert e's."""
        return {n: getattr(self, n) if e is None else getattr(self, n)[e] for n in self.specs}


class QuantExperts(nn.Module):
    packed = True  # MoE.forward: kernel_weights() go to ops.quant_fused_moe, not the 16-bit fused_moe

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, fmt: WeightFormat):
        super().__init__()
        self.fmt, self.hidden_size, self.intermediate_size = fmt, hidden_size, intermediate_size
        self.gate_up_proj = PackedExpertWeights(num_experts, fmt.specs(2 * intermediate_size, hidden_size, shards=2))
        self.down_proj = PackedExpertWeights(num_experts, fmt.specs(hidden_size, intermediate_size))
        # the kernels' fused split-K reduces count here (kernels/quant/common.py splitk_fixup: zero between launches;
        # a launch needing more allocates its own): 40 tokens x 11 pairs x 3 tiles of ffn 640 at the real shapes
        self.register_buffer("splitk_counters", torch.zeros(SPLITK_COUNTERS, dtype=torch.int32), persistent=False)

    def init_buffers(self) -> None:
        """Zero the split-K counters (after `to_empty` / materialize from the meta device)."""
        if not self.splitk_counters.is_meta:
            self.splitk_counters.zero_()

    def disk_piece(self, e: int, proj: str, tensor: str) -> tuple[str, tuple] | None:
        """Where the per-expert tensor `experts.{e}.{proj}.{tensor}` goes: (holder.tensor, index), or None."""
        holder = self.down_proj if proj == "down_proj" else self.gate_up_proj
        spec = holder.specs.get(tensor)
        if spec is None:
            return None
        target = f"{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}.{tensor}"
        if proj == "down_proj":
            return target, (e,)
        shard = 0 if proj == "gate_proj" else 1
        if spec.out_axis is None:
            return target, (e, shard)
        n = self.intermediate_size // spec.out_pack
        return target, (e, *([slice(None)] * spec.out_axis), slice(shard * n, (shard + 1) * n))

    def kernel_weights(self) -> tuple[PackedWeights, PackedWeights]:
        """What kernels.quant.moe.quant_fused_moe takes: gate_up (E packed [2I, H]), down (E packed [H, I])."""
        gate_up = dataclasses.replace(self.fmt.kernel_weights(self.gate_up_proj.packed()),
                                      counters=self.splitk_counters)
        return gate_up, self.fmt.kernel_weights(self.down_proj.packed())

    def kernel_shared(self, se: nn.Module) -> tuple[PackedWeights, PackedWeights, PackedWeights] | None:
        """The shared expert's packed (gate, up, down) when it rides in quant_fused_moe as expert E (its three
        linears packed in this format and group scheme, the routed experts' width), else None (it runs alone)."""
        projs = (se.gate_proj, se.up_proj, se.down_proj)
        I, H = self.intermediate_size, self.hidden_size
        if not all(isinstance(p, QuantLinear) and p.bias is None and p.fmt.name == self.fmt.name
                   and p.fmt.scheme == self.fmt.scheme for p in projs):
            return None
        if [(p.out_features, p.in_features) for p in projs] != [(I, H), (I, H), (H, I)]:
            return None
        return tuple(p.fmt.kernel_weights(p.packed()) for p in projs)

    def forward(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        """x: [T, H]; topk_ids/topk_weights: [T, k] -> Σ_k w_k E_{id_k}(x), accumulated in fp32, [T, H] fp32."""
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for e in torch.unique(topk_ids).tolist():
            token_idx, slot = torch.nonzero(topk_ids == e, as_tuple=True)
            xe = x[token_idx]  # [n, H]
            w_gu = self.fmt.dequantize(self.gate_up_proj.packed(e), x.dtype)  # [2I, H], this expert only
            gate, up = (xe @ w_gu.t()).split(self.intermediate_size, dim=-1)
            ye = (F.silu(gate) * up) @ self.fmt.dequantize(self.down_proj.packed(e), x.dtype).t()  # [n, H]
            out[token_idx] += ye.float() * topk_weights[token_idx, slot, None]
        return out

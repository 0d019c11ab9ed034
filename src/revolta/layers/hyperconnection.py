"""HyperConnections: the 4-stream gated residual of Qwen3.8-Flash-Next (spec §2.3).

The residual is "wide": hc_count branches of hidden_size, branch-major, [T, h * d].
A read turns it into one block input; a combine adds the block output back into every
branch with a per-branch scalar gate computed before the block ran.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .norm import ZCRMSNorm


class HyperConnection(nn.Module):
    """One read/combine pair around a block. `with_inject=False` gives the final read-only mixer."""

    def __init__(self, hidden_size: int, hc_count: int, lowrank: int, eps: float, with_inject: bool = True):
        super().__init__()
        wide = hc_count * hidden_size
        self.hc_count, self.hidden_size = hc_count, hidden_size
        self.hc_norm = ZCRMSNorm(wide, eps, group_size=hidden_size)
        self.input_mix_weight_down = nn.Linear(wide, lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(lowrank, wide, bias=False)
        self.block_inject_weight = nn.Linear(wide, hc_count, bias=False) if with_inject else None

    def read(self, x: Tensor, ops=None) -> tuple[Tensor, Tensor | None]:
        """x: [T, h*d] wide residual -> (block input [T, d], inject gates [T, h] in (0, 2) or None).

        ops: a kernels.ops.KernelOps whose `hc_read` (the fused Triton kernel) replaces this torch code.
        """
        if ops is not None and ops.hc_read is not None:
            inj = self.block_inject_weight.weight if self.block_inject_weight is not None else None
            return ops.hc_read(x.contiguous(), self.hc_norm.weight, self.input_mix_weight_down.weight,
                               self.input_mix_weight_up.weight, inj, self.hc_count, self.hc_norm.eps)
        h = self.hc_count
        normed = self.hc_norm(x)  # [T, h*d]
        # the division by h sits after each matmul, before its nonlinearity (spec §11.4)
        mix = F.silu(self.input_mix_weight_down(normed) / h)  # [T, r]
        gates = torch.sigmoid(self.input_mix_weight_up(mix))  # [T, h*d], per feature
        branches = normed.unflatten(-1, (h, self.hidden_size))  # [T, h, d]
        block_input = (gates.unflatten(-1, (h, self.hidden_size)) * branches).mean(dim=-2)  # [T, d]
        if self.block_inject_weight is None:
            return block_input, None
        inject = 2 * torch.sigmoid(self.block_inject_weight(normed) / h)  # [T, h]
        return block_input, inject

    def combine(self, x: Tensor, inject: Tensor, out: Tensor, ops=None) -> Tensor:
        """x_b += w_b * out for every branch b. x: [T, h*d], inject: [T, h], out: [T, d].

        ops: a kernels.ops.KernelOps whose `hc_combine` (one Triton launch, bitwise equal) replaces this code.
        """
        if ops is not None and ops.hc_combine is not None and x.dtype == inject.dtype == out.dtype:
            return ops.hc_combine(x.contiguous(), inject.contiguous(), out.contiguous())
        return x + (inject.unsqueeze(-1) * out.unsqueeze(-2)).flatten(-2)

    def combine_read(self, x: Tensor, inject: Tensor | None, out: Tensor | None, ops=None
                     ) -> tuple[Tensor, Tensor, Tensor | None]:
        """The previous block's `combine(x, inject, out)` (which uses no weights; none when inject is None), then
        this module's `read` of the result -> (new residual [T, h*d], block input [T, d], inject gates [T, h] or None).

        ops: a kernels.ops.KernelOps whose `hc_combine_read` does both with the write inside the read's first
        pass (one launch fewer, bitwise equal to the two calls).
        """
        if inject is None:
            return (x, *self.read(x, ops))
        if ops is not None and ops.hc_combine_read is not None and x.dtype == inject.dtype == out.dtype:
            inj = self.block_inject_weight.weight if self.block_inject_weight is not None else None
            return ops.hc_combine_read(x.contiguous(), inject.contiguous(), out.contiguous(), self.hc_norm.weight,
                                       self.input_mix_weight_down.weight, self.input_mix_weight_up.weight, inj,
                                       self.hc_count, self.hc_norm.eps)
        x = self.combine(x, inject, out, ops)
        return (x, *self.read(x, ops))

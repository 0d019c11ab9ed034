"""RMSNorm flavours of Qwen3.8-Flash-Next (spec/model.md §2.1).

All statistics are fp32 with one rounding to the input dtype at the end.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..kernels.norm import zc_rms_norm_ref as zc_rms_norm  # the torch reference lives beside its kernel


class ZCRMSNorm(nn.Module):
    """Zero-centred RMSNorm with stored weight w (zero-initialised), scale (1 + w).

    `group_size` < dim gives the grouped form used on wide HyperConnection tensors: each
    branch of `group_size` features gets its own statistic.
    """

    def __init__(self, dim: int, eps: float = 1e-6, group_size: int | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.group_size = group_size

    def forward(self, x: Tensor, ops=None) -> Tensor:
        """ops: a kernels.ops.KernelOps whose `zc_rms_norm` (one Triton launch) replaces the torch reference."""
        if ops is not None and ops.zc_rms_norm is not None and x.stride(-1) == 1:
            return ops.zc_rms_norm(x, self.weight, self.eps, self.group_size)
        return zc_rms_norm(x, self.weight, self.eps, self.group_size)


class GatedRMSNorm(nn.Module):
    """GDN output norm: RMS(o) * w * act(z), plain multiplicative weight (spec §3.6).

    The whole chain is fp32 with one rounding (the NeMo/SGLang choice of spec §11.6).
    """

    def __init__(self, dim: int, eps: float = 1e-6, activation: str = "sigmoid"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.activation = activation

    def forward(self, o: Tensor, z: Tensor) -> Tensor:
        of = o.float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps)
        zf = z.float()
        gate = torch.sigmoid(zf) if self.activation == "sigmoid" else torch.nn.functional.silu(zf)
        return (of * self.weight.float() * gate).to(o.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Plain RMSNorm (Qwen3/Llama): w * round(x * rsqrt(mean(x^2) + eps)), statistic in fp32.

    x: [..., N]; weight: [N]. The normalised value is rounded to x.dtype before the gain, as in the
    Qwen3 reference, so low-precision results match it. Returns the promoted dtype of x and weight.
    """
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """Plain RMSNorm with a stored gain (one-initialised); the DFlash drafter's norms."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)

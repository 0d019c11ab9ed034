"""What every packed weight format provides, and the registry of formats (one small module each).

A `WeightFormat` describes how one linear of `out` x `in` features is stored: its tensors (`specs`: name,
shape, dtype, and which axis holds the output features, so fused gate/up experts can be assembled from
per-expert files), the shape rules it needs (`problems`), and its arithmetic: `dequantize` (torch
reference, the numerics contract), `dequantize_rows` (Triton, for the large-M path) and `gemv`
(Triton packed GEMV for M <= MAX_GEMV_ROWS). `random_` draws packed values for benchmark models.

Adding a format (say, another FP4 variant) is one module with one `WeightFormat` subclass plus one line
in `FORMATS` below and one branch in `revolta.quant.config`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Mapping

import torch
from torch import Tensor

from ..kernels.quant.moe import PackedWeights
from .config import WeightScheme


@dataclass(frozen=True)
class TensorSpec:
    """One stored tensor of a packed linear.

    out_axis: the axis holding output features (None: one value per linear, e.g. a global scale); out_pack:
    output features per element along it (8 for a zero point packed along the outputs). A fused linear of
    `shards` equal parts (experts' gate/up) keeps the per-linear values apart: shape (shards, *shape).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    out_axis: int | None = 0
    out_pack: int = 1

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class WeightFormat:
    name: ClassVar[str]
    pack_out: ClassVar[int] = 1  # output features must be a multiple of this
    pack_in: ClassVar[int] = 1  # input features must be a multiple of this

    def __init__(self, scheme: WeightScheme):
        self.scheme = scheme

    def group(self, in_features: int) -> int:
        return self.scheme.group_for(in_features)

    def specs(self, out_features: int, in_features: int, shards: int = 1) -> dict[str, TensorSpec]:
        raise NotImplementedError

    def problems(self, out_features: int, in_features: int) -> list[str]:
        """Why a linear of this size cannot be stored in this format ([] when it can)."""
        out = []
        g = self.group(in_features)
        if out_features % self.pack_out:
            out.append(f"{self.name} packs {self.pack_out} output features together; {out_features} is not a multiple")
        if in_features % g or in_features % self.pack_in:
            out.append(f"{self.name} groups {g} input features; {in_features} is not a multiple")
        return out

    def dequantize(self, t: Mapping[str, Tensor], dtype: torch.dtype) -> Tensor:
        """W [out, in] in `dtype` (torch reference)."""
        raise NotImplementedError

    def dequantize_rows(self, t: Mapping[str, Tensor], dtype: torch.dtype, rows: tuple[int, int]) -> Tensor:
        """W[n0:n1] in `dtype` (Triton)."""
        raise NotImplementedError

    def gemv(self, x: Tensor, t: Mapping[str, Tensor], bias: Tensor | None, nibble: bool | None = None,
             counters: Tensor | None = None) -> Tensor:
        """x [M, in] @ W.T + bias -> [M, out] in x.dtype (Triton, M <= MAX_GEMV_ROWS). nibble: the group-factored
        path or the tile path (None: kernels/quant/gemv_nibble.py's default). counters: int32 zeros for a fused
        split-K reduce (kernels/quant/common.py splitk_counters), where the format's kernels have one."""
        raise NotImplementedError

    def merged_value(self, name: str, out_features: int, in_features: int, device) -> Tensor | None:
        """The per-linear tensor `name` (TensorSpec.out_axis None) of one linear made of several of this format's
        linears side by side along the outputs (layers/merged_linear.py), or None where no such value exists (a
        global scale: the parts' values differ, so they stay separate linears)."""
        return None

    def kernel_weights(self, t: Mapping[str, Tensor]) -> PackedWeights:
        """The tensors as the packed MoE kernels read them (one linear, or E stacked along a leading axis)."""
        raise NotImplementedError

    def random_(self, t: Mapping[str, Tensor], std: float, generator: torch.Generator) -> None:
        """Fill the packed tensors in place so W has about `std` per entry (benchmark models)."""
        raise NotImplementedError


def random_ints(shape, dtype: torch.dtype, generator: torch.Generator, device) -> Tensor:
    """Uniformly random bits of an integer dtype (every nibble uniform in 0..15)."""
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, dtype=torch.int64 if dtype == torch.int32 else torch.int32,
                         generator=generator, device=device).to(dtype)

"""Linear layers: plain (`nn.Linear`) and quantized (`QuantLinear`), with the same forward contract.

`QuantLinear` keeps its weight packed in the checkpoint's format (revolta.quant: AWQ int4,
compressed-tensors int4, NVFP4); no 16-bit copy of the weight is kept. Its buffers carry the
checkpoint's names (`qweight`, `weight_packed`, `weight_scale`, ...), so loading is a name-for-name copy.

forward(x [..., in]) -> [..., out] in x.dtype:
  * torch path (CPU, or kernel="torch"): the layer's weight dequantized to x.dtype, then F.linear. This is
    the numerics contract: in fp32 it equals the checkpoint dequantized to fp32 exactly, and under
    kernels.batch_invariant it is row-invariant like any nn.Linear.
  * Triton path (CUDA, or kernel="triton"): M <= MAX_GEMV_ROWS rows run the packed GEMV, which decodes
    each packed tile in registers and reads it once for all rows; larger M dequantizes slices of the
    weight to x.dtype and multiplies them with torch (cuBLAS: tensor cores on sm70 too).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels.quant.common import MAX_GEMV_ROWS, dequant_matmul
from ..quant.format import WeightFormat

KERNELS = ("auto", "torch", "triton")


def quant_linear(x: Tensor, fmt: WeightFormat, packed: dict[str, Tensor], out_features: int,
                 bias: Tensor | None = None, kernel: str = "auto", counters: Tensor | None = None) -> Tensor:
    """x [M, in] @ W.T + bias -> [M, out] with W stored `packed` in `fmt` (paths: module docstring). counters:
    int32 zeros the GEMV's fused split-K reduce may count on (QuantLinear's own; None: it allocates them)."""
    if kernel == "auto":
        kernel = "triton" if x.device.type == "cuda" else "torch"
    if kernel == "torch":
        return F.linear(x, fmt.dequantize(packed, x.dtype), bias)
    if x.shape[0] <= MAX_GEMV_ROWS:
        return fmt.gemv(x.contiguous(), packed, bias, counters=counters)
    return dequant_matmul(x, out_features, lambda n0, n1: fmt.dequantize_rows(packed, x.dtype, (n0, n1)), bias)


class QuantLinear(nn.Module):
    """nn.Linear's contract with a packed weight. `kernel`: "auto" (Triton on CUDA, torch elsewhere),
    "torch" or "triton" (tests run the Triton path under the interpreter this way)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, fmt: WeightFormat):
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.kernel = "auto"
        specs = fmt.specs(out_features, in_features)
        self.packed_names = tuple(specs)
        for name, spec in specs.items():
            self.register_buffer(name, torch.empty(spec.shape, dtype=spec.dtype))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # the GEMV's fused split-K reduce counts its K slices per output tile here (kernels/quant/common.py
        # splitk_fixup: zero between launches, each launch leaves them at 0); one per 8 outputs covers any tiling
        self.register_buffer("splitk_counters", torch.zeros(-(-out_features // 8), dtype=torch.int32),
                             persistent=False)

    def init_buffers(self) -> None:
        """Zero the split-K counters (after `to_empty` / materialize from the meta device)."""
        if not self.splitk_counters.is_meta:
            self.splitk_counters.zero_()

    @property
    def disk_dtype_tensors(self) -> tuple[str, ...]:
        """Tensors whose dtype the checkpoint decides (the loader keeps it: no cast to the model dtype)."""
        return self.packed_names

    def packed(self) -> dict[str, Tensor]:
        return {n: getattr(self, n) for n in self.packed_names}

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight [out, in] in `dtype` (a temporary: the layer never keeps it)."""
        return self.fmt.dequantize(self.packed(), dtype)

    def forward(self, x: Tensor) -> Tensor:
        # a merged projection's parts hold strided slices of the merged tensors (layers/merged_linear.py); alone
        # (the merge no longer holds) a part runs on contiguous copies, since the kernels take dense tensors
        packed = {n: t.contiguous() for n, t in self.packed().items()}
        y = quant_linear(x.reshape(-1, self.in_features), self.fmt, packed, self.out_features, self.bias,
                         self.kernel, self.splitk_counters)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        s = self.fmt.scheme
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"format={s.format}, group={self.fmt.group(self.in_features)}")

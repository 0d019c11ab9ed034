"""NVFP4: E2M1 codes uint8 [out, in/2], E4M3 scales [out, in/16], an fp32 global scale per tensor.

Two variants that differ only in names and in how the global scale is stored:
  ModelOpt:           weight, weight_scale, weight_scale_2 (multiplied), input_scale (unused: weight-only)
  compressed-tensors: weight_packed, weight_scale, weight_global_scale (stored inverted: divided)
"""

from __future__ import annotations

import torch

from ..kernels.quant import nvfp4 as kernels
from ..kernels.quant.moe import PackedWeights
from .config import CT_NVFP4, MODELOPT_NVFP4
from .format import TensorSpec, WeightFormat


class ModelOptNVFP4(WeightFormat):
    name = MODELOPT_NVFP4
    pack_in = kernels.GROUP
    codes, global_scale, inverted = "weight", "weight_scale_2", False
    scalar_shape: tuple[int, ...] = ()  # how one linear's global scale is stored (a fused one: [shards, ...])

    def specs(self, out_features, in_features, shards=1):
        scalar = (shards, *self.scalar_shape) if shards > 1 else self.scalar_shape
        return {self.codes: TensorSpec((out_features, in_features // 2), torch.uint8),
                "weight_scale": TensorSpec((out_features, in_features // kernels.GROUP), torch.float8_e4m3fn),
                self.global_scale: TensorSpec(scalar, torch.float32, None)}

    def group(self, in_features):
        return kernels.GROUP

    def dequantize(self, t, dtype):
        return kernels.nvfp4_dequantize_ref(t[self.codes], t["weight_scale"], t[self.global_scale].reshape(-1),
                                            self.inverted, dtype)

    def dequantize_rows(self, t, dtype, rows):
        return kernels.nvfp4_dequantize(t[self.codes], t["weight_scale"], t[self.global_scale].reshape(-1),
                                        self.inverted, dtype, rows)

    def gemv(self, x, t, bias, nibble=None, counters=None):
        return kernels.nvfp4_gemv(x, t[self.codes], t["weight_scale"], t[self.global_scale].reshape(-1),
                                  self.inverted, bias, nibble=nibble, counters=counters)

    def kernel_weights(self, t):
        return PackedWeights("nvfp4", (t[self.codes], t["weight_scale"], t[self.global_scale]), kernels.GROUP,
                             self.inverted)

    def random_(self, t, std, generator):
        dev = t[self.codes].device
        t[self.codes].copy_(torch.randint(0, 256, t[self.codes].shape, dtype=torch.uint8, generator=generator,
                                          device=dev))
        # E2M1 codes have std ~2.9 over uniform codes: group scales ~1 in E4M3, the global scale carries std
        s = torch.rand(t["weight_scale"].shape, generator=generator, device=dev) * 0.5 + 0.75
        t["weight_scale"].copy_(s.to(t["weight_scale"].dtype))
        g = std / 2.9
        t[self.global_scale].fill_(1.0 / g if self.inverted else g)


class CTNVFP4(ModelOptNVFP4):
    name = CT_NVFP4
    codes, global_scale, inverted = "weight_packed", "weight_global_scale", True
    scalar_shape = (1,)

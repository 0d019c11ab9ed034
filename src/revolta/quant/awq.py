"""AutoAWQ GEMM layout: qweight int32 [in, out/8], qzeros int32 [in/G, out/8], scales fp16 [in/G, out]."""

from __future__ import annotations

import torch

from ..kernels.quant import awq as kernels
from ..kernels.quant.moe import PackedWeights
from .config import AWQ as NAME
from .format import TensorSpec, WeightFormat, random_ints


class AWQ(WeightFormat):
    name = NAME
    pack_out = kernels.PACK

    def specs(self, out_features, in_features, shards=1):
        g = self.group(in_features)
        words = out_features // kernels.PACK
        # packed along the outputs, which are the last axis: out_axis 1, out_pack 8 (scales: 1)
        return {"qweight": TensorSpec((in_features, words), torch.int32, 1, kernels.PACK),
                "qzeros": TensorSpec((in_features // g, words), torch.int32, 1, kernels.PACK),
                "scales": TensorSpec((in_features // g, out_features), torch.float16, 1)}

    def dequantize(self, t, dtype):
        return kernels.awq_dequantize_ref(t["qweight"], t["qzeros"], t["scales"], self._g(t), dtype)

    def dequantize_rows(self, t, dtype, rows):
        return kernels.awq_dequantize(t["qweight"], t["qzeros"], t["scales"], self._g(t), dtype, rows)

    def gemv(self, x, t, bias, nibble=None, counters=None):
        return kernels.awq_gemv(x, t["qweight"], t["qzeros"], t["scales"], self._g(t), bias, nibble=nibble,
                                counters=counters)

    def kernel_weights(self, t):
        return PackedWeights("awq", (t["qweight"], t["qzeros"], t["scales"]), self._g(t))

    def random_(self, t, std, generator):
        t["qweight"].copy_(random_ints(t["qweight"].shape, torch.int32, generator, t["qweight"].device))
        t["qzeros"].copy_(random_ints(t["qzeros"].shape, torch.int32, generator, t["qzeros"].device))
        # q - z spans -15..15 with std ~6.1: scales std/6.1, jittered
        s = torch.rand(t["scales"].shape, generator=generator, device=t["scales"].device) * 0.5 + 0.75
        t["scales"].copy_(s * (std / 6.1))

    def _g(self, t) -> int:
        return self.group(t["qweight"].shape[-2])

"""compressed-tensors pack-quantized int4: weight_packed int32 [out, in/8], weight_scale [out, in/G],
weight_zero_point int32 [out/8, in/G] (asymmetric only), weight_shape [2] (the unpacked shape)."""

from __future__ import annotations

import torch

from ..kernels.quant import ct_int4 as kernels
from ..kernels.quant.moe import PackedWeights
from .config import CT_INT4 as NAME
from .format import TensorSpec, WeightFormat, random_ints


class CTInt4(WeightFormat):
    name = NAME
    pack_in = kernels.PACK

    @property
    def pack_out(self):  # zero points are packed 8 per word along the outputs
        return 1 if self.scheme.symmetric else kernels.PACK

    def specs(self, out_features, in_features, shards=1):
        g = self.group(in_features)
        out = {"weight_packed": TensorSpec((out_features, in_features // kernels.PACK), torch.int32),
               "weight_scale": TensorSpec((out_features, in_features // g), torch.bfloat16),
               # the unpacked [out, in] shape, per shard; checked against the config after loading
               "weight_shape": TensorSpec((shards, 2) if shards > 1 else (2,), torch.int64, None)}
        if not self.scheme.symmetric:
            out["weight_zero_point"] = TensorSpec((out_features // kernels.PACK, in_features // g), torch.int32,
                                                  0, kernels.PACK)
        return out

    def dequantize(self, t, dtype):
        return kernels.ct_int4_dequantize_ref(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"),
                                              self._g(t), dtype)

    def dequantize_rows(self, t, dtype, rows):
        return kernels.ct_int4_dequantize(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"),
                                          self._g(t), dtype, rows)

    def gemv(self, x, t, bias, nibble=None, counters=None):
        return kernels.ct_int4_gemv(x, t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"),
                                    self._g(t), bias, nibble=nibble, counters=counters)

    def kernel_weights(self, t):
        return PackedWeights("ct_int4", (t["weight_packed"], t["weight_scale"], t.get("weight_zero_point")), self._g(t))

    def random_(self, t, std, generator):
        dev = t["weight_packed"].device
        t["weight_packed"].copy_(random_ints(t["weight_packed"].shape, torch.int32, generator, dev))
        if "weight_zero_point" in t:
            t["weight_zero_point"].copy_(random_ints(t["weight_zero_point"].shape, torch.int32, generator, dev))
        s = torch.rand(t["weight_scale"].shape, generator=generator, device=dev) * 0.5 + 0.75
        t["weight_scale"].copy_(s * (std / 4.6))  # q - 8 spans -8..7, std ~4.6

    def merged_value(self, name, out_features, in_features, device):
        # the shape record is metadata (the kernels read the packed tensors' shapes): the merged linear's own
        return torch.tensor([out_features, in_features], device=device) if name == "weight_shape" else None

    def _g(self, t) -> int:
        return self.group(t["weight_packed"].shape[-1] * kernels.PACK)

"""The AutoAWQ GEMM layout written from its description (spec/parallel-and-quantization.md §5), independent
of revolta's code: a min-max asymmetric quantizer and packer that writes AWQ test checkpoints, and the
unpacker of the `autoawq` package itself (`awq/utils/packing_utils.py`, loaded by file path: importing
the `awq` package pulls its whole model zoo) as the independent dequantizer when it is installed.

Layout: qweight int32 [in, out/8], qzeros int32 [in/G, out/8], scales fp16 [in/G, out]; packed along
the outputs, nibble i of a word holding column (0, 2, 4, 6, 1, 3, 5, 7)[i]; w = (q - z) * s.
"""

from __future__ import annotations

import importlib.util
import os

import torch

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column ORDER[i] of its 8


def pack(values: torch.Tensor) -> torch.Tensor:
    """int [R, C] of 0..15 -> int32 [R, C/8] in AWQ order."""
    v = values.to(torch.int64).view(values.shape[0], -1, 8)
    word = torch.zeros(v.shape[:2], dtype=torch.int64)
    for i, col in enumerate(ORDER):
        word |= v[:, :, col] << (4 * i)
    return (word - ((word >> 31) << 32)).to(torch.int32)  # two's complement into int32


def unpack(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C/8] -> int64 [R, C] of 0..15."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(words.shape[0], words.shape[1], 8, dtype=torch.int64)
    for i, col in enumerate(ORDER):
        out[:, :, col] = (w >> (4 * i)) & 15
    return out.flatten(1)


def quantize(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """w [out, in] fp32 -> {qweight, qzeros, scales} (AutoAWQ's min-max zero-point quantizer)."""
    wt = w.t().reshape(-1, group, w.shape[0])  # [in/G, G, out]
    mx, mn = wt.amax(1), wt.amin(1)
    scales = ((mx - mn).clamp(min=1e-5) / 15).half()
    zeros = (-mn / scales.float()).round().clamp(0, 15)
    q = (wt / scales.float()[:, None] + zeros[:, None]).round().clamp(0, 15).reshape(w.shape[1], w.shape[0])
    return {"qweight": pack(q), "qzeros": pack(zeros), "scales": scales}


def dequantize(t: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    """-> W [out, in] fp32, from the description."""
    q, z = unpack(t["qweight"]), unpack(t["qzeros"]).repeat_interleave(group, 0)
    return ((q - z).float() * t["scales"].float().repeat_interleave(group, 0)).t().contiguous()


def autoawq_packing_utils():
    """The `autoawq` package's packing_utils module, or None when autoawq is not installed."""
    spec = importlib.util.find_spec("awq")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "utils", "packing_utils.py")
    mod_spec = importlib.util.spec_from_file_location("autoawq_packing_utils", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def dequantize_with_autoawq(t: dict[str, torch.Tensor], group: int) -> torch.Tensor | None:
    """W [out, in] fp32 by AutoAWQ's own `dequantize_gemm` (fp32 scales: exact), or None without autoawq."""
    utils = autoawq_packing_utils()
    if utils is None:
        return None
    return utils.dequantize_gemm(t["qweight"], t["qzeros"], t["scales"].float(), 4, group).t().float().contiguous()

"""Whole quantized models: the model of a config on the meta device in its checkpoint's packed layout
(`meta_model`: weight sizes without weights), the `revolta info` lines of a quantized checkpoint
(`format_quantization`) and a random AWQ int4 model drawn on the device for benchmarks
(`random_quantized_model`). Above model.py: layers/quantize.py swaps the modules, this builds models.
"""

from __future__ import annotations

import torch
from torch import nn

from .config_error import ConfigError
from .units import human_bytes
from .layers.linear import QuantLinear
from .layers.quant_moe import QuantExperts
from .layers.quantize import init_random_packed, packed_modules, quantize_modules, weight_bytes_per_gpu
from .model import FlashNextModel, init_random_weights
from .ple.random_table import attach_random_tables
from .quant.config import parse_quant_config
from .weights import materialize


def meta_model(cfg, with_mtp: bool = True, with_vision: bool = True) -> nn.Module:
    """The model of `cfg` on the meta device, in its checkpoint's quantized layout (no memory used)."""
    with torch.device("meta"):
        model = FlashNextModel(cfg, with_mtp=with_mtp, with_vision=with_vision)
    if cfg.quantization is not None:
        quantize_modules(model, cfg.quantization)
    return model


_NO_GROUP = object()  # building a rank's meta model runs no collective


def rank_meta_model(cfg, tp: int, with_mtp: bool = True, with_vision: bool = True) -> nn.Module:
    """The model one rank of `tp` builds (packed like its checkpoint, whole groups per rank), on the meta device;
    ParallelConfigError when the model cannot be split `tp` ways."""
    from .parallel import ParallelConfig, ParallelContext
    from .parallel.shard import build_rank_model

    return build_rank_model(cfg, ParallelConfig(tp), ParallelContext(0, tp, _NO_GROUP), with_mtp=with_mtp,
                            with_vision=with_vision)


def weights_per_gpu(cfg, tp: int, model: nn.Module | None = None) -> dict[str, int]:
    """`weight_bytes_per_gpu` of `cfg` at `tp` as a rank holds it (ParallelConfigError when it cannot split)."""
    model = meta_model(cfg) if model is None else model
    return weight_bytes_per_gpu(model, tp, rank=rank_meta_model(cfg, tp) if tp > 1 else None)


def format_quantization(cfg, tps: tuple[int, ...] = (1, 2, 4)) -> str:
    """The `revolta info` lines of a quantized checkpoint: format, bits, group size, weight bytes per GPU."""
    q = cfg.quantization
    model = meta_model(cfg)
    packed = packed_modules(model)
    lines = [f"quantization: {q.describe()} (from {q.source.rsplit('/', 1)[-1]})",
             f"  packed modules: {sum(isinstance(m, QuantLinear) for _, m in packed)} linears, "
             f"{sum(isinstance(m, QuantExperts) for _, m in packed)} routed-expert banks; others 16-bit"]
    for tp in tps:
        try:
            b = weights_per_gpu(cfg, tp, model)
        except ConfigError as e:  # this tp cannot split the model: say why in one line
            lines.append(f"  weights per GPU at TP{tp}: cannot split ({str(e).splitlines()[0]})")
            continue
        lines.append(f"  weights per GPU at TP{tp}: {human_bytes(b['total'])} = packed {human_bytes(b['packed'])} "
                     f"+ 16-bit split {human_bytes(b['dense_split'])} + 16-bit replicated "
                     f"{human_bytes(b['dense_replicated'])}" + (f"; PLE table {human_bytes(b['ple_table_host'])} "
                                                                 "in host memory" if b["ple_table_host"] else ""))
    return "\n".join(lines) + "\n"


@torch.no_grad()
def random_quantized_model(cfg, device: str | torch.device = "cuda", dtype: torch.dtype = torch.float16,
                           group_size: int = 32, seed: int = 0, with_mtp: bool = True,
                           ple_table: str | None = None) -> nn.Module:
    """The model of `cfg` (e.g. the real 48-layer, 512-expert config) with AWQ int4 weights (group
    `group_size`) drawn on `device`, no checkpoint file: for GPU benchmarks. A config that already names a
    quantization keeps it. Never on the CPU first: packed tensors are drawn where they live.

    AWQ covers the decoder and MTP layers except the routers, the shared-expert gate and the GDN b/a
    projections (16-bit, as released AWQ checkpoints keep them); dense weights are drawn like
    `init_random_weights` on `device`. ple_table "host" / "device": the PLE n-gram tables as random FP8
    tables in pinned host memory / on `device` (ple/random_table.py; the real model's is 47.7 GiB, so its
    16-bit weight is never materialised); None: a 16-bit weight on `device` like every other dense weight.
    """
    from dataclasses import replace

    if cfg.quantization is None:
        awq = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
               "modules_to_not_convert": ["mlp.gate", "shared_expert_gate", "in_proj_b", "in_proj_a"]}
        cfg = replace(cfg, quantization=parse_quant_config({"quantization_config": awq}, source="random AWQ"))
    model = meta_model(cfg, with_mtp=with_mtp, with_vision=False)
    if ple_table is not None:
        attach_random_tables(model, ple_table, device, seed=seed)
    materialize(model, device, dtype)
    init_random_weights(model, seed=seed, device=str(device))
    init_random_packed(model, seed=seed)
    return model.eval()

"""Which part of each packed (int4 / fp4) tensor a rank holds (docs/parallel.md, "Packed checkpoints").

A packed linear splits exactly as its 16-bit weight [out, in] would (parallel/shard.py `tensor_slices`): the
rank's ranges along the output or the input features. Each stored tensor of the format (quant/*.py `specs`)
holds the output features along its `out_axis`, `out_pack` of them per element (AWQ's qweight / qzeros: 8 per
int32 word; compressed-tensors' asymmetric zero points: 8 per word), and the input features along the other
axis, `in_per` per element (1 for AWQ's qweight, 8 for a compressed-tensors int32 word, 2 for NVFP4 codes, the
group size for scales and zero points). The rank's ranges are divided by those factors; a range that does not
fall on an element boundary would cut a word or a quantization group, and is refused naming the tensor.
Per-linear values (NVFP4 global scales, compressed-tensors `weight_shape`) are replicated; `weight_shape` is
rewritten to the rank's shape once loaded (`localise_weight_shapes`).

Routed experts keep their leading [E] axis: a bank's gate_up_proj follows `experts.gate_up_proj` [E, 2I, H]
(the gate and the up rows each split), its down_proj `experts.down_proj` [E, H, I].
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..config import TextConfig
from ..layers.linear import QuantLinear
from ..layers.quant_moe import QuantExperts
from ..layers.quantize import shape_holders
from .config import ParallelConfigError
from .slices import Slices, tensor_slices


@dataclass(frozen=True)
class PackedTensor:
    """One stored tensor of a packed linear of the *full* model."""

    weight: str  # the 16-bit tensor whose split it follows ("...q_proj.weight", "...experts.gate_up_proj")
    lead: int  # leading axes before [out, in] (1 for an expert bank's [E])
    out_axis: int | None  # in the stored tensor, after `lead`; None: one value per linear (replicated)
    out_pack: int  # output features per element along out_axis
    in_per: int  # input features per element along the other axis
    group: int  # the quantization group (for the error message)
    per_channel: bool = False  # one group over all inputs: its scales / zero points serve every rank whole


def packed_tensors(model: nn.Module) -> dict[str, PackedTensor]:
    """Every packed tensor of the full (meta) model `model` by state_dict name."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            holders = [(name, f"{name}.weight", 0, mod.fmt.specs(mod.out_features, mod.in_features), mod.in_features)]
        elif isinstance(mod, QuantExperts):
            holders = [(f"{name}.{h}", f"{name}.{h}", 1, getattr(mod, h).specs, n)
                       for h, n in (("gate_up_proj", mod.hidden_size), ("down_proj", mod.intermediate_size))]
        else:
            continue
        group, per_channel = mod.fmt.group(holders[0][4]), mod.fmt.scheme.group_size == -1
        for prefix, weight, lead, specs, in_features in holders:
            for n, spec in specs.items():
                if spec.out_axis is None or len(spec.shape) != 2:
                    out[f"{prefix}.{n}"] = PackedTensor(weight, lead, None, 1, 1, group, per_channel)
                    continue
                in_axis = 1 - spec.out_axis
                out[f"{prefix}.{n}"] = PackedTensor(weight, lead, spec.out_axis, spec.out_pack,
                                                    in_features // spec.shape[in_axis], group, per_channel)
    return out


def packed_slices(name: str, pt: PackedTensor, t: TextConfig, rank: int, tp: int):
    """Rank `rank`'s Slices of the packed tensor `name` (None: replicated); ParallelConfigError when a rank's range
    would cut a packed word or a quantization group."""
    sl = tensor_slices(pt.weight, t, rank, tp)
    if sl is None or pt.out_axis is None:
        return None
    along_out = sl.dim == pt.lead
    axis = pt.lead + (pt.out_axis if along_out else 1 - pt.out_axis)
    per = pt.out_pack if along_out else pt.in_per
    if not along_out and pt.per_channel and per == sl.size * tp:  # one scale per output: every rank needs it
        return None
    bad = [(s, e) for s, e in sl.ranges if s % per or e % per]
    if bad or sl.size % per:
        what = "output" if along_out else "input"
        raise ParallelConfigError(
            f"{name}: tensor_parallel_size={tp} gives rank {rank} the {what} features {list(sl.ranges)}, which cut "
            f"its elements of {per} {what} features each (quantization group {pt.group}); use a smaller "
            f"tensor_parallel_size or a checkpoint with a smaller group")
    return Slices(axis, tuple((s // per, e // per) for s, e in sl.ranges), sl.size // per)


def localise_weight_shapes(model: nn.Module, full: nn.Module) -> None:
    """Check each loaded compressed-tensors `weight_shape` (the full [out, in]) against the full model, then store
    the rank's own shape, as a TP1 load leaves the module's sizes there."""
    want_full = {where: want for where, _, want in shape_holders(full)}
    bad = []
    for where, holder, want in shape_holders(model):
        shape = getattr(holder, "weight_shape", None)
        if shape is None:
            continue
        if not bool((shape.reshape(-1, 2) == torch.tensor(want_full[where])).all()):
            bad.append(f"{where}.weight_shape holds {shape.reshape(-1, 2).tolist()}, the config says {want_full[where]}")
        shape.reshape(-1, 2).copy_(torch.tensor(want))
    if bad:
        raise ParallelConfigError("checkpoint tensors disagree with the config:\n  " + "\n  ".join(bad))


def shard_packed(full: Mapping[str, torch.Tensor], packed: Mapping[str, PackedTensor], t: TextConfig, rank: int,
                 tp: int) -> dict[str, torch.Tensor]:
    """The packed tensors of a full state dict cut to rank `rank`'s parts (tests; the loader reads slices)."""
    out = {}
    for name, pt in packed.items():
        if name in full:
            sl = packed_slices(name, pt, t, rank, tp)
            out[name] = full[name] if sl is None else sl.take(full[name])
    return out

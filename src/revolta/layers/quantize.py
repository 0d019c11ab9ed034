"""Turn a model built from the config into the quantized checkpoint's layout, before any weight loads.

`quantize_modules(model, qcfg)` replaces each `nn.Linear` the config quantizes with a `QuantLinear` and each
`Experts` bank with `QuantExperts` (meta-device modules stay on meta), after checking every size against the
format: any linear the format cannot store raises one QuantConfigError naming every module and the reason.
Never quantized: the LM head, the HyperConnection and PLE projections (their kernels read the 16-bit
weights), and, for AutoAWQ (which quantizes decoder layers only), everything outside the decoder layers
and the MTP layer.
"""

from __future__ import annotations

import torch
from torch import nn

from ..quant.config import QuantConfig, QuantConfigError
from ..quant.formats import weight_format
from .linear import QuantLinear
from .moe import Experts
from .quant_moe import QuantExperts

_NEVER = ("hyper_connection", ".ple.")
_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def _candidate(name: str, qcfg: QuantConfig) -> bool:
    if name == "lm_head" or any(s in name for s in _NEVER):
        return False
    if qcfg.method == "awq":
        return name.startswith(("model.language_model.layers.", "mtp."))
    return True


def quantize_modules(model: nn.Module, qcfg: QuantConfig) -> int:
    """Swap the quantized linears and expert banks of `model` in place; returns how many were swapped."""
    if not qcfg.packed:
        return 0
    plan, problems = [], []
    device = next((t.device for t in model.parameters()), torch.device("cpu"))
    with torch.device(device):  # a meta model gets meta modules: nothing is allocated
        _plan_swaps(model, qcfg, plan, problems)
    if problems:
        raise QuantConfigError(f"{qcfg.source}: {len(problems)} modules cannot be stored as the checkpoint's config "
                               "says (exclude them in its ignore list, or fix the config):\n  " + "\n  ".join(problems))
    for name, new in plan:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    return len(plan)


def _plan_swaps(model: nn.Module, qcfg: QuantConfig, plan: list, problems: list) -> None:
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and _candidate(name, qcfg):
            scheme = qcfg.scheme_for(name)
            if scheme is not None:
                fmt = weight_format(scheme)
                problems += [f"{name} [{mod.out_features}, {mod.in_features}]: {p}"
                             for p in fmt.problems(mod.out_features, mod.in_features)]
                plan.append((name, QuantLinear(mod.in_features, mod.out_features, mod.bias is not None, fmt)))
        elif isinstance(mod, Experts) and _candidate(name, qcfg):
            schemes = {p: qcfg.scheme_for(f"{name}.0.{p}") for p in _EXPERT_PROJS}
            if len(set(schemes.values())) > 1:
                problems.append(f"{name}: gate/up/down projections are stored differently ({schemes}); revolta "
                                "needs one format for all routed-expert projections")
                continue
            scheme = schemes["gate_proj"]
            if scheme is not None:
                E, two_i, H = mod.gate_up_proj.shape
                fmt = weight_format(scheme)
                problems += [f"{name}.*.{p}: {q}" for p, (o, i) in
                             (("gate_proj", (two_i // 2, H)), ("down_proj", (H, two_i // 2)))
                             for q in fmt.problems(o, i)]
                plan.append((name, QuantExperts(E, H, two_i // 2, fmt)))


def packed_modules(model: nn.Module):
    """(name, module) of every QuantLinear and QuantExperts in `model`."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (QuantLinear, QuantExperts))]


def shape_holders(model: nn.Module):
    """(name, holder module, [out, in]) of every packed linear (an expert bank's two projections apart): what a
    compressed-tensors `weight_shape` in that holder must say."""
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            yield name, mod, [mod.out_features, mod.in_features]
        elif isinstance(mod, QuantExperts):
            I, H = mod.intermediate_size, mod.hidden_size
            yield f"{name}.gate_up_proj", mod.gate_up_proj, [I, H]
            yield f"{name}.down_proj", mod.down_proj, [H, I]


def check_loaded_shapes(model: nn.Module) -> None:
    """After loading: stored `weight_shape` values (compressed-tensors) must equal the module sizes."""
    bad = []
    for where, holder, want in shape_holders(model):
        shape = getattr(holder, "weight_shape", None)
        if shape is not None and not bool((shape.reshape(-1, 2).cpu() == torch.tensor(want)).all()):
            bad.append(f"{where}.weight_shape holds {shape.reshape(-1, 2).tolist()}, the config says {want}")
    if bad:
        raise QuantConfigError("checkpoint tensors disagree with the config:\n  " + "\n  ".join(bad))


@torch.no_grad()
def init_random_packed(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Draw every packed tensor (on its own device) so dequantized weights have about `std` per entry
    (scaled down for wide inputs like init_random_weights). For benchmark models without a checkpoint."""
    gen = None
    for name, mod in sorted(packed_modules(model), key=lambda nm: nm[0]):
        holders = [(mod, mod.in_features)] if isinstance(mod, QuantLinear) else \
            [(mod.gate_up_proj, mod.hidden_size), (mod.down_proj, mod.intermediate_size)]
        for holder, fan_in in holders:
            packed = holder.packed()
            dev = next(iter(packed.values())).device
            if gen is None or gen.device != dev:
                gen = torch.Generator(device=dev).manual_seed(seed)
            mod.fmt.random_(packed, min(std * 4, fan_in ** -0.5), gen)



# Replicated on every rank under tensor parallelism (spec/parallel-and-quantization.md §2); everything else splits.
_REPLICATED = ("hyper_connection", ".ple.")
_PLE_TABLE = ".ngram_embedding.weight"


def weight_bytes_per_gpu(model: nn.Module, tp: int = 1, dense_bytes: int = 2, rank: nn.Module | None = None
                         ) -> dict[str, int]:
    """Per-GPU weight bytes of `model` (a meta-device model is fine) at tensor parallelism `tp`.

    Packed tensors count their stored size; other floating tensors `dense_bytes` per value (16-bit
    deployment; A_log/dt_bias fp32). The PLE table lives in host memory and is reported apart.
    `rank`: the model one rank builds at `tp` (parallel.shard.build_rank_model, on meta): every tensor counts as
    that rank holds it (whole groups, replicated KV heads and MTP projections, padded vocabulary rows), 16-bit
    ones as split when the rank holds less than the full tensor. Without it, an estimate: everything split by tp
    but the HyperConnection and PLE modules (spec/parallel-and-quantization.md §2).
    """
    full = {n: t.shape for n, t in model.state_dict(keep_vars=True).items()}
    held = model if rank is None else rank
    packed = set()
    for name, mod in packed_modules(held):
        packed.update(f"{name}.{n}" for n in _disk_tensor_names(mod))
    div = tp if rank is None else 1
    out = {"packed": 0, "dense_split": 0, "dense_replicated": 0, "ple_table_host": 0}
    for name, t in held.state_dict(keep_vars=True).items():
        if name in packed:
            out["packed"] += t.numel() * t.element_size() // div
        elif name.endswith(_PLE_TABLE):
            out["ple_table_host"] += full[name].numel()  # 1 byte per value, as the AWQ release stores it
        elif t.is_floating_point():
            size = t.numel() * (4 if name.endswith(("A_log", "dt_bias")) else dense_bytes)
            whole = any(s in name for s in _REPLICATED) if rank is None else t.shape == full[name]
            if whole:
                out["dense_replicated"] += size
            else:
                out["dense_split"] += size // div
    out["total"] = out["packed"] + out["dense_split"] + out["dense_replicated"]
    return out


def _disk_tensor_names(mod: nn.Module) -> list[str]:
    if isinstance(mod, QuantLinear):
        return list(mod.packed_names)
    return [f"{h}.{n}" for h in ("gate_up_proj", "down_proj") for n in getattr(mod, h).specs]

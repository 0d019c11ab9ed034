"""Quantized test checkpoints of a tiny model, written by the tools' own code, not by revolta's.

`write_quantized(model, directory, fmt, fused_experts)` saves `model` (fp32, random) as a checkpoint
in one of the formats and returns the "oracle" state dict: the same model with every quantized weight
dequantized to fp32 by the tool (compressed-tensors' decompressors; AutoAWQ's `dequantize_gemm`, or the
from-the-description unpacker of awq_reference.py when autoawq is absent; for ModelOpt the description
code x (scale x weight_scale_2) on compressed-tensors' unpacked codes).

  awq:            awq_reference.quantize (AutoAWQ's min-max quantizer and GEMM packing)
  ct-int4 / -asym: compressed_tensors PackedQuantizationCompressor (W4A16 / W4A16_ASYM schemes)
  ct-nvfp4:       compressed_tensors NVFP4PackedCompressor (NVFP4A16 scheme)
  modelopt-nvfp4: the ct-nvfp4 codes and E4M3 scales under ModelOpt's names, weight_scale_2 = 1 / global
                  scale (stored as ModelOpt does, not inverted), an input_scale, and hf_quant_config.json
Experts are written per expert (`experts.{e}.{gate,up,down}_proj.*`) or fused (`experts.gate_up_proj.*`
[E, 2I, ...] assembled from the per-expert tool output, `experts.down_proj.*` [E, H, ...]).
"""

from __future__ import annotations

import json
from pathlib import Path

import awq_reference
import torch
from torch import nn

from revolta.layers.moe import Experts
from revolta.weights import checkpoint_tensors, save_checkpoint

FORMATS = ("awq", "ct-int4", "ct-int4-asym", "ct-nvfp4", "modelopt-nvfp4")
GROUP = 32
# 16-bit in every test checkpoint: routers and the shared-expert gate (as real exports keep them), and the
# GDN b/a projections (4 or 48 outputs: too few to pack 8 per word in the AWQ and asymmetric layouts)
KEEP = ("mlp.gate", "shared_expert_gate", "in_proj_b", "in_proj_a")
_NEVER = ("lm_head", "hyper_connection", ".ple.")


def quantized_linears(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not any(s in n for s in _NEVER)
            and not n.endswith(KEEP) and (n.startswith("model.language_model.layers.") or n.startswith("mtp."))]


def _ct_scheme(fmt: str):
    from compressed_tensors.quantization import preset_name_to_scheme

    preset = {"ct-int4": "W4A16", "ct-int4-asym": "W4A16_ASYM"}.get(fmt, "NVFP4A16")
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if fmt.startswith("ct-int4"):
        scheme = scheme.model_copy(update={"weights": scheme.weights.model_copy(update={"group_size": GROUP})})
    return scheme


def _ct_quantize(w: torch.Tensor, fmt: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors: (compressed tensors, tool-dequantized W fp32) of w [out, in]."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = _ct_scheme(fmt)
    args = scheme.weights
    g = args.group_size
    groups = w.reshape(w.shape[0], -1, g)
    state = {"weight": w}
    if fmt == "ct-nvfp4":
        gs = generate_gparam(w.amin(), w.amax())
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=gs)
        state.update(weight_scale=scale, weight_global_scale=gs)
        packed = NVFP4PackedCompressor.compress(state, scheme)
        # the decompressor's own arithmetic (scale / global scale, times the code), run in fp32 (its default
        # unpacks to bf16, which would round the oracle itself)
        codes = unpack_fp4_from_uint8(packed["weight_packed"], w.shape[0], w.shape[1], dtype=torch.float32)
        dec = dequantize(x_q=codes, scale=packed["weight_scale"].float(), args=args,
                         global_scale=packed["weight_global_scale"].float(), dtype=torch.float32)
        return packed, dec
    scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    scale = scale.to(torch.bfloat16)  # stored like a bf16 model's scales; quantized with the stored value
    state.update(weight_scale=scale, weight_zero_point=zp)
    packed = PackedQuantizationCompressor.compress(state, scheme)
    dec = PackedQuantizationCompressor.decompress({**packed, "weight_scale": packed["weight_scale"].float()},
                                                  scheme)["weight"]
    return packed, dec.float()


def quantize_weight(w: torch.Tensor, fmt: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(tensors as stored on disk, tool-dequantized W fp32) of one linear's weight w [out, in] fp32."""
    if fmt == "awq":
        t = awq_reference.quantize(w, GROUP)
        dec = awq_reference.dequantize_with_autoawq(t, GROUP)
        return t, awq_reference.dequantize(t, GROUP) if dec is None else dec
    if fmt == "modelopt-nvfp4":
        from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

        ct, _ = _ct_quantize(w, "ct-nvfp4")
        ws2 = (1.0 / ct["weight_global_scale"].float()).reshape(())
        t = {"weight": ct["weight_packed"], "weight_scale": ct["weight_scale"], "weight_scale_2": ws2,
             "input_scale": torch.tensor(1.0)}
        codes = unpack_fp4_from_uint8(t["weight"], w.shape[0], w.shape[1], dtype=torch.float32)
        scale = (t["weight_scale"].float() * ws2).repeat_interleave(16, dim=1)
        return t, codes * scale
    return _ct_quantize(w, fmt)


def _fuse(gate: dict[str, torch.Tensor], up: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    """One expert's gate and up tensors as the fused [2I, H] linear (per-linear values kept per shard)."""
    out = {}
    for name, a in gate.items():
        b = up[name]
        if name in ("weight_scale_2", "weight_global_scale", "weight_shape", "input_scale"):
            out[name] = torch.stack([a, b])
        elif fmt == "awq":
            out[name] = torch.cat([a, b], dim=1)  # outputs are the last axis
        else:
            out[name] = torch.cat([a, b], dim=0)
    return out


def write_quantized(model: nn.Module, directory: str | Path, fmt: str, fused_experts: bool = False,
                    extra_config: dict | None = None) -> dict[str, torch.Tensor]:
    """Save `model` as a `fmt` checkpoint in `directory` (config.json included); return the oracle state dict."""
    directory = Path(directory)
    sd = {k: (v.float() if v.is_floating_point() else v).detach().clone() for k, v in model.state_dict().items()}
    disk = dict(checkpoint_tensors(model))
    disk = {k: v.detach().clone() for k, v in disk.items()}
    for name in quantized_linears(model):
        t, dec = quantize_weight(sd[f"{name}.weight"], fmt)
        del disk[f"{name}.weight"]
        disk.update({f"{name}.{k}": v for k, v in t.items()})
        sd[f"{name}.weight"] = dec
    for name, mod in model.named_modules():
        if not isinstance(mod, Experts):
            continue
        del disk[f"{name}.gate_up_proj"], disk[f"{name}.down_proj"]
        I = mod.intermediate_size
        per_expert = []
        for e in range(mod.gate_up_proj.shape[0]):
            parts = {}
            for proj, w in (("gate_proj", sd[f"{name}.gate_up_proj"][e, :I]), ("up_proj", sd[f"{name}.gate_up_proj"][e, I:]),
                            ("down_proj", sd[f"{name}.down_proj"][e])):
                parts[proj] = quantize_weight(w.contiguous(), fmt)
            sd[f"{name}.gate_up_proj"][e] = torch.cat([parts["gate_proj"][1], parts["up_proj"][1]])
            sd[f"{name}.down_proj"][e] = parts["down_proj"][1]
            per_expert.append({p: t for p, (t, _) in parts.items()})
        if fused_experts:
            gate_up = [_fuse(p["gate_proj"], p["up_proj"], fmt) for p in per_expert]
            for k in gate_up[0]:
                disk[f"{name}.gate_up_proj.{k}"] = torch.stack([g[k] for g in gate_up])
            for k in per_expert[0]["down_proj"]:
                disk[f"{name}.down_proj.{k}"] = torch.stack([p["down_proj"][k] for p in per_expert])
        else:
            for e, p in enumerate(per_expert):
                for proj, t in p.items():
                    disk.update({f"{name}.{e}.{proj}.{k}": v for k, v in t.items()})
    directory.mkdir(parents=True, exist_ok=True)
    save_checkpoint({k: v.contiguous() for k, v in disk.items()}, directory, progress=False)
    config = model.cfg.to_dict()
    config.update(extra_config or {})
    hf_quant = None
    ignore = [f"*{k}" for k in KEEP] + ["lm_head", "*hyper_connection*", "*.ple.*"]
    if fmt == "awq":
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                         "version": "gemm", "modules_to_not_convert": list(KEEP)}
    elif fmt == "modelopt-nvfp4":
        hf_quant = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                                                       "kv_cache_quant_algo": None,
                                                                       "exclude_modules": ignore}}
    else:
        from compressed_tensors.quantization import QuantizationConfig

        fmt_name = "nvfp4-pack-quantized" if fmt == "ct-nvfp4" else "pack-quantized"
        qc = QuantizationConfig(config_groups={"group_0": _ct_scheme(fmt)}, format=fmt_name,
                                ignore=["lm_head"] + [f"re:.*{k}$" for k in KEEP] + ["re:.*hyper_connection.*",
                                                                                     "re:.*\\.ple\\..*"],
                                quantization_status="compressed")
        config["quantization_config"] = json.loads(json.dumps(qc.model_dump(), default=str))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if hf_quant is not None:
        (directory / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2))
    return sd

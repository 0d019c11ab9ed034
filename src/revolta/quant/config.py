"""The checkpoint's quantization, read from its config (never from the directory name).

`parse_quant_config(config_json, hf_quant_config_json)` -> QuantConfig | None. Sources:
  * config.json `quantization_config` (top level or inside text_config): quant_method "awq" (AutoAWQ GEMM),
    "compressed-tensors" (pack-quantized int4, nvfp4-pack-quantized), "modelopt" (NVFP4), "fp8" (block FP8,
    dequantised to 16-bit on load by revolta.weights);
  * hf_quant_config.json (ModelOpt's export): {"quantization": {"quant_algo": "NVFP4", "group_size": 16,
    "exclude_modules": [wildcards]}}.
Anything else (another method, another algorithm, another bit width or layout) raises `QuantConfigError` at
configuration time, naming what was found and listing what is supported.

`QuantConfig.scheme_for(module_name)` says how one linear is stored: a `WeightScheme` (format, bits,
group) or None (16-bit). Each method keeps its tool's matching rules for the exclusion list: AutoAWQ's
`modules_to_not_convert` are substrings of the module name, compressed-tensors' `ignore` / `targets` are
exact names, "re:" regular expressions or the class name "Linear", ModelOpt's `exclude_modules` are
shell wildcards.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any

from ..config_error import ConfigError

HF_QUANT_CONFIG = "hf_quant_config.json"
SUPPORTED = {
    "awq": "AutoAWQ GEMM layout: bits 4, zero_point true, version gemm, group_size 32/64/128 (or -1)",
    "compressed-tensors": "format pack-quantized (int4 W4A16, symmetric or asymmetric, group or channel) or "
                          "nvfp4-pack-quantized (NVFP4, group 16)",
    "modelopt": "quant_algo NVFP4 (group 16), in config.json or hf_quant_config.json",
    "fp8": "block FP8 (weight_scale_inv per 128x128 block), dequantised to 16-bit when loaded",
}
# Formats of the packed tensors (revolta.quant.formats has one class per name).
AWQ, CT_INT4, CT_NVFP4, MODELOPT_NVFP4 = "awq", "ct-int4", "ct-nvfp4", "modelopt-nvfp4"


class QuantConfigError(ConfigError):
    """A quantization config revolta cannot run; the message names the value and the supported ones."""


@dataclass(frozen=True)
class WeightScheme:
    """How one linear's weight is stored. group_size -1: one group over all inputs (per channel)."""

    format: str
    bits: int
    group_size: int
    symmetric: bool

    def group_for(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size


@dataclass(frozen=True)
class QuantConfig:
    method: str  # "awq" | "compressed-tensors" | "modelopt" | "fp8"
    rules: tuple[tuple[tuple[str, ...], WeightScheme], ...]  # (targets, scheme), first match wins
    ignore: tuple[str, ...] = ()
    source: str = "config"
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def packed(self) -> bool:
        """Whether any weight stays packed in memory (block FP8 is dequantised on load)."""
        return bool(self.rules)

    def scheme_for(self, name: str) -> WeightScheme | None:
        """The scheme of the linear module `name` (checkpoint naming), or None when it stays 16-bit."""
        if any(_matches(self.method, p, name, ignore=True) for p in self.ignore):
            return None
        for targets, scheme in self.rules:
            if any(_matches(self.method, t, name, ignore=False) for t in targets):
                return scheme
        return None

    def describe(self) -> str:
        schemes = sorted({s for _, s in self.rules}, key=str)
        parts = [f"{s.format} int{s.bits}" if s.format in (AWQ, CT_INT4) else f"{s.format} fp{s.bits}" for s in schemes]
        groups = sorted({s.group_size for s in schemes})
        text = f"{self.method}: {', '.join(parts) or 'dequantised on load'}"
        if groups:
            text += f", group size {'/'.join('channel' if g == -1 else str(g) for g in groups)}"
        if any(s.format in (AWQ, CT_INT4) for s in schemes):
            text += ", " + ("symmetric" if all(s.symmetric for s in schemes) else "zero points")
        return text


def _matches(method: str, pattern: str, name: str, ignore: bool) -> bool:
    if method == "awq":
        return pattern in name if ignore else True
    if method == "modelopt":
        return fnmatch.fnmatchcase(name, pattern) if ignore else True
    if pattern == "Linear":
        return True
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name


def parse_quant_config(config: dict[str, Any], hf_quant_config: dict[str, Any] | None = None,
                       source: str = "config.json") -> QuantConfig | None:
    """The QuantConfig of a checkpoint from its config.json dict (and hf_quant_config.json dict), None if
    the checkpoint is not quantized. Raises QuantConfigError for anything revolta does not support."""
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if qc is None and hf_quant_config is not None:
        return _modelopt(hf_quant_config.get("quantization") or hf_quant_config, HF_QUANT_CONFIG)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise QuantConfigError(f"{source}: quantization_config must be an object, got {type(qc).__name__}")
    method = str(qc.get("quant_method", "")).lower()
    where = f"{source}: quantization_config"
    if method == "awq":
        return _awq(qc, where)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    if method == "modelopt":
        return _modelopt(qc, where)
    if method == "fp8":
        return QuantConfig("fp8", (), source=where, raw=qc)
    raise QuantConfigError(f"{where}.quant_method={qc.get('quant_method')!r} is not supported; revolta runs "
                           + _supported_list())


def _supported_list() -> str:
    return "; ".join(f"{k!r} ({v})" for k, v in SUPPORTED.items())


def _awq(qc: dict[str, Any], where: str) -> QuantConfig:
    bits, group = int(qc.get("bits", qc.get("w_bit", 4))), int(qc.get("group_size", qc.get("q_group_size", 128)))
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4:
        raise QuantConfigError(f"{where}: AWQ bits={bits}; revolta runs 4-bit AWQ only ({SUPPORTED['awq']})")
    if version != "gemm":
        raise QuantConfigError(f"{where}: AWQ version={version!r} packs weights another way; revolta reads the "
                               f"'gemm' layout ({SUPPORTED['awq']})")
    if not qc.get("zero_point", True):
        raise QuantConfigError(f"{where}: AWQ zero_point=false; the GEMM layout revolta reads has zero points")
    _check_group(group, where, (32, 64, 128))
    scheme = WeightScheme(AWQ, 4, group, symmetric=False)
    ignore = tuple(qc.get("modules_to_not_convert") or ())
    return QuantConfig("awq", ((("Linear",), scheme),), ignore, where, qc)


def _check_group(group: int, where: str, allowed: tuple[int, ...]) -> None:
    if group != -1 and group not in allowed:
        raise QuantConfigError(f"{where}: group_size={group}; revolta's int4 kernels take group sizes "
                               f"{list(allowed)} or -1 (one group per output channel)")


def _compressed_tensors(qc: dict[str, Any], where: str) -> QuantConfig:
    groups = qc.get("config_groups") or {}
    if not groups:
        raise QuantConfigError(f"{where}: compressed-tensors config has no config_groups")
    rules = []
    for gname, g in groups.items():
        fmt = str(g.get("format") or qc.get("format") or "")
        w = g.get("weights")
        if not w:
            raise QuantConfigError(f"{where}.config_groups.{gname} quantizes no weights; revolta runs weight "
                                   f"formats only ({SUPPORTED['compressed-tensors']})")
        bits, kind = int(w.get("num_bits", 0)), str(w.get("type", "int"))
        strategy, group = str(w.get("strategy", "group")), w.get("group_size")
        if fmt == "pack-quantized" and kind == "int" and bits == 4 and strategy in ("group", "channel"):
            g_size = -1 if strategy == "channel" else int(group)
            _check_group(g_size, f"{where}.config_groups.{gname}", (32, 64, 128))
            scheme = WeightScheme(CT_INT4, 4, g_size, symmetric=bool(w.get("symmetric", True)))
        elif fmt == "nvfp4-pack-quantized" and kind == "float" and bits == 4 and int(group or 0) == 16:
            scheme = WeightScheme(CT_NVFP4, 4, 16, symmetric=True)
        else:
            raise QuantConfigError(
                f"{where}.config_groups.{gname}: format={fmt!r} with {kind}{bits} weights (strategy {strategy}, "
                f"group_size {group}) is not supported; compressed-tensors checkpoints revolta runs use "
                f"{SUPPORTED['compressed-tensors']}")
        if w.get("actorder") not in (None, False, "static") or g.get("weights", {}).get("block_structure"):
            raise QuantConfigError(f"{where}.config_groups.{gname}: activation-ordered or block-structured "
                                   "weights (g_idx) are not supported")
        rules.append((tuple(g.get("targets") or ("Linear",)), scheme))
    return QuantConfig("compressed-tensors", tuple(rules), tuple(qc.get("ignore") or ()), where, qc)


def _modelopt(qc: dict[str, Any], where: str) -> QuantConfig:
    algo = str(qc.get("quant_algo", ""))
    if algo.upper() != "NVFP4":
        raise QuantConfigError(f"{where}: ModelOpt quant_algo={algo!r} is not supported; revolta runs "
                               f"{SUPPORTED['modelopt']} (other formats: {_supported_list()})")
    group = int(qc.get("group_size", 16))
    if group != 16:
        raise QuantConfigError(f"{where}: NVFP4 group_size={group}; NVFP4 has one E4M3 scale per 16 values")
    ignore = tuple(qc.get("exclude_modules") or qc.get("ignore") or ())
    return QuantConfig("modelopt", ((("Linear",), WeightScheme(MODELOPT_NVFP4, 4, 16, True)),), ignore, where, qc)

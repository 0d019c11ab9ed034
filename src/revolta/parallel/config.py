"""ParallelConfig: tensor_parallel_size and decode_context_parallel_size, checked against the model.

Every rule is checked before a byte of weights is read, and each error names the value and the fix
(spec/parallel-and-quantization.md §2-3):
- tp divides the query heads, the GDN key and value heads, the routed and shared expert widths;
- tp and the KV head count divide one another (tp > kv_heads: each rank holds one KV head, replicated
  across the tp / kv_heads ranks that share it);
- tp % dcp == 0 and dcp <= max(1, tp / kv_heads) (DCP removes the K/V duplication, no more), dcp dividing
  tp / kv_heads (a DCP group is consecutive ranks that share one KV head);
- dcp divides the QSA indexer's compress ratio (the DCP attention kernel gives each rank ratio / dcp tokens of every
  compressed group; the Triton path would refuse it only at the first forward, after the weights loaded);
- packed (int4 / fp4) weights split along their input only at whole quantization groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import ModelConfig
from ..config_error import ConfigError


class ParallelConfigError(ConfigError):
    """A tensor/decode-context parallel layout the model cannot be split into; the message names the fix."""


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1

    def __post_init__(self) -> None:
        tp, dcp = self.tensor_parallel_size, self.decode_context_parallel_size
        if not isinstance(tp, int) or tp < 1:
            raise ParallelConfigError(f"tensor_parallel_size={tp!r} must be an integer >= 1")
        if not isinstance(dcp, int) or dcp < 1:
            raise ParallelConfigError(f"decode_context_parallel_size={dcp!r} must be an integer >= 1")
        if tp % dcp:
            raise ParallelConfigError(
                f"decode_context_parallel_size={dcp} does not divide tensor_parallel_size={tp}: DCP reuses the "
                f"TP ranks; pick a divisor of {tp} ({_divisors(tp)})")

    @property
    def tp(self) -> int:
        return self.tensor_parallel_size

    @property
    def dcp(self) -> int:
        return self.decode_context_parallel_size

    @property
    def world_size(self) -> int:
        """Processes (one per device): DCP runs on the TP ranks, so it adds none."""
        return self.tensor_parallel_size


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def validate_parallel(pc: ParallelConfig, cfg: ModelConfig) -> None:
    """Raise ParallelConfigError when `cfg`'s text model cannot be split `pc` ways (rules: module docstring)."""
    t, tp, dcp = cfg.text, pc.tp, pc.dcp
    if tp == 1 and dcp == 1:
        return
    splits = [("num_attention_heads", t.num_attention_heads), ("linear_num_key_heads", t.linear_num_key_heads),
              ("linear_num_value_heads", t.linear_num_value_heads),
              ("moe_intermediate_size", t.moe_intermediate_size),
              ("shared_expert_intermediate_size", t.shared_expert_intermediate_size)]
    for name, n in splits:
        if n % tp:
            raise ParallelConfigError(
                f"tensor_parallel_size={tp} does not divide text_config.{name}={n}; each rank must hold an equal "
                f"part: use a tensor_parallel_size among {_divisors(n)}")
    kv = t.num_key_value_heads
    if tp % kv and kv % tp:
        raise ParallelConfigError(
            f"tensor_parallel_size={tp} and num_key_value_heads={kv} must divide one another (each rank holds "
            f"kv_heads / tp KV heads, or one KV head shared by tp / kv_heads ranks); use a divisor or multiple of {kv}")
    max_dcp = max(1, tp // kv)
    if dcp > max_dcp:
        raise ParallelConfigError(
            f"decode_context_parallel_size={dcp} exceeds tensor_parallel_size / num_key_value_heads = {tp} / {kv}: "
            f"DCP only removes the K/V copies that ranks sharing a KV head would hold; use at most {max_dcp}")
    if dcp > 1 and (tp // kv) % dcp:
        raise ParallelConfigError(
            f"decode_context_parallel_size={dcp} does not divide tensor_parallel_size / num_key_value_heads = "
            f"{tp // kv}: a DCP group must be ranks that share one KV head; use a divisor of {tp // kv}")
    ratio = t.indexer_compress_ratio
    if dcp > 1 and ratio % dcp:
        fits = math.gcd(ratio, max_dcp)
        raise ParallelConfigError(
            f"decode_context_parallel_size={dcp} does not divide the QSA indexer's compress ratio "
            f"(text_config.indexer_compress_ratio={ratio}): the DCP attention kernel stripes every compressed group of "
            f"{ratio} tokens over the DCP ranks, ratio / dcp tokens each; use a decode_context_parallel_size among "
            f"{_divisors(fits)}")
    _check_groups(cfg, tp)


def _check_groups(cfg: ModelConfig, tp: int) -> None:
    """Row-parallel projections of a packed checkpoint split their input: each part must be whole groups."""
    q = cfg.quantization
    if q is None or not q.packed:
        return
    t = cfg.text
    inputs = [("experts' down_proj", "moe_intermediate_size", t.moe_intermediate_size),
              ("shared_expert.down_proj", "shared_expert_intermediate_size", t.shared_expert_intermediate_size),
              ("self_attn.o_proj", "num_attention_heads * head_dim", t.num_attention_heads * t.head_dim),
              ("linear_attn.out_proj", "linear_num_value_heads * linear_value_head_dim", t.gdn_value_dim)]
    for _, scheme in q.rules:
        if scheme.group_size == -1:
            continue
        for layer, what, n in inputs:
            if (n // tp) % scheme.group_size:
                raise ParallelConfigError(
                    f"tensor_parallel_size={tp} splits {layer}'s input ({what}={n}) into parts of {n // tp}, not a "
                    f"multiple of the checkpoint's quantization group {scheme.group_size}; use a smaller "
                    f"tensor_parallel_size")


def check_world_size(pc: ParallelConfig, visible_devices: int) -> None:
    """One process per device: refuse a world larger than the devices this process can see."""
    if pc.world_size > visible_devices:
        raise ParallelConfigError(
            f"tensor_parallel_size={pc.tp} needs {pc.world_size} devices but {visible_devices} are visible; lower "
            f"tensor_parallel_size or expose more devices (CUDA_VISIBLE_DEVICES)")

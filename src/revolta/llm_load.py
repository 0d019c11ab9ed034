"""The checkpoint side of `LLM(...)`: the speculative default from the weights it ships, and the length it asks for.

    resolve_llm_speculation   speculative_config: MTP4 by default only when the checkpoint ships its mtp.* weights
    requested_max_model_len   max_model_len: the argument, else the checkpoint's (the engine fits that to its cache)
    speculation_source        where the speculative default came from, for the start-up summary
    resolve_parallel          tensor_parallel_size / decode_context_parallel_size, checked before any weight loads
    build_engine              the engine: over the loaded model at tp=1, else over rank 0's shard of a started TPGroup
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .config import ModelConfig
from .engine import Engine, EngineConfig
from .engine.tp_executor import TPGroup
from .model import FlashNextModel
from .parallel import ParallelConfig, validate_parallel
from .parallel.devices import check_rank_devices, visible_gpus
from .spec.config import DFLASH2_METHODS, SpeculativeConfig
from .spec.resolve import resolve_speculative

logger = logging.getLogger("revolta.llm")  # these lines are part of the LLM's start-up log

# a config that declares the MTP layer, but a checkpoint without its weights (why MTP4 is not the default then)
NO_MTP_WEIGHTS = ("its config declares an MTP layer but the checkpoint ships no mtp.* weights (transformers' "
                  "save_pretrained and NeMo fine-tunes write none)")


def resolve_llm_speculation(raw: Mapping[str, Any] | SpeculativeConfig | None, cfg: ModelConfig, path: Path, *,
                            is_default: bool, mtp_weights: bool, dtype: str,
                            kv_cache_dtype: str, tensor_parallel_size: int = 1) -> SpeculativeConfig:
    """`LLM(speculative_config=raw)` parsed and checked before any weight loads; logs its warnings.

    None: MTP4 when the checkpoint ships its MTP weights, else off (an info line says why when the config declares
    the layer). An MTP request without those weights raises ValueError with the fix. DFlash2 on the embedded default
    without a drafter `model` uses the embedded default drafter."""
    if is_default and isinstance(raw, Mapping) and raw.get("method") in DFLASH2_METHODS and raw.get("model") is None:
        from .presets import default_drafter_for

        drafter = default_drafter_for(path)
        raw = {**raw, "model": str(drafter)}
    declared = cfg.text.mtp is not None
    if raw is None and declared and not mtp_weights:
        logger.info("speculative decoding off: %s; MTP4 is the default only for checkpoints that ship them",
                    NO_MTP_WEIGHTS)
        raw = {"method": None}
    spec, warnings = resolve_speculative(raw, cfg, has_mtp=declared, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                                         tensor_parallel_size=tensor_parallel_size)  # sm70_dflash2 defaults read tp
    if spec.method == "mtp" and not mtp_weights:
        raise ValueError(f"speculative_config method='mtp' needs the MTP head's weights, but {path}: {NO_MTP_WEIGHTS}; "
                         "leave speculative_config unset or pass {'method': None} to decode without speculation")
    for warning in warnings:
        logger.warning(warning)
    return spec


def speculation_source(cfg: ModelConfig, mtp_weights: bool) -> str:
    """How the speculative default was chosen (the start-up summary's source column)."""
    if mtp_weights:
        return "default (MTP4: the checkpoint ships its MTP layer)"
    if cfg.text.mtp is not None:
        return "default (off: the config declares an MTP layer, the checkpoint ships no mtp.* weights)"
    return "default (no MTP layer)"


def requested_max_model_len(max_model_len: int | None, cfg: ModelConfig) -> tuple[int, bool]:
    """(max_model_len to plan for, whether the engine may lower it to fit its cache).

    None asks for the checkpoint's max_position_embeddings, which the engine lowers (with a warning) when the cache
    cannot hold one sequence of it; an explicit value is kept, and one that does not fit is an error."""
    limit = cfg.text.max_position_embeddings
    if max_model_len is None:
        return limit, True
    if not isinstance(max_model_len, int) or isinstance(max_model_len, bool) or max_model_len < 2:
        raise ValueError(f"max_model_len={max_model_len!r} must be an integer >= 2 (or None: the checkpoint's)")
    if max_model_len > limit:
        logger.warning("max_model_len=%d exceeds the model's max_position_embeddings=%d", max_model_len, limit)
    return int(max_model_len), False


def resolve_parallel(engine_args: Mapping[str, Any], cfg: ModelConfig, device: torch.device) -> ParallelConfig:
    """The parallel layout `LLM(...)` asks for, refused (ParallelConfigError naming the fix) before any weight is
    read when the model cannot be split so or this generation path cannot run it yet."""
    pc = ParallelConfig(engine_args.get("tensor_parallel_size", 1), engine_args.get("decode_context_parallel_size", 1))
    validate_parallel(pc, cfg)
    if pc.tp == 1:
        return pc
    check_rank_devices(device, pc, visible_gpus() if device.type == "cuda" else [])  # rank r on cuda:r, alike GPUs
    return pc


def build_engine(model: FlashNextModel | None, config: EngineConfig, path: Path, cfg: ModelConfig,
                 dtype: torch.dtype, with_mtp: bool, ple_placement: str = "device",
                 device: torch.device = torch.device("cpu"), **kwargs: Any) -> Engine:
    """Engine(model, config) at tp=1. At tp > 1 (`model` is None): start the TP group (rank 0's shard is loaded
    here, each worker loads its own; "host" / "disk" PLE placement: each rank its rows of the table) and run the
    engine over rank 0's shard, rank r on `device`'s kind (cuda: cuda:r, NCCL); a failed start leaves no worker."""
    if config.tensor_parallel_size == 1:
        return Engine(model, config, **kwargs)
    group = TPGroup.start(cfg, path, config.tensor_parallel_size, with_mtp=with_mtp, dtype=dtype,
                          dcp=config.decode_context_parallel_size, ple_placement=ple_placement, device=device)
    try:
        return Engine(group.model, config, tp_group=group, **kwargs)
    except BaseException:
        group.close(timeout_s=5)
        raise

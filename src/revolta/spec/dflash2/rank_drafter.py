"""A tensor-parallel rank's DFlash2 drafter: its layers split like a decoder layer, optionally its codebook rows.

Per drafter layer (docs/parallel.md "DFlash2"): q_proj, k_proj, v_proj column-parallel (rank r holds query heads
[r * Hq/tp, (r + 1) * Hq/tp) and the KV heads they read, [r * Hkv/tp, ...)), o_proj row-parallel; the MLP's
gate_proj and up_proj column-parallel, down_proj row-parallel; one all-reduce after each row-parallel projection
(parallel/layers.py `RowParallelLinear`, whose bias is added once). q_norm / k_norm act per head; the
convolutions, the norms, fc and the selector's hidden_projection act on whole hidden rows and are replicated. So a
rank's context K/V holds its KV heads only. A drafter whose KV heads or MLP width tp does not divide keeps its
layers whole on every rank (`local_config` returns the config unchanged).

With `shard_codebooks` (sm70_dflash2 `sharded_selector_codebook`) the selector holds its vocabulary rows of both
codebooks (sharded_codebook.py); otherwise the whole tables.

Loading reads only the rank's slice of every split tensor (safetensors `get_slice` on the memory-mapped files),
after checking every name and full shape from the headers, as the single-process loader does.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from ...parallel.context import ParallelContext
from ...parallel.layers import RowParallelLinear
from ...weights import CheckpointError, checkpoint_files, materialize
from .checkpoint import CODEBOOK_RENAMES
from .draft_config import DFlash2DraftConfig
from .model import DFlash2DraftModel
from .sharded_codebook import (
    CODEBOOKS,
    PREFIX,
    ShardedCodebooks,
    codebook_bytes_per_gpu,
    load_codebook_shards,
)

logger = logging.getLogger(__name__)

# parameter name suffix -> (dim split, what a rank's range counts: "q" query heads, "kv" KV heads, "mlp" channels)
_SPLIT = {"self_attn.q_proj.weight": (0, "q"), "self_attn.q_proj.bias": (0, "q"),
          "self_attn.k_proj.weight": (0, "kv"), "self_attn.k_proj.bias": (0, "kv"),
          "self_attn.v_proj.weight": (0, "kv"), "self_attn.v_proj.bias": (0, "kv"),
          "self_attn.o_proj.weight": (1, "q"),
          "mlp.gate_proj.weight": (0, "mlp"), "mlp.up_proj.weight": (0, "mlp"), "mlp.down_proj.weight": (1, "mlp")}


def splits_layers(cfg: DFlash2DraftConfig, tp: int) -> bool:
    """Whether tp ranks can split the drafter's layers (whole KV heads and MLP channels per rank)."""
    return tp > 1 and cfg.num_key_value_heads % tp == 0 and cfg.intermediate_size % tp == 0


def local_config(cfg: DFlash2DraftConfig, tp: int) -> DFlash2DraftConfig:
    """The config one rank's layers are built from: head counts and MLP width divided by tp (when they split)."""
    if not splits_layers(cfg, tp):
        return cfg
    return replace(cfg, num_attention_heads=cfg.num_attention_heads // tp,
                   num_key_value_heads=cfg.num_key_value_heads // tp, intermediate_size=cfg.intermediate_size // tp)


def _slice(name: str, local: DFlash2DraftConfig, rank: int) -> tuple[int, int, int] | None:
    """(dim, start, end) of the full tensor `name` rank `rank` holds; None: whole."""
    if not name.startswith("layers."):
        return None
    suffix = name.split(".", 2)[2]
    if suffix not in _SPLIT:
        return None
    dim, unit = _SPLIT[suffix]
    d = local.head_dim
    n = {"q": local.num_attention_heads * d, "kv": local.num_key_value_heads * d, "mlp": local.intermediate_size}[unit]
    return dim, rank * n, (rank + 1) * n


def build_rank_drafter(cfg: DFlash2DraftConfig, ctx: ParallelContext) -> DFlash2DraftModel:
    """This rank's drafter on the meta device: the local config's shapes, o_proj / down_proj row-parallel."""
    local = local_config(cfg, ctx.size)
    with torch.device("meta"):
        model = DFlash2DraftModel(local)
        if local is not cfg:
            for layer in model.layers:
                attn = layer.self_attn
                attn.o_proj = RowParallelLinear(attn.o_proj.in_features, cfg.hidden_size, ctx, bias=cfg.attention_bias)
                layer.mlp.down_proj = RowParallelLinear(local.intermediate_size, cfg.hidden_size, ctx)
    model.cfg = cfg  # the full geometry: the drafter interface checks it against the target
    return model


def rank_weight_bytes(path: str | Path, element_bytes: int, tensor_parallel_size: int = 1,
                      sharded_codebooks: bool = False) -> int:
    """Bytes of the drafter's weights on the rank holding the most (rank 0), at `element_bytes` per value, from
    config.json alone: its layers' part (the local config's tensors) plus `codebook_bytes_per_gpu`."""
    cfg = DFlash2DraftConfig.from_pretrained(path)
    with torch.device("meta"):
        model = DFlash2DraftModel(local_config(cfg, tensor_parallel_size))
    books = {f"{PREFIX}{n}.weight" for n in CODEBOOKS}
    rest = sum(p.numel() for n, p in model.named_parameters() if n not in books)
    return rest * element_bytes + codebook_bytes_per_gpu(cfg.vocab_size, cfg.selector_rank, tensor_parallel_size,
                                                         sharded_codebooks, element_bytes)


def load_rank_drafter(path: str | Path, ctx: ParallelContext, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu", shard_codebooks: bool = True) -> DFlash2DraftModel:
    """Rank ctx.rank's drafter, reading only its slices; raises CheckpointError listing every mismatch."""
    cfg = DFlash2DraftConfig.from_pretrained(path)
    model = build_rank_drafter(cfg, ctx)
    if not splits_layers(cfg, ctx.size):
        logger.info("DFlash2 drafter layers replicated: tensor_parallel_size=%d does not divide its %d KV heads and "
                    "%d MLP channels", ctx.size, cfg.num_key_value_heads, cfg.intermediate_size)
    with torch.device("meta"):
        full = dict(DFlash2DraftModel(cfg).named_parameters())  # the checkpoint's shapes
    skip: tuple[str, ...] = ()
    if shard_codebooks:
        rows = load_codebook_shards(path, cfg.vocab_size, cfg.selector_rank, ctx.rank, ctx.size)
        pred, succ = (rows[n].to(dtype=dtype, device=device) for n in CODEBOOKS)  # [V_local, R] each
        model.candidate_selector.shard_codebooks(ShardedCodebooks(pred, succ, cfg.vocab_size, ctx))
        skip = tuple(f"{PREFIX}{n}" for n in CODEBOOKS)
    plan = _plan(path, full, skip)
    materialize(model, device, dtype)
    local = local_config(cfg, ctx.size)
    params = dict(model.named_parameters())
    for file, pairs in plan.items():
        with safe_open(str(file), framework="pt", device="cpu") as sf:
            for key, name in pairs:
                sl = _slice(name, local, ctx.rank)
                view = sf.get_slice(key)
                if sl is None:
                    part = view[:]
                else:
                    dim, start, end = sl
                    part = view[start:end] if dim == 0 else view[:, start:end]
                with torch.no_grad():
                    params[name].copy_(part)
    return model.eval()


def _plan(path: str | Path, full: dict[str, torch.Tensor], skip: tuple[str, ...]) -> dict[Path, list[tuple[str, str]]]:
    """{file: [(on-disk key, parameter name)]} after checking names and full shapes from the headers."""
    by_file: dict[Path, list[str]] = {}
    for key, file in checkpoint_files(path).items():
        by_file.setdefault(file, []).append(key)
    plan: dict[Path, list[tuple[str, str]]] = {}
    seen, errors = set(), []
    for file, keys in sorted(by_file.items()):
        with safe_open(str(file), framework="pt", device="cpu") as sf:
            for key in keys:
                name = CODEBOOK_RENAMES.get(key, key)
                if name.startswith(skip):
                    continue
                if name not in full:
                    errors.append(f"unexpected tensor {key}")
                    continue
                shape, want = tuple(sf.get_slice(key).get_shape()), tuple(full[name].shape)
                if shape != want:
                    errors.append(f"{key}: shape {list(shape)} in the file, {list(want)} in the model")
                    continue
                seen.add(name)
                plan.setdefault(file, []).append((key, name))
    errors += [f"missing tensor {n}" for n in sorted(set(full) - seen) if not n.startswith(skip)]
    if errors:
        raise CheckpointError(f"DFlash2 drafter checkpoint {path} does not match its config.json:\n  "
                              + "\n  ".join(errors))
    return plan

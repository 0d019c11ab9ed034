"""Writing checkpoints with the official names: the inverse of weights.py's load mapping.

`save_checkpoint(model, dir)` writes safetensors shards (the PLE table split into `shard_{s}` row parts, experts
in the grouped 3-D layout) and `model.safetensors.index.json`; `checkpoint_tensors` yields the on-disk names.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from tqdm.auto import tqdm

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

def checkpoint_tensors(
    state: nn.Module | Mapping[str, torch.Tensor], split_ngram_parts: int = 1
) -> Iterator[tuple[str, torch.Tensor]]:
    """The on-disk (name, tensor view) pairs of a model or state dict: the inverse of the load mapping.

    The PLE table is split row-wise into `split_ngram_parts` shards named `shard_{s}`; experts stay in the
    official grouped 3-D layout; every other name is written as is.
    """
    sd = state.state_dict() if isinstance(state, nn.Module) else state
    for name, t in sd.items():
        if name.endswith(".ngram_embedding.weight"):
            if t.shape[0] % split_ngram_parts:
                raise ValueError(f"{name}: {t.shape[0]} rows do not split into {split_ngram_parts} equal shards")
            base = name[: -len(".weight")]
            for s, part in enumerate(t.chunk(split_ngram_parts, dim=0)):
                yield f"{base}.shard_{s}.weight", part
        else:
            yield name, t


def save_checkpoint(
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    directory: str | Path,
    *,
    max_shard_bytes: int = 5 << 30,
    split_ngram_parts: int | None = None,
    progress: bool = True,
) -> None:
    """Write safetensors shards with the official names, plus `model.safetensors.index.json`.

    Writes a single `model.safetensors` (no index) when everything fits in `max_shard_bytes`. Earlier
    `model*.safetensors` files and the index in `directory` are removed first. `split_ngram_parts=None` reads
    `cfg.text.split_ngram_parts` from the model when it has one, else 1. Shards are written one at a time.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if split_ngram_parts is None:
        split_ngram_parts = _config_split_parts(model_or_state_dict)
    tensors = list(checkpoint_tensors(model_or_state_dict, split_ngram_parts))
    for name, t in tensors:
        if t.is_meta:
            raise ValueError(f"{name} is on the meta device; materialise and load the model before saving")
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += nbytes
    for old in [*directory.glob("model*.safetensors"), directory / INDEX_FILE]:
        if old.name in (SINGLE_FILE, INDEX_FILE) or re.fullmatch(r"model-\d+-of-\d+\.safetensors", old.name):
            old.unlink(missing_ok=True)
    n = len(shards)
    weight_map = {}
    for i, shard in enumerate(tqdm(shards, desc="Saving weights", unit="shard", disable=not progress)):
        fname = SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        seen: set[int] = set()
        out = {}
        for name, t in shard:
            t = t.detach().to("cpu").contiguous()
            # safetensors refuses shared storage (tied weights, PLE shards of one table): copy repeats
            key = t.untyped_storage().data_ptr()
            if key in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr())
            out[name] = t
            weight_map[name] = fname
        save_file(out, directory / fname, metadata={"format": "pt"})
        del out
    if n > 1:
        total = sum(t.numel() * t.element_size() for _, t in tensors)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _config_split_parts(obj) -> int:
    cfg = getattr(obj, "cfg", None) or getattr(obj, "config", None)
    for holder in (getattr(cfg, "text", None), getattr(cfg, "text_config", None), cfg):
        parts = getattr(holder, "split_ngram_parts", None)
        if isinstance(parts, int) and parts >= 1:
            return parts
    return 1

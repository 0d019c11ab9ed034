"""Load a dflash-format DFlash2 drafter directory (config.json + safetensors) into `DFlash2DraftModel`.

In-memory names are the `dflash` package's state-dict names. Released DFlash2 checkpoints store the two
selector codebooks without the `.weight` suffix (`candidate_selector.predecessor_codebook`); both spellings
load. Every name and shape is checked from the file headers before any data is read (`revolta.weights`):
a missing, unexpected or wrongly shaped tensor raises one `CheckpointError` listing them all.

At tensor_parallel_size > 1 with `sharded_selector_codebook` (`ctx` given), each rank reads only its
vocabulary rows of both codebooks (their header shapes checked first, sharded_codebook.py) and its
selector holds those; the whole tables are never read or allocated. `rank_weight_bytes` is what one rank
holds, computed from config.json before anything loads (the engine adds it to its memory budget).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...parallel.context import ParallelContext
from ...weights import load_weights, save_checkpoint
from .draft_config import DFlash2DraftConfig
from .model import DFlash2DraftModel
from .sharded_codebook import (
    CODEBOOKS,
    PREFIX,
    ShardedCodebooks,
    codebook_bytes_per_gpu,
    load_codebook_shards,
)

# the released layout's codebook names -> the module's parameter names
CODEBOOK_RENAMES = {f"candidate_selector.{n}": f"candidate_selector.{n}.weight"
                    for n in ("predecessor_codebook", "successor_codebook")}


def load_draft_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                     progress: bool = False, ctx: ParallelContext | None = None) -> DFlash2DraftModel:
    """Build the drafter for `path/config.json` and load its weights; returns it in eval mode.

    ctx: shard the selector codebooks over this tensor-parallel group (None or size 1: whole tables)."""
    cfg = DFlash2DraftConfig.from_pretrained(path)
    with torch.device("meta"):
        model = DFlash2DraftModel(cfg)
    skip: tuple[str, ...] = ()
    if ctx is not None and ctx.size > 1:
        rows = load_codebook_shards(path, cfg.vocab_size, cfg.selector_rank, ctx.rank, ctx.size)
        pred, succ = (rows[n].to(dtype=dtype, device=device) for n in CODEBOOKS)  # [V_local, R] each
        model.candidate_selector.shard_codebooks(ShardedCodebooks(pred, succ, cfg.vocab_size, ctx))
        # the on-disk tables (either spelling) and the shards' names: read above, not by load_weights
        skip = (*(PREFIX + n for n in CODEBOOKS), PREFIX + "codebook_shards.")
    load_weights(model, path, dtype=dtype, device=device, skip_prefixes=skip, renames=CODEBOOK_RENAMES,
                 progress=progress)
    return model.eval()


def rank_weight_bytes(path: str | Path, element_bytes: int, tensor_parallel_size: int = 1,
                      sharded_codebooks: bool = False) -> int:
    """Bytes of the drafter's weights on the rank holding the most (rank 0), at `element_bytes` per value:
    every tensor whole except the codebooks, which are `codebook_bytes_per_gpu`'s."""
    cfg = DFlash2DraftConfig.from_pretrained(path)
    with torch.device("meta"):
        model = DFlash2DraftModel(cfg)
    books = {f"{PREFIX}{n}.weight" for n in CODEBOOKS}
    rest = sum(p.numel() for n, p in model.named_parameters() if n not in books)
    return rest * element_bytes + codebook_bytes_per_gpu(cfg.vocab_size, cfg.selector_rank, tensor_parallel_size,
                                                         sharded_codebooks, element_bytes)


def save_draft_model(model: DFlash2DraftModel, directory: str | Path) -> Path:
    """Write config.json and model.safetensors (the dflash state-dict names) into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, directory, split_ngram_parts=1, progress=False)
    model.cfg.save(directory)
    return directory

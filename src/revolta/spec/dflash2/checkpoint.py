"""Load a dflash-format DFlash2 drafter directory (config.json + safetensors) into `DFlash2DraftModel`.

In-memory names are the `dflash` package's state-dict names. Released DFlash2 checkpoints store the two
selector codebooks without the `.weight` suffix (`candidate_selector.predecessor_codebook`); both spellings
load. Every name and shape is checked from the file headers before any data is read (`revolta.weights`):
a missing, unexpected or wrongly shaped tensor raises one `CheckpointError` listing them all.
At tensor_parallel_size > 1 each rank loads its part instead (rank_drafter.py `load_rank_drafter`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...weights import load_weights, save_checkpoint
from .draft_config import DFlash2DraftConfig
from .model import DFlash2DraftModel

# the released layout's codebook names -> the module's parameter names
CODEBOOK_RENAMES = {f"candidate_selector.{n}": f"candidate_selector.{n}.weight"
                    for n in ("predecessor_codebook", "successor_codebook")}


def load_draft_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                     progress: bool = False) -> DFlash2DraftModel:
    """Build the drafter for `path/config.json` and load its weights; returns it in eval mode."""
    cfg = DFlash2DraftConfig.from_pretrained(path)
    with torch.device("meta"):
        model = DFlash2DraftModel(cfg)
    load_weights(model, path, dtype=dtype, device=device, renames=CODEBOOK_RENAMES, progress=progress)
    return model.eval()


def save_draft_model(model: DFlash2DraftModel, directory: str | Path) -> Path:
    """Write config.json and model.safetensors (the dflash state-dict names) into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, directory, split_ngram_parts=1, progress=False)
    model.cfg.save(directory)
    return directory

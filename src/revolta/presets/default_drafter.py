"""The embedded default DFlash2 drafter: a small drafter matching the default model, built offline.

`ensure_default_drafter()` returns a dflash-format drafter directory (config.json, model.safetensors)
beside the default model under `$REVOLTA_CACHE` (see `default.py`), writing it the first time. It
runs at the default's width (128) with two layers (one sliding-window, one full attention), taps the
default's layers 1, 3 and 5 (the `dflash` default spread over its 8 layers for three taps), drafts
blocks of 8 (7 drafts) and has a rank-16 selector over the full vocabulary. Weights are
deterministic random values, so its drafts are as meaningless as the default's text; it exists so
the whole DFlash2 path runs on any machine. The mask token is 248077, the first embedding row past
the tokenizer's added tokens (no text encodes to it).

The directory name hashes the drafter config, its seed, `FORMAT_VERSION` and the default model's
own hash, so a changed preset or target is written to a new directory.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from . import default

FORMAT_VERSION = 1
DRAFTER_WEIGHT_SEED = 1

DRAFTER_CONFIG: dict[str, Any] = {
    "architectures": ["DFlash2DraftModel"],
    "model_type": "qwen3",
    "vocab_size": 248320,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "layer_types": ["sliding_attention", "full_attention"],
    "use_sliding_window": True,
    "sliding_window": 64,
    "num_target_layers": 8,
    "dflash_config": {
        "target_layer_ids": [1, 3, 5],
        "block_size": 8,
        "mask_token_id": 248077,
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 16,
        "selector_top_k": 16,
        "tap_reduction": "hc_read",
    },
}


def default_drafter_config():
    """The preset's validated DFlash2DraftConfig, checked against the default model."""
    from ..spec.dflash2.draft_config import DFlash2DraftConfig

    cfg = DFlash2DraftConfig.from_dict(json.loads(json.dumps(DRAFTER_CONFIG)), source="revolta default drafter")
    text = default.default_config().text
    cfg.check_target(text.num_hidden_layers, text.hidden_size, text.vocab_size, "revolta default drafter")
    return cfg


def drafter_hash() -> str:
    h = hashlib.sha256(json.dumps(DRAFTER_CONFIG, sort_keys=True).encode())
    h.update(f"seed={DRAFTER_WEIGHT_SEED} dtype={default.DISK_DTYPE} format={FORMAT_VERSION}".encode())
    h.update(default.preset_hash().encode())
    return h.hexdigest()[:12]


def default_drafter_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the default drafter lives (whether or not it was built yet)."""
    return default.cache_root(cache_dir) / f"default-dflash2-{drafter_hash()}"


def ensure_default_drafter(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the default drafter's directory, building it first if needed (about a second)."""
    return default.build_once(default_drafter_dir(cache_dir), write_default_drafter, "the default DFlash2 drafter")


def init_drafter_weights(model, seed: int = DRAFTER_WEIGHT_SEED) -> None:
    """`init_random_weights`, then norm gains around 1 and the convolutions' tap 0 around identity
    (the drafter's norms are plain gains, not revolta's zero-centred (1 + w) ones)."""
    import torch

    from ..model import init_random_weights

    init_random_weights(model, seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(1.0)
            elif name.endswith("base_kernel"):
                p[:, 0].add_(1.0)


def write_default_drafter(directory: str | os.PathLike) -> Path:
    """Write the preset drafter into `directory` (no atomicity here; see `ensure_default_drafter`)."""
    import torch

    from ..spec.dflash2.checkpoint import save_draft_model
    from ..spec.dflash2.model import DFlash2DraftModel

    model = DFlash2DraftModel(default_drafter_config())
    init_drafter_weights(model)
    model.to(getattr(torch, default.DISK_DTYPE))
    directory = save_draft_model(model, directory)
    marker = {"preset": "default-dflash2", "hash": drafter_hash(), "format_version": FORMAT_VERSION,
              "weight_seed": DRAFTER_WEIGHT_SEED, "target_preset_hash": default.preset_hash(),
              "note": "random weights: drafts are not meaningful"}
    (directory / default.PRESET_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return directory

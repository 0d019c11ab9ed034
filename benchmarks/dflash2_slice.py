"""A DFlash2 drafter shaped like the released one, for a `bench_e2e.slice_config` target.

The released Qwen3.8 DFlash2 drafter (spec/engine.md §2.1-2.2) has 5 sliding-window layers (window
2048) at the target width, blocks of 8 (7 drafts), a rank-256 selector with top-16 candidates and
taps at 5 target layer boundaries. This one keeps those shapes (32 query heads, 8 KV heads of 128,
a 9,728-wide MLP: the Qwen3 drafter's) with random weights, and taps the slice's layers (the slice
has too few layers for the real ids). Weights are drawn on the device and written once to `directory`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from revolta.config import ModelConfig
from revolta.presets.default_drafter import init_drafter_weights
from revolta.spec.dflash2.checkpoint import save_draft_model
from revolta.spec.dflash2.draft_config import DFlash2DraftConfig
from revolta.spec.dflash2.model import DFlash2DraftModel


def slice_drafter_config(target: ModelConfig, num_layers: int = 5) -> dict:
    t = target.text
    taps = sorted({round(i * (t.num_hidden_layers - 1) / 4) for i in range(5)})  # up to 5 distinct boundaries
    return {"architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "vocab_size": t.vocab_size,
            "hidden_size": t.hidden_size, "intermediate_size": 9728, "num_hidden_layers": num_layers,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "layer_types": ["sliding_attention"] * num_layers, "use_sliding_window": True, "sliding_window": 2048,
            "num_target_layers": t.num_hidden_layers,
            "dflash_config": {"target_layer_ids": taps, "block_size": 8, "mask_token_id": t.vocab_size - 1,
                              "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256,
                              "selector_top_k": 16}}


def write_slice_drafter(target: ModelConfig, directory: str | Path, device: str = "cuda",
                        dtype: torch.dtype = torch.float16) -> str:
    """Build (on `device`) and save the drafter; returns the directory for speculative_config["model"]."""
    cfg = DFlash2DraftConfig.from_dict(slice_drafter_config(target), source="bench slice drafter")
    with torch.device(device):
        model = DFlash2DraftModel(cfg)
    init_drafter_weights(model, seed=7)
    save_draft_model(model.to(dtype), directory)
    return str(directory)

"""DFlash2 drafter config.json files for the configuration tests (no weights: the checks read none)."""

from __future__ import annotations

import json
from pathlib import Path

from revolta.config import ModelConfig
from test_paged_model import TINY

REAL = Path(__file__).parents[1] / "data" / "qwen3_8_flash_next_config.json"


def drafter_config(target: ModelConfig, **overrides) -> dict:
    """A dflash-format DFlash2 drafter for `target`: 3 layers, two of them sliding (window 64)."""
    cfg = {"architectures": ["DFlash2DraftModel"], "vocab_size": target.text.vocab_size,
           "hidden_size": target.text.hidden_size, "intermediate_size": 2 * target.text.hidden_size,
           "num_hidden_layers": 3, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
           "layer_types": ["sliding_attention", "sliding_attention", "full_attention"], "sliding_window": 64,
           "use_sliding_window": True,
           "dflash_config": {"block_size": 8, "mask_token_id": 3, "selector_rank": 16, "selector_top_k": 4,
                             "conv_kernel_size": 2, "conv_group_size": 16}}
    L = target.text.num_hidden_layers  # taps: dflash's default spread, explicit on a tiny target (too few layers)
    cfg["num_target_layers"] = L
    if L < 8:
        cfg["dflash_config"]["target_layer_ids"] = [0, L // 2, L - 1]
    draft = overrides.pop("dflash_config", {})
    cfg.update(overrides)
    cfg["dflash_config"] = {**cfg["dflash_config"], **draft}
    return cfg


def write_drafter(path: Path, target: ModelConfig | None = None, **overrides) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(drafter_config(target or tiny_target(), **overrides)))
    return str(path)


def tiny_target() -> ModelConfig:
    return ModelConfig.from_dict(TINY)

"""What the configuration checks and the cache plan need from a DFlash2 drafter's config.json.

Read without torch and before any weight loads (spec/engine.md §8: checks run at configuration
time). The facts are derived from the drafter model's own parse, `DFlash2DraftConfig`
(spec/dflash2/draft_config.py), so that everything the model would refuse is refused at configuration
time and the facts cannot disagree with the model (the tapped layers with its defaults, the sliding
layout under Qwen3's `use_sliding_window` / `max_window_layers` rules, `block_size` defaulting to 16).
A DFlash v1 drafter (no candidate selector) is refused here with its own message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .draft_config import SLIDING, DFlash2DraftConfig


@dataclass(frozen=True)
class DrafterFacts:
    """Shape facts of one drafter checkpoint (per model, not per TP rank)."""

    path: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # anchor + drafts: block_size - 1 drafts per round
    num_sliding_layers: int  # layers with sliding-window attention over the context
    sliding_window: int | None  # tokens, None when no layer slides
    has_attention_sinks: bool  # `attention_sink_bias` declared (the model has none; the int8 check reads it)
    selector_rank: int
    selector_top_k: int
    target_layer_ids: tuple[int, ...]  # tapped target layers
    num_target_layers: int | None = None  # layers of the target it was trained on, when declared
    intermediate_size: int = 0  # MLP width (with the KV heads it decides whether tp splits the layers)

    @property
    def num_full_layers(self) -> int:
        return self.num_layers - self.num_sliding_layers

    @classmethod
    def from_dir(cls, path: str | Path) -> "DrafterFacts":
        """Raise ValueError naming the directory when it is not a DFlash2 drafter checkpoint."""
        d = Path(path).expanduser()
        if not d.is_dir():
            raise ValueError(f"speculative_config model={str(path)!r} is not a directory; pass the DFlash2 drafter "
                             "checkpoint directory (config.json + *.safetensors)")
        cfg = d / "config.json"
        if not cfg.is_file():
            raise ValueError(f"speculative_config model={str(path)!r} has no config.json; pass the DFlash2 drafter "
                             "checkpoint directory")
        try:
            raw = json.loads(cfg.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg}: not valid JSON ({e.msg} at line {e.lineno})") from None
        return cls.from_dict(raw, str(d))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], path: str = "<dict>") -> "DrafterFacts":
        draft = raw.get("dflash_config") or {}

        def value(name: str) -> Any:  # dflash_config first, then the top level, as the dflash package looks up
            return draft.get(name, raw.get(name)) if isinstance(draft, Mapping) else raw.get(name)

        if not (value("selector_rank") and value("selector_top_k")):
            raise ValueError(f"speculative_config model={path!r} is a DFlash drafter without the DFlash2 candidate "
                             "selector (no selector_rank / selector_top_k in its config.json); revolta runs DFlash2 "
                             "drafters only")
        cfg = DFlash2DraftConfig.from_dict(dict(raw), source=f"{path}/config.json")  # a DraftConfigError is a ValueError
        sliding = sum(t == SLIDING for t in cfg.layer_types)
        return cls(path=path, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers,
                   num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, block_size=cfg.block_size,
                   num_sliding_layers=sliding, sliding_window=cfg.sliding_window if sliding else None,
                   has_attention_sinks=bool(value("attention_sink_bias")), selector_rank=cfg.selector_rank,
                   selector_top_k=cfg.selector_top_k, target_layer_ids=cfg.target_layer_ids,
                   num_target_layers=cfg.num_target_layers, intermediate_size=cfg.intermediate_size)

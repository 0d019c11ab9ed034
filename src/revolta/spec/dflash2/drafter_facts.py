"""What the configuration checks and the cache plan need from a DFlash2 drafter's config.json.

Read without torch and before any weight loads (spec/engine.md §8: checks run at configuration
time). Values are looked up the way the `dflash` 0.1.0 package does: `dflash_config.<name>` first,
then the top-level `<name>`; `block_size` defaults to 16 there, and so here. The attention layout
follows the Qwen3 config rules that package builds on: `sliding_window` counts only when
`use_sliding_window` is true, and without `layer_types` the layers from `max_window_layers` on
slide. The drafter model reads its own full config (spec/dflash2/draft_config.py); this is only the
part the checks and the cache plan use. For a DFlash2 drafter that full config is parsed here too, so
everything the model would refuse is refused at configuration time, and the tapped layers are the
model's (its defaults included).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_BLOCK_SIZE = 16  # the dflash package's default when a checkpoint declares none


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
    has_attention_sinks: bool  # `attention_sink_bias` declared
    selector_rank: int | None  # None: no candidate selector (a DFlash v1 drafter)
    selector_top_k: int | None
    target_layer_ids: tuple[int, ...] | None = None  # tapped target layers (the drafter model's; None for DFlash v1)
    num_target_layers: int | None = None  # layers of the target it was trained on, when declared

    @property
    def is_dflash2(self) -> bool:
        """DFlash2 = DFlash + grouped dynamic convs + the candidate selector (spec/engine.md §2.2)."""
        return bool(self.selector_rank) and bool(self.selector_top_k)

    @property
    def num_full_layers(self) -> int:
        return self.num_layers - self.num_sliding_layers

    @classmethod
    def from_dir(cls, path: str | Path) -> "DrafterFacts":
        """Raise ValueError naming the directory when it is not a drafter checkpoint."""
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

        def value(name: str, default: Any = None) -> Any:
            return draft.get(name, raw.get(name, default))

        def need_int(name: str) -> int:
            v = raw.get(name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{path}/config.json: {name}={v!r} must be a positive integer")
            return v

        layers = need_int("num_hidden_layers")
        heads = need_int("num_attention_heads")
        hidden = need_int("hidden_size")
        kv_heads = raw.get("num_key_value_heads", heads)
        head_dim = raw.get("head_dim") or hidden // heads
        window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
        first = raw.get("max_window_layers", 28)
        types = raw.get("layer_types") or ["sliding_attention" if window is not None and i >= first
                                           else "full_attention" for i in range(layers)]
        if len(types) != layers:
            raise ValueError(f"{path}/config.json: layer_types has {len(types)} entries for num_hidden_layers={layers}")
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"{path}/config.json: sliding_window={window!r} must be a positive number of tokens")
        sliding = sum(t == "sliding_attention" for t in types)
        if sliding and window is None:  # dflash would attend to the whole context there; revolta's drafter refuses
            raise ValueError(f"{path}/config.json: layer_types has {sliding} sliding_attention layers but no window; "
                             "set use_sliding_window=true and sliding_window")
        block = value("block_size", DEFAULT_BLOCK_SIZE)
        if not isinstance(block, int) or block < 2:
            raise ValueError(f"{path}/config.json: block_size={block!r} must be an integer >= 2 (anchor + drafts)")
        rank, top_k = value("selector_rank"), value("selector_top_k")
        taps = value("target_layer_ids")
        if taps is not None and (not isinstance(taps, list) or not all(isinstance(i, int) for i in taps)):
            raise ValueError(f"{path}/config.json: target_layer_ids={taps!r} must be a list of layer indices")
        if rank and top_k:  # whatever the drafter model would refuse is refused now, before any weight loads
            from .draft_config import DFlash2DraftConfig

            taps = list(DFlash2DraftConfig.from_dict(dict(raw), source=f"{path}/config.json").target_layer_ids)
        return cls(path=path, vocab_size=need_int("vocab_size"), hidden_size=hidden, num_layers=layers,
                   num_kv_heads=int(kv_heads), head_dim=int(head_dim), block_size=block, num_sliding_layers=sliding,
                   sliding_window=window if sliding else None,
                   has_attention_sinks=bool(value("attention_sink_bias")),
                   selector_rank=int(rank) if rank else None, selector_top_k=int(top_k) if top_k else None,
                   target_layer_ids=None if taps is None else tuple(taps), num_target_layers=raw.get("num_target_layers"))

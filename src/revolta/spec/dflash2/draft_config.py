"""The DFlash2 drafter's config.json, read the way the `dflash` 0.1.0 package reads it.

A dflash checkpoint's config.json is a Qwen3 config (the backbone: sizes, norms, RoPE, attention
layout) with the drafter's own fields under `dflash_config` (a field absent there is looked up at
the top level, as `dflash` does):

    target_layer_ids         target layers tapped (default: spread from 1 to L - 3, `build_target_layer_ids`)
    block_size               tokens per drafted block: the anchor plus block_size - 1 drafts (default 16)
    mask_token_id            the id filling the block's draft positions (required)
    input_embedding_scale    scale of the target's token embeddings fed to the drafter (default 1)
    output_multiplier        logit multiplier after the target's LM head (default 1)
    final_logit_softcapping  tanh softcap of those logits (default none)
    conv_kernel_size, conv_group_size   the grouped dynamic causal convolutions (required)
    selector_rank, selector_top_k       the candidate selector (required)
    tap_reduction            revolta's own field, see below (default "hc_read")

Attention layout (spec/engine.md §2.1): `layer_types[i]` is "full_attention" or
"sliding_attention"; a sliding layer's window is `sliding_window`, which, as in a Qwen3 config, only
counts when `use_sliding_window` is true. The block attends to the context and to itself causally
on sliding layers and non-causally on full layers, unless a top-level `is_causal` overrides both.

Tapping a HyperConnection target. The drafter conditions on the target's hidden state at the layer
boundary after each tapped layer id (the residual entering layer id + 1). In Qwen3.8-Flash-Next that
residual is wide: hc_count (4) streams of H features, [T, 4H], while `fc` takes H per tap.
`tap_reduction` names how the 4 streams become H:

    "hc_read"      the HyperConnection read that layer id + 1's attention sublayer applies to that
                   residual (for the last layer, the final mixer's read: the LM head's input), i.e.
                   the learned, per-token collapse the target itself uses at that boundary (default);
    "stream_mean"  the unweighted mean of the 4 streams;
    "stream0"      the first stream alone.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ...config import ConfigError, read_config_json

FULL, SLIDING = "full_attention", "sliding_attention"
TAP_REDUCTIONS = ("hc_read", "stream_mean", "stream0")
DEFAULT_TAP_REDUCTION = "hc_read"


class DraftConfigError(ConfigError):
    """A drafter config.json that cannot describe a DFlash2 drafter; the message names the field."""


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """`dflash`'s default taps: num_draft_layers ids spread evenly over 1 .. L - 3 (L // 2 for one)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass(frozen=True, slots=True)
class DFlash2DraftConfig:
    """Everything that changes the drafter's numerics; field names follow config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int | None  # the effective window (None when use_sliding_window is false)
    is_causal: bool | None  # None: causal exactly on sliding layers
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    attention_bias: bool = False
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    num_target_layers: int | None = None
    tap_reduction: str = DEFAULT_TAP_REDUCTION

    @property
    def num_drafts(self) -> int:
        return self.block_size - 1

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def layer_is_causal(self, i: int) -> bool:
        return self.layer_types[i] == SLIDING if self.is_causal is None else self.is_causal

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_types[i] == SLIDING else None

    # ---- reading ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path) -> "DFlash2DraftConfig":
        """Read `path/config.json` (or the file itself)."""
        raw, source = read_config_json(path, DraftConfigError)
        return cls.from_dict(raw, source=source)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "drafter config") -> "DFlash2DraftConfig":
        """Parse a drafter config.json dict; raise DraftConfigError naming the field and the fix."""
        dflash = raw.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise DraftConfigError(f"{source}: dflash_config must be an object, got {type(dflash).__name__}")

        def top(key: str, default: Any = ...) -> Any:
            if raw.get(key) is None:
                if default is ...:
                    raise DraftConfigError(f"{source}: {key} is missing; a DFlash2 drafter config must set it")
                return default
            return raw[key]

        def draft(key: str, default: Any = ...) -> Any:  # dflash_config first, then the top level
            if dflash.get(key) is not None:
                return dflash[key]
            if raw.get(key) is not None:
                return raw[key]
            if default is ...:
                raise DraftConfigError(f"{source}: {key} is missing; set it in dflash_config (a DFlash2 checkpoint "
                                       "always has it)")
            return default

        num_layers = int(top("num_hidden_layers"))
        heads = int(top("num_attention_heads"))
        sliding = top("sliding_window", None) if raw.get("use_sliding_window", False) else None
        layer_types = raw.get("layer_types")
        if layer_types is None:  # Qwen3's rule: layers from max_window_layers on slide when a window is set
            first = int(raw.get("max_window_layers", 28))
            layer_types = [SLIDING if sliding is not None and i >= first else FULL for i in range(num_layers)]
        num_target = raw.get("num_target_layers")
        taps = draft("target_layer_ids", None)
        if taps is None:
            if num_target is None:
                raise DraftConfigError(f"{source}: neither dflash_config.target_layer_ids nor num_target_layers "
                                       "is set; name the tapped target layers")
            taps = build_target_layer_ids(int(num_target), num_layers)
        softcap = draft("final_logit_softcapping", None)
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise DraftConfigError(f"{source}: rope_type={rope_type!r} is not supported for the drafter; only "
                                   "'default' RoPE is")
        is_causal = raw.get("is_causal")
        cfg = cls(
            vocab_size=int(top("vocab_size")),
            hidden_size=int(top("hidden_size")),
            intermediate_size=int(top("intermediate_size")),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(top("num_key_value_heads", heads)),
            head_dim=int(top("head_dim")),
            layer_types=tuple(layer_types),
            sliding_window=None if sliding is None else int(sliding),
            is_causal=None if is_causal is None else bool(is_causal),
            target_layer_ids=tuple(int(t) for t in taps),
            block_size=int(draft("block_size", 16)),
            mask_token_id=int(draft("mask_token_id")),
            conv_kernel_size=int(draft("conv_kernel_size")),
            conv_group_size=int(draft("conv_group_size")),
            selector_rank=int(draft("selector_rank")),
            selector_top_k=int(draft("selector_top_k")),
            rms_norm_eps=float(top("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10_000.0))),
            attention_bias=bool(raw.get("attention_bias", False)),
            input_embedding_scale=float(draft("input_embedding_scale", 1.0)),
            output_multiplier=float(draft("output_multiplier", 1.0)),
            final_logit_softcapping=None if softcap is None or float(softcap) <= 0 else float(softcap),
            num_target_layers=None if num_target is None else int(num_target),
            tap_reduction=str(draft("tap_reduction", DEFAULT_TAP_REDUCTION)),
        )
        if raw.get("hidden_act", "silu") != "silu":
            raise DraftConfigError(f"{source}: hidden_act={raw['hidden_act']!r}; the drafter MLP is SwiGLU ('silu')")
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "drafter config") -> None:
        """The rules the drafter's shapes need; raise DraftConfigError naming the field and the fix."""

        def fail(msg: str) -> None:
            raise DraftConfigError(f"{source}: {msg}")

        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "conv_kernel_size", "conv_group_size", "selector_rank",
                     "selector_top_k"):
            if getattr(self, name) < 1:
                fail(f"{name}={getattr(self, name)} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            fail(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                 f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            fail(f"head_dim={self.head_dim} must be even for RoPE")
        if len(self.layer_types) != self.num_hidden_layers:
            fail(f"layer_types has {len(self.layer_types)} entries for num_hidden_layers={self.num_hidden_layers}")
        bad = sorted({t for t in self.layer_types if t not in (FULL, SLIDING)})
        if bad:
            fail(f"layer_types holds {bad}; each entry must be {FULL!r} or {SLIDING!r}")
        if SLIDING in self.layer_types and self.sliding_window is None:
            fail("layer_types has sliding_attention layers but no window: set use_sliding_window=true and "
                 "sliding_window")
        if self.sliding_window is not None and self.sliding_window < 1:
            fail(f"sliding_window={self.sliding_window} must be at least 1")
        if self.block_size < 2:
            fail(f"block_size={self.block_size} drafts nothing; it must be at least 2 (anchor + 1 draft)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            fail(f"mask_token_id={self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        if not self.target_layer_ids:
            fail("target_layer_ids is empty; the drafter needs at least one tapped target layer")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids) or min(self.target_layer_ids) < 0:
            fail(f"target_layer_ids={list(self.target_layer_ids)} must be distinct non-negative layer ids")
        if self.num_target_layers is not None:
            self.check_target(self.num_target_layers, self.hidden_size, self.vocab_size, source)
        if self.hidden_size % self.conv_group_size:
            fail(f"conv_group_size={self.conv_group_size} does not divide hidden_size={self.hidden_size}")
        if self.selector_top_k > self.vocab_size:
            fail(f"selector_top_k={self.selector_top_k} exceeds vocab_size={self.vocab_size}")
        if self.tap_reduction not in TAP_REDUCTIONS:
            fail(f"dflash_config.tap_reduction={self.tap_reduction!r}; use one of {list(TAP_REDUCTIONS)}")

    def check_target(self, num_layers: int, hidden_size: int, vocab_size: int, source: str = "drafter config") -> None:
        """Check the drafter fits a target with these sizes (taps inside it, same width and vocabulary)."""
        outside = [t for t in self.target_layer_ids if t >= num_layers]
        if outside:
            raise DraftConfigError(f"{source}: target_layer_ids {outside} do not exist in a target with {num_layers} "
                                   f"layers (valid ids are 0..{num_layers - 1})")
        if hidden_size != self.hidden_size:
            raise DraftConfigError(f"{source}: hidden_size={self.hidden_size} but the target's is {hidden_size}; a "
                                   "DFlash drafter runs at the target's width")
        if vocab_size != self.vocab_size:
            raise DraftConfigError(f"{source}: vocab_size={self.vocab_size} but the target's is {vocab_size}; the "
                                   "drafter shares the target's embeddings and LM head")

    # ---- writing ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A config.json dict in the dflash layout that `from_dict` (and `dflash`) read back to this config."""
        d = asdict(self)
        dflash = {k: d.pop(k) for k in ("target_layer_ids", "block_size", "mask_token_id", "conv_kernel_size",
                                       "conv_group_size", "selector_rank", "selector_top_k",
                                       "input_embedding_scale", "output_multiplier", "final_logit_softcapping",
                                       "tap_reduction")}
        dflash["target_layer_ids"] = list(dflash["target_layer_ids"])
        out = {"architectures": ["DFlash2DraftModel"], "model_type": "qwen3", **d, "hidden_act": "silu",
               "layer_types": list(self.layer_types), "use_sliding_window": self.sliding_window is not None,
               "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta}, "dflash_config": dflash}
        out.pop("rope_theta")
        for key in ("is_causal", "num_target_layers"):
            if out[key] is None:
                out.pop(key)
        return out

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / "config.json"
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

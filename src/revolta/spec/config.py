"""`speculative_config` (vLLM's dict form) resolved against the checkpoint.

    None                         -> MTP4 when the checkpoint has an MTP layer, else off
    {"method": None}             -> off
    {"method": "mtp", "num_speculative_tokens": 4, "spec_state_replay": False,
     "kv_cache_dtype": None, "draft_sample_method": "greedy"}

`spec_state_replay` keeps the release note's name: True recomputes the accepted tokens' GDN state
from the committed one after verification instead of keeping one state slot per draft
(spec/engine.md §3.3); both give bitwise identical states. `kv_cache_dtype` is the MTP layer's
draft KV format (None inherits the target's).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_NUM_SPECULATIVE_TOKENS = 4  # MTP4, the reference deployment's default (spec/engine.md §2.8)
METHODS = ("mtp",)
DRAFT_SAMPLE_METHODS = ("greedy",)
_KEYS = ("method", "num_speculative_tokens", "spec_state_replay", "kv_cache_dtype", "draft_sample_method")


@dataclass(frozen=True)
class SpeculativeConfig:
    """A resolved speculative configuration; `method=None` means off."""

    method: str | None = None
    num_speculative_tokens: int = 0
    spec_state_replay: bool = False
    kv_cache_dtype: str | None = None  # draft (MTP layer) KV format; None: the target's
    draft_sample_method: str = "greedy"  # the drafter takes the argmax; q is one-hot in rejection sampling

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @classmethod
    def resolve(cls, raw: Mapping[str, Any] | "SpeculativeConfig" | None, has_mtp: bool) -> "SpeculativeConfig":
        """The configuration for a checkpoint with (`has_mtp`) or without an MTP layer.

        raw: None (the default: MTP4 when the checkpoint has MTP weights), a dict with vLLM's
        keys, or an already resolved SpeculativeConfig. Raises ValueError naming the bad key.
        """
        if isinstance(raw, SpeculativeConfig):
            raw = {k: getattr(raw, k) for k in _KEYS}
        if raw is None:
            raw = {"method": "mtp"} if has_mtp else {"method": None}
        if not isinstance(raw, Mapping):
            raise ValueError(f"speculative_config={raw!r} must be a dict like "
                             "{'method': 'mtp', 'num_speculative_tokens': 4}, {'method': None} or None")
        unknown = sorted(set(raw) - set(_KEYS))
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; accepted: {list(_KEYS)}")
        method = raw.get("method", "mtp")
        if method is None:
            return cls()
        if method not in METHODS:
            raise ValueError(f"speculative_config method={method!r} is not supported; use 'mtp' (the checkpoint's "
                             "MTP head) or None to turn speculation off")
        if not has_mtp:
            raise ValueError("speculative_config method='mtp' needs the checkpoint's MTP layer, and this checkpoint "
                             "has none (mtp_num_hidden_layers = 0); pass speculative_config={'method': None}")
        k = raw.get("num_speculative_tokens", DEFAULT_NUM_SPECULATIVE_TOKENS)
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 8:
            raise ValueError(f"speculative_config num_speculative_tokens={k!r} must be an integer in [1, 8]")
        replay = raw.get("spec_state_replay", False)
        if not isinstance(replay, bool):
            raise ValueError(f"speculative_config spec_state_replay={replay!r} must be true or false")
        sample = raw.get("draft_sample_method", "greedy")
        if sample not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"speculative_config draft_sample_method={sample!r} is not supported; use 'greedy' "
                             "(probabilistic drafting is not validated for this model, spec/engine.md §2.4)")
        kv = raw.get("kv_cache_dtype")
        if kv is not None and not isinstance(kv, str):
            raise ValueError(f"speculative_config kv_cache_dtype={kv!r} must be a KV format name or None")
        return cls(method=method, num_speculative_tokens=k, spec_state_replay=replay, kv_cache_dtype=kv,
                   draft_sample_method=sample)

    def describe(self) -> str:
        if not self.enabled:
            return "off"
        state = "replay" if self.spec_state_replay else "per-draft state slots"
        return f"MTP x{self.num_speculative_tokens} ({state}, {self.draft_sample_method} drafts)"

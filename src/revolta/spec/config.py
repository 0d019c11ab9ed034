"""`speculative_config` (vLLM's dict form) resolved against the checkpoint.

    None                         -> MTP4 when the checkpoint has an MTP layer, else off
    {"method": None}             -> off
    {"method": "mtp", "num_speculative_tokens": 4, "spec_state_replay": False,
     "kv_cache_dtype": None, "draft_sample_method": "greedy", "draft_policy": "adaptive"}

    {"method": "dflash2", "model": DRAFTER_DIR, "num_speculative_tokens": 7,
     "draft_sample_method": "greedy", "dflash_concurrency_drafts": {"4": 3, "5": 4},
     "sm70_dflash2": {...}, "kv_cache_dtype": None}

`spec_state_replay` keeps the release note's name: True recomputes the accepted tokens' GDN state
from the committed one after verification instead of keeping one state slot per draft
(spec/engine.md §3.3); both give bitwise identical states. `kv_cache_dtype` is the draft KV format
(the MTP layer's, or the DFlash2 drafter's; None inherits the target's). `draft_policy` (both
methods): "adaptive" (default; env REVOLTA_SPEC_DRAFT_POLICY overrides the default) drafts only while
the measured rounds pay and decodes plainly otherwise (engine/spec_policy.py); "always" drafts every
decode step (benchmarks and tests of the rounds themselves).

DFlash2 (spec/engine.md §2.2, §2.5-2.7; "dflash" is the release note's name for the same method
with a DFlash2 drafter): `model` is the drafter checkpoint (its config.json is read here, its
weights later); `num_speculative_tokens` defaults to the drafter's block_size - 1 (7 for the
released drafters); `sm70_dflash2` is resolved by spec/dflash2/options.py, and its
`spec_state_replay`, `sharded_selector_codebook` and `fused_gdn_verify` may also be given at the
top level (a conflicting value in both places is an error). The configuration checks that need
the target and the engine arguments are in spec/dflash2/checks.py.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..cache.capacity import DraftKVGroup, resolve_kv_dtype
from .dflash2.drafter_facts import DrafterFacts
from .dflash2.ladder import Ladder, drafts_at, parse_ladder
from .dflash2.options import SM70DFlash2Options

DEFAULT_NUM_SPECULATIVE_TOKENS = 4  # MTP4, the reference deployment's default (spec/engine.md §2.8)
METHODS = ("mtp", "dflash2", "dflash")  # "dflash": the release note's name, with a DFlash2 drafter
DFLASH2_METHODS = ("dflash2", "dflash")
QUANTIZED_KV = ("fp8_e4m3", "int8")  # 1-byte KV formats; revolta's DFlash2 drafter cache stays 16-bit
DRAFT_SAMPLE_METHODS = ("greedy",)
DFLASH2_DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")  # probabilistic: allowed with a warning (checks.py)
DRAFT_POLICIES = ("adaptive", "always")
_KEYS = ("method", "num_speculative_tokens", "spec_state_replay", "kv_cache_dtype", "draft_sample_method",
         "draft_policy")
# sm70_dflash2 options that may also be given at the top level of speculative_config
_TOP_LEVEL_OPTIONS = ("spec_state_replay", "sharded_selector_codebook", "fused_gdn_verify")
_DFLASH2_KEYS = ("method", "model", "num_speculative_tokens", "draft_sample_method", "dflash_concurrency_drafts",
                 "sm70_dflash2", "kv_cache_dtype", "sample_from_anchor", "draft_policy", *_TOP_LEVEL_OPTIONS)


@dataclass(frozen=True)
class SpeculativeConfig:
    """A resolved speculative configuration; `method=None` means off."""

    method: str | None = None
    num_speculative_tokens: int = 0
    spec_state_replay: bool = False
    kv_cache_dtype: str | None = None  # draft (MTP layer) KV format; None: the target's
    draft_sample_method: str = "greedy"  # the drafter takes the argmax; q is one-hot in rejection sampling
    draft_policy: str = "adaptive"  # "adaptive": draft while it pays (engine/spec_policy.py); "always"
    # DFlash2 only
    model: str | None = None  # the drafter checkpoint directory
    drafter: DrafterFacts | None = None  # what the checks and the cache plan read from its config.json
    dflash_concurrency_drafts: Ladder = ()  # ((min running requests, drafts verified), ...), spec/dflash2/ladder.py
    sm70_dflash2: SM70DFlash2Options | None = None

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @property
    def is_dflash2(self) -> bool:
        return self.method == "dflash2"

    def cache_fields(self, kv_cache_dtype: str, dtype: str) -> dict[str, Any]:
        """The `cache.capacity.CacheConfig` fields of this configuration (target KV `kv_cache_dtype`,
        activation `dtype`): drafts, replay, the draft KV format and DFlash2's drafter KV group."""
        out: dict[str, Any] = {"num_speculative_tokens": self.num_speculative_tokens,
                               "spec_state_replay": self.spec_state_replay, "draft_kv_cache_dtype": self.kv_cache_dtype}
        if self.is_dflash2:
            d = self.drafter
            out["speculative_method"] = "dflash2"
            out["draft_kv_group"] = DraftKVGroup(
                num_layers=d.num_layers, num_sliding_layers=d.num_sliding_layers, sliding_window=d.sliding_window,
                num_kv_heads=d.num_kv_heads, head_dim=d.head_dim,
                kv_cache_dtype=_drafter_kv_dtype(resolve_kv_dtype(self.kv_cache_dtype or kv_cache_dtype, dtype), dtype),
                intermediate_size=d.intermediate_size)
        return out

    def drafts_at(self, num_running: int) -> int:
        """Drafts each request verifies at `num_running` running requests (the ladder; all of them for MTP)."""
        return drafts_at(self.dflash_concurrency_drafts, self.num_speculative_tokens, num_running)

    @classmethod
    def resolve(cls, raw: Mapping[str, Any] | "SpeculativeConfig" | None, has_mtp: bool, *,
                tensor_parallel_size: int = 1, env: Mapping[str, str] | None = None) -> "SpeculativeConfig":
        """The configuration for a checkpoint with (`has_mtp`) or without an MTP layer.

        raw: None (the default: MTP4 when the checkpoint has MTP weights), a dict with vLLM's
        keys, or an already resolved SpeculativeConfig. Raises ValueError naming the bad key.
        tensor_parallel_size and env (default os.environ) resolve DFlash2's sm70_dflash2 options.
        """
        if isinstance(raw, SpeculativeConfig) and raw.is_dflash2:
            return raw
        if isinstance(raw, Mapping) and raw.get("method") in DFLASH2_METHODS:
            return cls._resolve_dflash2(raw, tensor_parallel_size, env)
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
                             "MTP head), 'dflash2' (with a drafter 'model') or None to turn speculation off")
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
                   draft_sample_method=sample, draft_policy=_draft_policy(raw, env))

    @classmethod
    def _resolve_dflash2(cls, raw: Mapping[str, Any], tp: int, env: Mapping[str, str] | None) -> "SpeculativeConfig":
        unknown = sorted(set(raw) - set(_DFLASH2_KEYS))
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown} for method {raw['method']!r}; accepted: "
                             f"{list(_DFLASH2_KEYS)}")
        if raw.get("model") is None:
            raise ValueError("speculative_config method='dflash2' needs 'model': the DFlash2 drafter checkpoint "
                             "directory (config.json + *.safetensors)")
        facts = DrafterFacts.from_dir(raw["model"])  # refuses a drafter the DFlash2 model would
        block = facts.block_size - 1  # drafts one block proposes (anchor + drafts = block_size)
        k = raw.get("num_speculative_tokens")
        k = block if k is None else k
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= block:
            raise ValueError(f"speculative_config num_speculative_tokens={k!r} must be an integer in [1, {block}]: the "
                             f"drafter proposes block_size - 1 = {block} drafts per round (leave it unset for {block})")
        sample = raw.get("draft_sample_method", "greedy")
        if sample not in DFLASH2_DRAFT_SAMPLE_METHODS:
            raise ValueError(f"speculative_config draft_sample_method={sample!r} is not supported; use 'greedy' "
                             "(recommended) or 'probabilistic'")
        if raw.get("sample_from_anchor"):
            raise ValueError("speculative_config sample_from_anchor=true is not supported for DFlash2: its block has "
                             "the fixed [anchor, mask x drafts] layout (spec/engine.md §8 item 23); remove it")
        kv = raw.get("kv_cache_dtype")
        if kv is not None and not isinstance(kv, str):
            raise ValueError(f"speculative_config kv_cache_dtype={kv!r} must be a KV format name or None")
        options = raw.get("sm70_dflash2") or {}
        if not isinstance(options, Mapping):
            raise ValueError(f"speculative_config sm70_dflash2={options!r} must be a dict of options")
        options = dict(options)
        for name in _TOP_LEVEL_OPTIONS:
            if name in raw:
                if name in options and options[name] != raw[name]:
                    raise ValueError(f"speculative_config sets {name}={raw[name]!r} and sm70_dflash2 {name}="
                                     f"{options[name]!r}; give it once (inside sm70_dflash2)")
                options[name] = raw[name]
        opts = SM70DFlash2Options.resolve(options, tensor_parallel_size=tp, env=env)
        return cls(method="dflash2", num_speculative_tokens=k, spec_state_replay=bool(opts.spec_state_replay),
                   kv_cache_dtype=kv, draft_sample_method=sample, draft_policy=_draft_policy(raw, env),
                   model=facts.path, drafter=facts,
                   dflash_concurrency_drafts=parse_ladder(raw.get("dflash_concurrency_drafts"), k), sm70_dflash2=opts)

    def describe(self) -> str:
        if not self.enabled:
            return "off"
        state = "replay" if self.spec_state_replay else "per-draft state slots"
        if self.is_dflash2:
            ladder = ", ".join(f"{c}+: {n}" for c, n in self.dflash_concurrency_drafts)
            return (f"DFlash2 x{self.num_speculative_tokens} from {self.model} ({state}, {self.draft_sample_method} "
                    f"drafts{', ladder ' + ladder if ladder else ''})")
        return (f"MTP x{self.num_speculative_tokens} ({state}, {self.draft_sample_method} drafts, "
                f"{self.draft_policy} drafting)")


def speculative_method(raw: Mapping[str, Any] | SpeculativeConfig | None) -> str | None:
    """"mtp", "dflash2" or None, read from a speculative_config without resolving it (None: MTP or off)."""
    if isinstance(raw, SpeculativeConfig):
        return raw.method
    method = raw.get("method", "mtp") if isinstance(raw, Mapping) else None
    return "dflash2" if method == "dflash" else method


def _draft_policy(raw: Mapping[str, Any], env: Mapping[str, str] | None) -> str:
    """raw["draft_policy"], else env REVOLTA_SPEC_DRAFT_POLICY, else "adaptive"."""
    env = os.environ if env is None else env
    policy = raw.get("draft_policy") or env.get("REVOLTA_SPEC_DRAFT_POLICY") or "adaptive"
    if policy not in DRAFT_POLICIES:
        source = "speculative_config draft_policy" if raw.get("draft_policy") else "REVOLTA_SPEC_DRAFT_POLICY"
        raise ValueError(f"{source}={policy!r} is not supported; use 'adaptive' (draft while it pays) or 'always' "
                         "(draft every decode step)")
    return policy


def _drafter_kv_dtype(resolved: str, dtype: str) -> str:
    """The DFlash2 drafter cache is 16-bit in revolta: a quantised format inherited from the target
    means the activation dtype (an explicit one is refused by spec/dflash2/checks.py)."""
    return resolve_kv_dtype("auto", dtype) if resolved in QUANTIZED_KV else resolved

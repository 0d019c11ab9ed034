"""The `sm70_dflash2` option object inside `speculative_config` (spec/engine.md §2.6).

Every option of the release note's object is accepted by name. Each is a tri-state: unset (None)
takes the default, an explicit value (the typed field, else the legacy environment alias
`VLLM_SM70_DFLASH2_<NAME>`, in that order, spec §2.6) must be one revolta runs. What each option
means here:

controls a revolta behaviour (both values run)
  sharded_selector_codebook  vocabulary rows of both selector codebooks split over the tensor-parallel
                             group, lookups summed by one all-reduce (spec/dflash2/sharded_codebook.py);
                             default on when tensor_parallel_size > 1 (at 1 there is nothing to split)
  spec_state_replay          after verification, recompute the accepted tokens' GDN state from the
                             committed one (spec/commit.py, replay) instead of keeping a state slot per
                             draft; default on (revolta's verifier records its inputs in every
                             configuration), yields to an automatic fused_gdn_verify, explicit both is an
                             error (release note, spec §3.3); the release note recommends false

describes what revolta always does (that value is accepted, the other is refused)
  verify_fastpath            true: one VerifyMeta/PagedMeta per step serves every GDN layer (forward.py)
  fused_gdn_metadata         true: one state-slot id per request indexes every GDN layer's state at once
                             (cache/storage.py), there are no per-group slot tables to build
  fused_smallq_metadata      true: the verifier's attention metadata (block table, slot mapping) is built
  grouped_smallq_metadata    once per step for all QSA layers (runner.py)
  fp32_logits                true: LM-head logits are fp32 everywhere (runner.py)
  fused_gdn_verify           false: GDN verifies with the token-by-token decode kernel; revolta has no
                             packed verifier, so its automatic policy is off

has no effect in revolta (false, which says what revolta does, is accepted; true is refused, saying why)
  fused_gdn_norm, fused_gdn_split, fused_gdn_combined_split, fused_gemma_rms, fixed_gemma_rms
                                       SM70 kernel variants revolta does not have (its kernels are its own)
  quant_lm_head, qpn8_rerank           the LM head is never quantised here; candidates come from exact logits
  sparse_target_rejection              verification uses the dense lossless sampler (spec/verify.py)
  sharded_context_fc                   the drafter's context `fc` is not tensor-parallel
  bf16_emulation, proposal_temperature_scale, proposal_top_p   not implemented
  lookup                               n-gram lookup drafting is not implemented (any value is refused)

has no effect in revolta, either value accepted with a warning: speed-only options of the release note's
recommended configuration (which tells users to set the first two), so that configuration starts as written
  context_kv_graph, context_pipeline   revolta's DFlash2 graphs are whole rounds (dflash2_graph_rounds)
  draft_window_split                   an SM70 attention-window kernel variant (revolta's kernels are its own)

`release_default` is the release note's value (True for the six options of the recommended
configuration and for the two 0.1.3 memory options; None where it states none). Where revolta
runs differently, the resolved value says what runs, and `describe()` shows both.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

logger = logging.getLogger(__name__)

ENV_PREFIX = "VLLM_SM70_DFLASH2_"
# revolta's DFlash2 graphs are whole rounds (engine dflash2_graph_rounds / dflash2_draft_graph), not 1Cat's pieces
_EAGER = ("revolta's DFlash2 CUDA graphs capture whole verify/commit rounds (--dflash2-graph-rounds) and the drafter "
          "forward (--dflash2-draft-graph), not 1Cat's separate pieces")
_KERNEL = "it selects an SM70 kernel variant of 1Cat-vLLM that revolta does not have (revolta's kernels are its own)"


@dataclass(frozen=True)
class OptionSpec:
    name: str
    release_default: bool | None  # the release note's default; None: it states none
    meaning: str  # what the option does in revolta, or why it has no effect
    honoured: tuple[bool, ...]  # values revolta runs; () = no effect (see `ignored`)
    ignored: tuple[bool, ...] = (False,)  # no-effect options: explicit values accepted (and logged), others refused


OPTIONS: tuple[OptionSpec, ...] = (
    OptionSpec("context_kv_graph", True, f"{_EAGER}, so there is no context-KV graph to capture", (), (True, False)),
    OptionSpec("context_pipeline", True, f"{_EAGER}, so there is no context-KV graph to split", (), (True, False)),
    OptionSpec("verify_fastpath", True, "one VerifyMeta/PagedMeta per step serves every GDN layer", (True,)),
    OptionSpec("fused_gdn_metadata", True, "one state-slot id per request indexes every GDN layer's state",
               (True,)),
    OptionSpec("fused_smallq_metadata", True, "the verifier's attention metadata is built once per step", (True,)),
    OptionSpec("grouped_smallq_metadata", True, "one attention metadata serves every QSA layer", (True,)),
    OptionSpec("sharded_selector_codebook", True, "selector codebook rows split over the tensor-parallel group",
               (True, False)),
    OptionSpec("spec_state_replay", True, "accepted GDN states recomputed from the committed one (replay)",
               (True, False)),
    OptionSpec("fused_gdn_verify", None, "revolta has no packed GDN verifier; GDN verifies with the "
               "token-by-token decode kernel", (False,)),
    OptionSpec("fused_gdn_norm", None, _KERNEL, ()),
    OptionSpec("fused_gdn_split", None, _KERNEL, ()),
    OptionSpec("fused_gdn_combined_split", None, _KERNEL, ()),
    OptionSpec("fp32_logits", None, "LM-head logits are always fp32", (True,)),
    OptionSpec("quant_lm_head", None, "revolta's LM head is never quantised", ()),
    OptionSpec("qpn8_rerank", None, "candidates are the exact top-K of the fp32 logits, with no coarse pass", ()),
    OptionSpec("sparse_target_rejection", None, "verification uses the dense lossless rejection sampler "
               "(spec/verify.py)", ()),
    OptionSpec("sharded_context_fc", None, "the drafter's context fc is not tensor-parallel", ()),
    OptionSpec("fused_gemma_rms", None, _KERNEL, ()),
    OptionSpec("fixed_gemma_rms", None, _KERNEL, ()),
    OptionSpec("bf16_emulation", None, "the drafter runs in the target's dtype; BF16 emulation is not implemented",
               ()),
    OptionSpec("proposal_temperature_scale", None, "the drafter's proposal temperature is not adjustable", ()),
    OptionSpec("proposal_top_p", None, "the drafter's proposal has no nucleus cut", ()),
    OptionSpec("draft_window_split", True, _KERNEL, (), (True, False)),
    OptionSpec("lookup", None, "n-gram lookup drafting is not implemented", (), ()),
)
_BY_NAME = {o.name: o for o in OPTIONS}


def _parse_env(var: str, text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{var}={text!r} must be 1 or 0 (true/false); unset it to take the default")


def resolve_replay(replay: bool | None, fused: bool | None, *, fused_auto: bool,
                   supported: bool = True) -> tuple[bool, bool]:
    """(spec_state_replay, fused_gdn_verify) from the explicit values (None = unset).

    The release note's rule (spec §3.3, §8 items 7-8): both explicitly true is an error; replay
    unset is on where supported unless the packed verifier is on (explicitly or by its automatic
    policy `fused_auto`); an explicit replay true overrides an automatic fused_gdn_verify.
    """
    if replay is True and fused is True:
        raise ValueError("sm70_dflash2 sets both spec_state_replay and fused_gdn_verify to true; they cannot run "
                         "together (the packed verifier keeps no replayable record): set one of them to false")
    if replay is True and not supported:
        raise ValueError("sm70_dflash2 spec_state_replay=true is not supported by this configuration; remove it to "
                         "keep per-draft state slots")
    fused_on = fused if fused is not None else (fused_auto and replay is not True)
    replay_on = replay if replay is not None else (supported and not fused_on)
    return replay_on, fused_on


@dataclass(frozen=True)
class SM70DFlash2Options:
    """Resolved `sm70_dflash2`: True/False for options revolta runs, None for those with no effect.

    Build with `resolve`; `sources` holds (name, where the value came from) for every option.
    """

    context_kv_graph: bool | None = None
    context_pipeline: bool | None = None
    verify_fastpath: bool | None = True
    fused_gdn_metadata: bool | None = True
    fused_smallq_metadata: bool | None = True
    grouped_smallq_metadata: bool | None = True
    sharded_selector_codebook: bool | None = False
    spec_state_replay: bool | None = True
    fused_gdn_verify: bool | None = False
    fused_gdn_norm: bool | None = None
    fused_gdn_split: bool | None = None
    fused_gdn_combined_split: bool | None = None
    fp32_logits: bool | None = True
    quant_lm_head: bool | None = None
    qpn8_rerank: bool | None = None
    sparse_target_rejection: bool | None = None
    sharded_context_fc: bool | None = None
    fused_gemma_rms: bool | None = None
    fixed_gemma_rms: bool | None = None
    bf16_emulation: bool | None = None
    proposal_temperature_scale: bool | None = None
    proposal_top_p: bool | None = None
    draft_window_split: bool | None = None
    lookup: bool | None = None
    sources: tuple[tuple[str, str], ...] = ()

    @classmethod
    def resolve(cls, raw: Mapping[str, Any] | None, *, tensor_parallel_size: int = 1,
                env: Mapping[str, str] | None = None, fused_gdn_verify_auto: bool = False) -> "SM70DFlash2Options":
        """Resolve `raw` (the user's dict, or None) against the environment and revolta's defaults.

        env: the environment (default os.environ), read for `VLLM_SM70_DFLASH2_<NAME>`.
        fused_gdn_verify_auto: the packed verifier's automatic policy (always False in revolta,
        which has no packed verifier; a parameter so the release note's interplay is testable).
        Raises ValueError for unknown names, non-boolean values, explicit values revolta cannot
        run (with the reason) and explicit replay + fused_gdn_verify.
        """
        raw = {} if raw is None else raw
        if not isinstance(raw, Mapping):
            raise ValueError(f"speculative_config sm70_dflash2={raw!r} must be a dict of options")
        unknown = sorted(set(raw) - set(_BY_NAME))
        if unknown:
            raise ValueError(f"sm70_dflash2 has unknown options {unknown}; accepted: {sorted(_BY_NAME)}")
        env = os.environ if env is None else env
        explicit: dict[str, tuple[Any, str]] = {}
        for o in OPTIONS:
            var = ENV_PREFIX + o.name.upper()
            if o.name in raw and raw[o.name] is not None:
                value = raw[o.name]
                if o.honoured and not isinstance(value, bool):
                    raise ValueError(f"sm70_dflash2 {o.name}={value!r} must be true or false")
                explicit[o.name] = (value, "config")
            elif o.name != "lookup" and var in env:
                explicit[o.name] = (_parse_env(var, env[var]), f"environment ({var})")
                logger.warning("%s is a legacy alias; set sm70_dflash2 {'%s': ...} in speculative_config instead",
                               var, o.name)
        get = {name: value for name, (value, _) in explicit.items()}
        replay, fused = resolve_replay(get.get("spec_state_replay"), get.get("fused_gdn_verify"),
                                       fused_auto=fused_gdn_verify_auto)
        refused = []  # every option revolta cannot run, in one message
        for name, (value, source) in list(explicit.items()):
            o = _BY_NAME[name]
            if not o.honoured and isinstance(value, bool) and value in o.ignored:
                (logger.warning if value else logger.info)(
                    "sm70_dflash2 %s=%s (%s) has no effect in revolta (%s); ignored", name, value, source, o.meaning)
                explicit[name] = (value, f"{source}, ignored: no effect in revolta")
            elif not o.honoured:
                refused.append(f"{name}={value!r} ({source}) has no effect in revolta: {o.meaning}")
            elif name != "fused_gdn_verify" and value not in o.honoured:
                refused.append(f"{name}={value!r} ({source}) cannot run in revolta, which always runs "
                               f"{name}={o.honoured[0]} ({o.meaning})")
        if refused:
            raise ValueError("sm70_dflash2 " + "; ".join(refused) + f"; remove {'it' if len(refused) == 1 else 'them'}")
        if fused:  # explicit or automatic: revolta has no packed verifier
            raise ValueError(f"sm70_dflash2 fused_gdn_verify=true cannot run in revolta: {_BY_NAME['fused_gdn_verify'].meaning}; "
                             "remove it")
        shard = get.get("sharded_selector_codebook")
        if shard and tensor_parallel_size < 2:
            raise ValueError(f"sm70_dflash2 sharded_selector_codebook=true needs a tensor-parallel group of 2 or more "
                             f"ranks (tensor_parallel_size={tensor_parallel_size} keeps one full copy); remove it")
        values: dict[str, Any] = {"spec_state_replay": replay, "fused_gdn_verify": fused,
                                  "sharded_selector_codebook": tensor_parallel_size > 1 if shard is None else shard}
        sources = []
        for o in OPTIONS:
            if o.name not in values:
                values[o.name] = o.honoured[0] if o.honoured else None
            if o.name in explicit:
                sources.append((o.name, explicit[o.name][1]))
            else:
                sources.append((o.name, "default" if o.honoured else "no effect in revolta"))
        return cls(**values, sources=tuple(sources))

    def source(self, name: str) -> str:
        return dict(self.sources)[name]

    def describe(self) -> list[str]:
        """One line per option: resolved value, its source, and the release note's default."""
        lines = []
        for o in OPTIONS:
            value = getattr(self, o.name)
            shown = "n/a" if value is None else str(value).lower()
            note = "" if o.release_default is None else f", release note {str(o.release_default).lower()}"
            lines.append(f"{o.name}={shown} [{self.source(o.name) if self.sources else 'default'}{note}]: {o.meaning}")
        return lines


OPTION_NAMES = tuple(f.name for f in fields(SM70DFlash2Options) if f.name != "sources")

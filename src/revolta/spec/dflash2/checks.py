"""DFlash2 configuration checks that run before any weight loads (spec/engine.md §8, items 11-23).

`check_dflash2` raises ValueError naming the problem and what to change, and returns the warnings
to log. The items and how they apply to revolta:

 11 INT8 draft KV with sliding-window or sink draft layers: rejected (`check_draft_kv`), naming the
    configurations that work.
 12 INT8 target + a separate 16-bit draft cache (speculative_config kv_cache_dtype float16/auto):
    passes; the drafter cache is its own tensors, so the target's INT8 page rules do not apply.
 13 draft KV dtype: None inherits the target's, as the release note says for the released drafter. revolta's
    drafter cache is 16-bit only: an inherited fp8/int8 format gives a 16-bit drafter cache and a warning
    (the capacity report counts 16 bits), an explicit one is refused.
 16 n-gram assist / lookup: not implemented; `sm70_dflash2.lookup` is refused (options.py) and the
    vLLM keys are unknown keys of speculative_config (spec/config.py).
 17 draft_sample_method greedy (recommended) or probabilistic (a warning: not validated for this
    model, release note); anything else is refused (spec/config.py).
 18 num_speculative_tokens defaults to the drafter's block_size - 1 and may not exceed it (spec/config.py).
 22 pipeline parallelism: rejected (`check_pipeline_parallel`).
 23 sample_from_anchor=true: rejected (spec/config.py).
 also: the drafter must match the target (hidden size for the shared LM head, vocabulary for the
    codebooks, the tapped target layers), and verifier tail graphs (VLLM_SM70_DFLASH2_TAIL_CUDAGRAPHS=1) are refused because
    revolta captures no verify graphs (spec §4.7: off is the DFlash2 default anyway).
 Not applicable: 14-15 (MTP only; engine.check_draft_kv_dtype), 19 (revolta's LM head is never
 quantised), 20 (no SM70 BF16 transport: the drafter runs in the target's dtype), 21 (revolta has
 no piecewise graphs).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ...cache.capacity import resolve_kv_dtype
from ...config import ModelConfig
from ..config import QUANTIZED_KV, SpeculativeConfig
from .drafter_facts import DrafterFacts

TAIL_CUDAGRAPHS_ENV = "VLLM_SM70_DFLASH2_TAIL_CUDAGRAPHS"


def check_draft_kv(facts: DrafterFacts, draft_kv: str, kv_cache_dtype: str, explicit: bool) -> None:
    """Item 11: an INT8 drafter cache cannot serve sliding-window or sink layers (release note #22)."""
    if draft_kv != "int8":
        return
    what = []
    if facts.num_sliding_layers:
        n = facts.num_sliding_layers
        what.append(f"{n} sliding-window layer{'s' if n > 1 else ''} (window {facts.sliding_window})")
    if facts.has_attention_sinks:
        what.append("attention sinks")
    if not what:
        return
    origin = "speculative_config kv_cache_dtype" if explicit else f"inherited from kv_cache_dtype={kv_cache_dtype!r}"
    raise ValueError(
        f"the DFlash2 drafter {facts.path} has {' and '.join(what)}, and its KV cache would be int8 ({origin}); "
        "int8 draft KV does not support sliding windows or sinks. Use a 16-bit draft cache beside the int8 target "
        "cache (speculative_config {'kv_cache_dtype': 'auto'} or 'float16'), or kv_cache_dtype 'fp8_e4m3' / 'fp16' "
        "for both, or method 'mtp' with int8 KV")


def check_pipeline_parallel(pipeline_parallel_size: int) -> None:
    """Item 22."""
    if pipeline_parallel_size != 1:
        raise ValueError(f"pipeline_parallel_size={pipeline_parallel_size}: DFlash2 does not support pipeline "
                         "parallelism (the drafter reads hidden states tapped across the whole target); use "
                         "pipeline_parallel_size=1, or method 'mtp'")


def check_matches_target(facts: DrafterFacts, cfg: ModelConfig) -> None:
    """The drafter's logits go through the target's LM head and its codebooks index the target's vocabulary."""
    t = cfg.text
    if facts.hidden_size != t.hidden_size:
        raise ValueError(f"the DFlash2 drafter {facts.path} has hidden_size={facts.hidden_size} but the target has "
                         f"{t.hidden_size}; its logits go through the target's LM head, so pass a drafter trained "
                         "for this target")
    if facts.vocab_size != t.vocab_size:
        raise ValueError(f"the DFlash2 drafter {facts.path} has vocab_size={facts.vocab_size} but the target has "
                         f"{t.vocab_size}; pass a drafter trained for this target")
    if facts.num_target_layers is not None and facts.num_target_layers != t.num_hidden_layers:
        raise ValueError(f"the DFlash2 drafter {facts.path} was built for a target of num_target_layers="
                         f"{facts.num_target_layers} layers but this target has {t.num_hidden_layers}; pass a drafter "
                         "trained for this target")
    bad = [i for i in facts.target_layer_ids if not 0 <= i < t.num_hidden_layers]
    if bad:
        raise ValueError(f"the DFlash2 drafter {facts.path} taps target layers {bad}, outside this target's "
                         f"0..{t.num_hidden_layers - 1}; pass a drafter trained for this target")


def check_tail_cudagraphs(env: Mapping[str, str]) -> None:
    """Tail graphs are off for DFlash2 (spec §4.7); revolta has none to turn on."""
    value = env.get(TAIL_CUDAGRAPHS_ENV)
    if value is not None and value.strip().lower() not in ("0", "false", "no", "off", ""):
        raise ValueError(f"{TAIL_CUDAGRAPHS_ENV}={value!r}: revolta captures no single-request verifier tail graphs "
                         "(its DFlash2 graphs capture whole rounds: --dflash2-graph-rounds); unset it or set 0")


def check_dflash2(spec: SpeculativeConfig, cfg: ModelConfig, *, kv_cache_dtype: str, dtype: str,
                  pipeline_parallel_size: int = 1, env: Mapping[str, str] | None = None) -> list[str]:
    """Every check above for a resolved DFlash2 `spec` on target `cfg`; returns the warnings to log.

    kv_cache_dtype: the target's (engine argument); dtype: the activation dtype ("float16", ...).
    """
    assert spec.is_dflash2 and spec.drafter is not None, "check_dflash2 takes a resolved DFlash2 config"
    env = os.environ if env is None else env
    check_pipeline_parallel(pipeline_parallel_size)
    check_matches_target(spec.drafter, cfg)
    draft_kv = resolve_kv_dtype(spec.kv_cache_dtype or kv_cache_dtype, dtype)  # item 13: None inherits
    check_draft_kv(spec.drafter, draft_kv, kv_cache_dtype, explicit=spec.kv_cache_dtype is not None)
    check_tail_cudagraphs(env)
    warnings = []
    if draft_kv in QUANTIZED_KV:
        # revolta's drafter context cache (spec/dflash2/context_store.py) stores K/V at the activation dtype
        if spec.kv_cache_dtype is not None:
            raise ValueError(f"speculative_config kv_cache_dtype={spec.kv_cache_dtype!r}: revolta keeps the DFlash2 "
                             f"drafter's context K/V at the activation dtype ({dtype}); a {draft_kv} drafter cache is "
                             "not implemented. Use 'auto' (the default) for a 16-bit drafter cache beside the target's")
        warnings.append(f"the DFlash2 drafter's context K/V is kept at {dtype} beside the {draft_kv} target cache "
                        "(revolta has no quantised drafter cache); the capacity report counts it at 16 bits")
    if spec.draft_sample_method == "probabilistic":
        warnings.append("DFlash2 draft_sample_method='probabilistic' is not validated for this model (release note); "
                        "verification stays lossless, 'greedy' is the recommended setting")
    return warnings

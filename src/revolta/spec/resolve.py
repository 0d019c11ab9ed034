"""The one place a `speculative_config` is parsed and checked against the target.

`resolve_speculative` turns vLLM's dict (or None, or an already resolved SpeculativeConfig) into a
SpeculativeConfig (spec/config.py) and runs the DFlash2 checks that need the target and the engine
arguments (spec/dflash2/checks.py); it reads the drafter's config.json, never its weights, so `LLM`
and the CLI's dry run call it before anything loads. `Engine` calls it only for a config that is not
resolved yet (an Engine built directly from a dict).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config import ModelConfig
from .config import SpeculativeConfig
from .dflash2.checks import check_dflash2


def resolve_speculative(raw: Mapping[str, Any] | SpeculativeConfig | None, cfg: ModelConfig, *, has_mtp: bool,
                        dtype: str, kv_cache_dtype: str, tensor_parallel_size: int = 1,
                        pipeline_parallel_size: int = 1,
                        env: Mapping[str, str] | None = None) -> tuple[SpeculativeConfig, list[str]]:
    """(the resolved configuration, the warnings to show); raises ValueError naming a bad setting.

    has_mtp: the target's MTP head is (or will be) loaded; dtype: the activation dtype ("float16", ...);
    kv_cache_dtype: the target's KV format (engine argument).
    """
    spec = SpeculativeConfig.resolve(raw, has_mtp, tensor_parallel_size=tensor_parallel_size, env=env)
    if not spec.is_dflash2:
        return spec, []
    return spec, check_dflash2(spec, cfg, kv_cache_dtype=kv_cache_dtype, dtype=dtype,
                               pipeline_parallel_size=pipeline_parallel_size, env=env)

"""The engine: requests in, one scheduled step at a time, outputs out.

    engine.py       Engine / EngineConfig: add_request, step, abort over the pieces below
    scheduler.py    which requests run this step and how many tokens each (chunked prefill, preemption)
    executor.py     the seam to the model: one ModelStep in, logits (and drafts) out; UniProcExecutor
    runner.py       one packed StepInputs per step -> model forward (decode, verify, MTP draft)
    cuda_graphs.py  decode steps replayed from captured CUDA graphs
    sample_step.py  penalties, grammar masks, sampling, logprobs, draft acceptance, stop rules
    request.py      Request (one completion's state and stop rules); RequestOutput / CompletionOutput /
                    Logprob / RequestMetrics (what callers get back)
    sampling.py     SamplingParams, penalties, the sampler
    structured.py   structured-output constraints (grammar bitmasks per request)
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

# Imported on first use: spec/ builds on runner.py and cuda_graphs.py, and importing those must not pull in
# engine.py (which imports spec/).
_EXPORTS = {"CPU_KV_CACHE_GIB": ".engine", "Engine": ".engine", "EngineConfig": ".engine", "EngineStatus": ".engine", "Request": ".request"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'revolta.engine' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)

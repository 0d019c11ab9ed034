"""The engine: requests in, one scheduled step at a time, outputs out.

    engine.py       Engine / EngineConfig: add_request, step, abort over the pieces below
    scheduler.py    which requests run this step and how many tokens each (chunked prefill, preemption)
    runner.py       one packed StepInputs per step -> model forward (decode, verify, MTP draft)
    cuda_graphs.py  decode steps replayed from captured CUDA graphs
    request.py      RequestOutput / CompletionOutput / Logprob / RequestMetrics (what callers get back)
    sampling.py     SamplingParams, penalties, the sampler
    structured.py   structured-output constraints (grammar bitmasks per request)
"""

from .engine import Engine, EngineConfig

__all__ = ["Engine", "EngineConfig"]

"""Engine test helpers: greedy requests that run to a fixed length, and a spy on the logits the engine samples from.

The engine samples, accepts drafts and applies stop rules itself (engine/sample_step.py); tests that need to see
the logits wrap its StepSampler instead of passing a sampling function.
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor

from revolta.engine import Request
from revolta.engine.sampling import SamplingParams


def greedy_request(request_id: str, prompt_token_ids: list[int], max_tokens: int, mm_prompt=None) -> Request:
    """A greedy request that runs to exactly max_tokens (end-of-sequence ignored)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, list(prompt_token_ids), params, mm_prompt=mm_prompt)


def run_to_completion(engine, requests: list[Request], max_steps: int = 1000) -> int:
    """Add `requests`, step the engine until none is unfinished; returns the steps taken (fails past max_steps)."""
    for r in requests:
        engine.add_request(r)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert steps < max_steps, "the engine stopped making progress"
    return steps


def spy_rows(engine, on_rows: Callable[[Request, Tensor, int], None]) -> None:
    """Call on_rows(request, rows [n, V], emitted) after each sampling: the rows request owned this step
    (its next token's, then one per draft) and how many tokens it gained from them."""
    sampler = engine.sampler
    sample, verify = sampler.sample, sampler.verify

    def report(requests, logits, drafts, before):
        offset = 0
        for r, d, n0 in zip(requests, drafts, before):
            on_rows(r, logits[offset:offset + len(d) + 1], len(r.token_ids) - n0)
            offset += len(d) + 1

    def sample_spy(requests, logits):
        before = [len(r.token_ids) for r in requests]
        sample(requests, logits)
        report(requests, logits, [[] for _ in requests], before)

    def verify_spy(requests, logits, drafts):
        before = [len(r.token_ids) for r in requests]
        accepted = verify(requests, logits, drafts)
        report(requests, logits, drafts, before)
        return accepted

    sampler.sample, sampler.verify = sample_spy, verify_spy


def record_gaps(engine) -> None:
    """Record the top-1/top-2 logit gap of every token the engine emits (`r.gaps`) for failure reports."""
    def on_rows(r, rows, emitted):
        top2 = rows[:emitted].float().topk(2, dim=-1).values
        r.__dict__.setdefault("gaps", []).extend((top2[:, 0] - top2[:, 1]).tolist())

    spy_rows(engine, on_rows)


def kill_rank_and_expect_fatal(engine, group, request_id: str, bound_s: float) -> None:
    """Kill rank 1's worker mid-request: the next step raises FatalEngineError naming it within `bound_s`, the
    health check stays failed, and aborting the running request (what a server does) raises nothing."""
    import time

    import pytest

    from revolta.errors import FatalEngineError

    worker = group.procs[0]
    worker.kill()
    worker.join(10)
    t0 = time.monotonic()
    with pytest.raises(FatalEngineError, match=r"worker\(s\) \['revolta-tp-rank1'\] exited"):
        engine.step()
    assert time.monotonic() - t0 < bound_s
    with pytest.raises(FatalEngineError):  # out of step for good
        engine.check_health()
    engine.abort(request_id)

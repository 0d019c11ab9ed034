"""Start-up warm-up: every row count a speculative round can verify runs once before the first request.

Why: a Triton kernel compiles once per specialization key, and the rows one request verifies in a round are part of
several keys (the QSA kernels' Q, the HC read's BLOCK_M, BLOCK_T of the MoE grouping and the PLE rows, the GDN commit
flags: benchmarks/RESULTS.md H2). Rounds through CUDA graphs capture those shapes at start-up, but eager rounds
(tensor_parallel_size > 1, enforce_eager) compiled each one on first use, inside a user's request: a request's last
rounds near max_tokens draft fewer (k - 1, ..., 1, 0), and each new row count cost a compile of ~0.3-1 s on a fresh
process, as did the first prefill. `warm_up` runs one short greedy request per row count 1 .. k + 1 (max_tokens d + 2:
the round after its prefill verifies d drafts, Engine._num_drafts), without speculation one request (a prefill and a
decode step), then puts back what they touched: the speculation counters, the adaptive policy (off while warming up,
so every round drafts), the prefix cache. Prompts of 16 and 17 tokens: Triton specializes integers on divisibility by
16, so both kinds of prefill length compile.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..spec.stats import SpecStats
from .request import Request
from .sampling import SamplingParams

PROMPT_LENS = (16, 17)
MAX_STEPS = 64  # a warm-up request finishes in a prefill and at most d + 1 decode steps


@dataclass(frozen=True)
class WarmupReport:
    """What `warm_up` ran: requests, the row counts they were built to verify (1 .. k + 1; () without
    speculation; tests/engine/test_warmup.py checks the executor saw them), seconds."""

    requests: int
    verify_rows: tuple[int, ...]
    seconds: float

    def describe(self) -> str:
        rows = f", verify rounds of {self.verify_rows[0]}-{self.verify_rows[-1]} rows" if self.verify_rows else ""
        return f"{self.requests} request{'s' * (self.requests != 1)}{rows}, {self.seconds:.1f} s"


def warm_up(engine: Any) -> WarmupReport:
    """Run the warm-up requests through `engine` (an Engine with no request in flight); see the module docstring."""
    if engine.has_unfinished():
        raise RuntimeError("warm_up runs before the first request: this engine has requests in flight")
    start = time.perf_counter()
    k = engine.spec.drafts_at(1) if engine.spec.enabled else 0
    drafts = list(range(k, -1, -1)) if engine.spec.enabled else [0]  # the longest round first
    vocab = engine.sampler.num_text_ids
    policy, drafting = engine.policy, engine._drafting
    engine.policy, engine._drafting = None, engine.spec.enabled
    try:
        for i, d in enumerate(drafts):
            n = PROMPT_LENS[i % len(PROMPT_LENS)]
            ids = [(7 * j + 3 + i) % vocab for j in range(n)]
            params = SamplingParams(temperature=0.0, max_tokens=d + 2, ignore_eos=True)
            engine.add_request(Request(f"revolta-warmup-{i}", ids, params))
            for _ in range(MAX_STEPS):
                if not engine.has_unfinished():
                    break
                engine.step()
            else:
                raise RuntimeError(f"the warm-up request with {d} drafts did not finish in {MAX_STEPS} steps")
    finally:
        for r in list(engine._seqs):  # a failed step: nothing of the warm-up stays queued or holds cache
            engine.abort(r)
        engine.policy = type(policy)(policy.config, policy.clock) if policy is not None else None
        engine._drafting = drafting
        engine.spec_stats = SpecStats()
        engine.num_paused_steps = 0
        engine.allocator.reset_prefix_cache()
    rows = tuple(sorted(d + 1 for d in drafts)) if engine.spec.enabled else ()
    return WarmupReport(len(drafts), rows, time.perf_counter() - start)

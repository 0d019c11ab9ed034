"""A collective whose peer never joins fails within the context's timeout (ParallelTimeout), not a hang."""

from __future__ import annotations

import time
from datetime import timedelta

import torch

from revolta.parallel import ParallelContext
from revolta.parallel.context import ParallelTimeout
from tp_run import run_ranks

WAIT = timedelta(seconds=2)


def _rank(rank: int, tp: int, group, stall_s: float):
    ctx = ParallelContext.from_group(group, timeout=WAIT)
    if rank == 1:  # the stalled rank: never calls the collective its peer waits in
        time.sleep(stall_s)
        return None
    t0 = time.monotonic()
    try:
        ctx.all_reduce(torch.ones(4))
    except ParallelTimeout as e:
        return time.monotonic() - t0, str(e)
    return time.monotonic() - t0, "no error"


def test_a_stalled_peer_is_a_bounded_error(tmp_path):
    elapsed, message = run_ranks(_rank, 2, tmp_path, 4.0, timeout_s=60)[0]
    assert "all_reduce of (4,)" in message and "another rank died or diverged" in message, message
    assert elapsed < WAIT.total_seconds() + 3, f"the wait took {elapsed:.1f} s with a {WAIT} timeout"

"""ParallelContext on two real gloo ranks: bf16 tensors reduce and gather (gloo has no bf16 reduction: they
travel as fp32 and come back bf16), and a collective whose peer never joins fails within the context's
timeout (ParallelTimeout), not a hang."""

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
    x = torch.tensor([1.0, 2.0 ** -9, 3.0], dtype=torch.bfloat16) * (rank + 1)
    reduced, gathered = ctx.all_reduce(x.clone()), ctx.all_gather(x[None], dim=0)
    if rank == 1:  # the stalled rank: never calls the collective its peer waits in
        time.sleep(stall_s)
        return reduced, gathered
    t0 = time.monotonic()
    try:
        ctx.all_reduce(torch.ones(4))
    except ParallelTimeout as e:
        return time.monotonic() - t0, str(e), reduced, gathered
    return time.monotonic() - t0, "no error", reduced, gathered


def test_bf16_collectives_and_a_stalled_peer(tmp_path):
    (elapsed, message, reduced, gathered), rank1 = run_ranks(_rank, 2, tmp_path, 4.0, timeout_s=60,
                                                            final_barrier=False)  # rank 0's all_reduce stays unmatched
    x = torch.tensor([1.0, 2.0 ** -9, 3.0], dtype=torch.bfloat16)
    for got_sum, got_all in (reduced, gathered), rank1:
        assert got_sum.dtype == torch.bfloat16 and torch.equal(got_sum, x * 3)
        assert got_all.dtype == torch.bfloat16 and torch.equal(got_all, torch.stack([x, x * 2]))
    assert "all_reduce of (4,)" in message and "another rank died or diverged" in message, message
    assert elapsed < WAIT.total_seconds() + 3, f"the wait took {elapsed:.1f} s with a {WAIT} timeout"

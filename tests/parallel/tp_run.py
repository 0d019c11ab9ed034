"""Run a function on `tp` real processes (spawn, gloo over a FileStore) with a bounded wait: a rank that
raises or hangs fails the test with its traceback instead of hanging it. Imported by name by the spawned
children (tests/parallel is on sys.path in the parent, and spawn hands sys.path to the children)."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = timedelta(seconds=30)


def _entry(rank: int, tp: int, tmp: str, fn, args, final_barrier: bool) -> None:
    torch.set_num_threads(1)  # 2 shared cores: ranks must not oversubscribe them
    try:
        store = dist.FileStore(os.path.join(tmp, "store"), tp)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=tp, timeout=COLLECTIVE_TIMEOUT)
        try:
            result = fn(rank, tp, dist.group.WORLD, *args)
            torch.save(result, os.path.join(tmp, f"result{rank}.pt"))
            # every rank done before any tears gloo down: a rank whose peer closed first died once in
            # teardown ("terminate called without an active exception", exit -6) after saving its result.
            # Off for tests that leave a collective unmatched on purpose (the barrier would pair with it).
            if final_barrier:
                dist.barrier()
        finally:
            dist.destroy_process_group()
    except BaseException:
        Path(tmp, f"error{rank}.txt").write_text(traceback.format_exc())
        raise


def run_ranks(fn, tp: int, tmp: Path, *args, timeout_s: float = 120.0, final_barrier: bool = True) -> list:
    """fn(rank, tp, group, *args) on tp processes -> the list of their return values, rank order."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(r, tp, str(tmp), fn, args, final_barrier), daemon=True) for r in range(tp)]
    for p in procs:
        p.start()
    import time

    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join(5)
    errors = {r: Path(tmp, f"error{r}.txt").read_text() for r in range(tp) if Path(tmp, f"error{r}.txt").exists()}
    if hung or errors or any(p.exitcode != 0 for p in procs):
        raise AssertionError(f"ranks still running after {timeout_s} s: {hung}; exit codes "
                             f"{[p.exitcode for p in procs]}; errors:\n" + "\n".join(f"rank {r}:\n{e}"
                                                                                    for r, e in errors.items()))
    return [torch.load(Path(tmp, f"result{r}.pt")) for r in range(tp)]


def gloo_threads() -> list[str]:
    """Names of this process's gloo threads (torch names them pt_gloo_* and gloo_*): they live as long as a
    gloo process group object does, whatever destroy_process_group has done."""
    tasks = Path("/proc/self/task")
    names = ((t / "comm").read_text().strip() for t in tasks.iterdir())
    return sorted(name for name in names if name.startswith(("pt_gloo", "gloo")))


def worker_then_threads(rank: int, rs, inbox, ready, out: str) -> None:
    """Run tp_executor's real worker loop as `rank`, then write the gloo threads still alive in this process
    (one name a line) to `out`: what would still run when the interpreter tears the process down."""
    from revolta.engine import tp_executor

    try:
        tp_executor._worker(rank, rs, inbox, ready)
    finally:  # a failed rank too (its exception then ends the process)
        Path(out).write_text("".join(f"{name}\n" for name in gloo_threads()))

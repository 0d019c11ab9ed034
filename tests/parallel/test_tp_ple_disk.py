"""`ple_placement="disk"` at tensor_parallel_size=2 (CPU, gloo, real processes; issues 22 and 23): each rank starts
its own PLE worker, which maps only the rank's row range of an FP8 table in 3 shards (rank 0's half ends inside the
second shard) and zeroes the rows the other rank owns; the all-reduce gives every rank the full rows, so the greedy
tokens are TP1's with the table on the device (MTP speculation on, chunked prefill, a prefix hit). Rank 1's PLE
worker killed mid-request: the stream fails within the bound with the PLE error naming rank 1 and the worker, the
engine stays stopped, and no process the LLM started is left after close()."""

from __future__ import annotations

import time

import psutil
import pytest

from revolta import LLM
from revolta.engine.sampling import SamplingParams
from revolta.parallel.layers import vocab_range
from revolta.parallel.ple import RankStagedRows
from revolta.ple.disk import PLEWorkerError
from test_tp_llm import ARGS, PROMPTS, _run
from tp_tiny import tiny, write_fp8_ple_checkpoint

BOUND_S = 10.0  # issue 22: a dead PLE worker fails the requests within ~10 s
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/parallel/conftest.py


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_disk") / "ckpt"
    return path, write_fp8_ple_checkpoint(tiny(), path)


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.NoSuchProcess:  # exited since it was listed
        return ""


def _children() -> list[psutil.Process]:
    """This test process's descendants, at any depth (under pytest-xdist also a server another module's fixture
    started on this worker: `_started` leaves out what ran before the LLM)."""
    return psutil.Process().children(recursive=True)


def _started(llm: LLM, before: list[psutil.Process]) -> tuple[list[psutil.Process], dict[int, psutil.Process]]:
    """Every process started since `before` (`_children()` taken before the LLM was made), at any depth, once each
    rank's PLE worker runs (a worker rank builds its executor after rank 0 has built its own), and those workers
    by their rank's pid."""
    ranks = [psutil.Process().pid] + [p.pid for p in llm.engine.executor.procs]
    earlier = {p.pid for p in before}
    deadline = time.monotonic() + 60
    while True:
        # multiprocessing's resource tracker is this interpreter's, started with the first spawn: not the LLM's
        procs = [p for p in _children() if p.pid not in earlier and "resource_tracker" not in _cmdline(p)]
        workers = {p.ppid(): p for p in procs if "revolta.ple.worker" in _cmdline(p)}
        if sorted(workers) == sorted(ranks):
            return procs, workers
        assert time.monotonic() < deadline, f"PLE workers of ranks {sorted(workers)}, expected one for each of {ranks}"
        time.sleep(0.05)


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _assert_all_gone(procs: list[psutil.Process], bound_s: float = BOUND_S) -> None:
    deadline = time.monotonic() + bound_s
    alive = procs
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _running(p)]
        time.sleep(0.05)
    assert not alive, f"still running {bound_s:.0f} s after close(): {[(p.pid, p.cmdline()) for p in alive]}"


def test_tp2_disk_gives_the_tp1_device_tokens(ckpt):
    path, rows = ckpt
    want, _ = _run(LLM(model=path, **ARGS))  # TP1, the FP8 table on the device
    before = _children()
    llm = LLM(model=path, tensor_parallel_size=2, ple_placement="disk", **ARGS)
    started, _ = _started(llm, before)  # one PLE worker per rank
    try:
        tables = [m.table for m in llm.model.modules() if isinstance(getattr(m, "table", None), RankStagedRows)]
        half = vocab_range(rows, 0, 2)[1]
        assert [t.row_range for t in tables] == [(0, half)]  # rank 0's rows
        shown = {name: value for name, value, _ in llm.effective_config()}["ple_placement"]
        assert shown.startswith("disk (") and f"this rank's rows [0, {half:,}) of {rows:,}" in shown, shown
        got, hits = _run(llm)
        stats = llm.engine.spec_stats
    finally:
        llm.close()
    assert got == want and hits == 48
    assert stats.num_rounds > 0  # the MTP default ran: verify rows went through the workers too
    _assert_all_gone(started)


def test_a_killed_rank_ple_worker_fails_the_stream_within_the_bound(ckpt):
    path, _ = ckpt
    before = _children()
    llm = LLM(model=path, tensor_parallel_size=2, ple_placement="disk", speculative_config={"method": None}, **ARGS)
    started, workers = _started(llm, before)
    try:
        victim = workers[llm.engine.executor.procs[0].pid]  # rank 1's
        params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        stream = llm.stream([{"prompt_token_ids": p} for p in PROMPTS[:2]], params)
        next(stream)
        victim.kill()
        t0 = time.monotonic()
        with pytest.raises(PLEWorkerError) as e:
            for _ in stream:
                assert time.monotonic() - t0 < BOUND_S + 5, "the stream never failed"
        took = time.monotonic() - t0
        message = str(e.value)
        assert took < BOUND_S, f"the stream failed after {took:.1f} s"
        assert "tensor-parallel rank 1" in message, message
        assert f"PLE worker process (pid {victim.pid}) was killed by SIGKILL" in message, message
        with pytest.raises(PLEWorkerError, match="tensor-parallel rank 1"):  # the engine does not run again
            llm.check_health()
    finally:
        llm.close()
    _assert_all_gone(started)

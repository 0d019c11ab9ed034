"""Where tensor-parallel ranks run, checked without a GPU (parallel/devices.py, engine/tp_executor.py): rank r on
cuda:r over NCCL or on the CPU over gloo; the NCCL environment defaults (the user's values win); the refusals (more
ranks than visible GPUs, a device index other than 0, mixed GPUs) before any rank starts or weight loads; every
rank makes its GPU current before it joins the group; NCCL's group timeout stays behind the bounded wait; tp > 1
never captures CUDA graphs; a step reaches the workers as it was when sent. Single process, well under a second."""

from __future__ import annotations

import multiprocessing as stdlib_mp
from datetime import timedelta

import pytest
import torch

from revolta.engine import EngineConfig
from revolta.engine import tp_executor
from revolta.llm_load import resolve_parallel
from revolta.parallel import ParallelConfig, ParallelConfigError
from revolta.parallel.devices import (NCCL_ENV, NCCL_WATCHDOG_MARGIN, apply_nccl_env, check_rank_devices,
                                      group_timeout, rank_placement)
from tp_tiny import tiny

H200 = ("NVIDIA H200", 150_000_000_000)


def test_rank_r_runs_on_cuda_r_over_nccl_and_on_the_cpu_over_gloo():
    for device in ("cuda", "cuda:0", torch.device("cuda")):
        placed = [rank_placement(device, r) for r in range(4)]
        assert [p.device for p in placed] == [torch.device("cuda", r) for r in range(4)]
        assert {p.backend for p in placed} == {"nccl"}
    assert [(p.device, p.backend) for p in (rank_placement("cpu", r) for r in range(2))] == \
        [(torch.device("cpu"), "gloo")] * 2
    with pytest.raises(ParallelConfigError, match="'cpu' \\(gloo\\) or 'cuda' \\(NCCL\\), not 'meta'"):
        rank_placement("meta", 1)


def test_the_nccl_watchdog_stays_behind_the_bounded_wait():
    wait = timedelta(seconds=3)
    assert group_timeout("gloo", wait) == wait
    assert group_timeout("nccl", wait) == wait + NCCL_WATCHDOG_MARGIN > wait


def test_nccl_environment_defaults_keep_the_users_values():
    env = {"NCCL_NVLS_ENABLE": "1", "PATH": "/bin"}  # the user asked for NVLS: kept
    added = apply_nccl_env(env)
    assert env == {"NCCL_NVLS_ENABLE": "1", "PATH": "/bin", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                   "NVSHMEM_DISABLE_NVLS": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    assert added == {k: v for k, v in NCCL_ENV.items() if k != "NCCL_NVLS_ENABLE"}
    assert apply_nccl_env(env) == {}  # idempotent
    fresh: dict[str, str] = {}
    apply_nccl_env(fresh)
    assert fresh["NCCL_NVLS_ENABLE"] == "0"


def test_device_layouts_that_cannot_run_are_refused_with_the_fix():
    check_rank_devices("cuda", ParallelConfig(4, 2), [H200] * 4)
    check_rank_devices("cuda:0", ParallelConfig(2), [H200] * 2 + [("NVIDIA V100", 32 << 30)])  # only 0, 1 used
    check_rank_devices("cpu", ParallelConfig(4), [])  # CPU ranks need no GPU
    check_rank_devices("cuda:3", ParallelConfig(1), [H200] * 4)  # tp 1: any device
    with pytest.raises(ParallelConfigError, match=r"needs 4 devices but 2 are visible.*CUDA_VISIBLE_DEVICES"):
        check_rank_devices("cuda", ParallelConfig(4), [H200] * 2)
    with pytest.raises(ParallelConfigError, match=r"device='cuda:1'.*rank r runs on cuda:r.*CUDA_VISIBLE_DEVICES=1,2"):
        check_rank_devices("cuda:1", ParallelConfig(2), [H200] * 4)
    with pytest.raises(ParallelConfigError, match=r"mixed GPUs \(cuda:0 NVIDIA H200 \(140 GiB\), cuda:1 NVIDIA V100 "
                                                  r"\(32 GiB\)\).*alike GPUs"):
        check_rank_devices("cuda", ParallelConfig(2), [H200, ("NVIDIA V100", 32 << 30)])
    with pytest.raises(ParallelConfigError, match="mixed GPUs"):  # same model, a quarter less memory (e.g. a MIG slice)
        check_rank_devices("cuda", ParallelConfig(2), [H200, (H200[0], H200[1] * 3 // 4)])
    check_rank_devices("cuda", ParallelConfig(2), [H200, (H200[0], H200[1] - (64 << 20))])  # 64 MiB less: alike


def test_llm_refuses_a_gpu_layout_before_loading(monkeypatch):
    """resolve_parallel (LLM's check before any weight is read) counts the visible GPUs; enough alike ones pass."""
    cfg = tiny()
    monkeypatch.setattr("revolta.llm_load.visible_gpus", lambda: [H200])
    with pytest.raises(ParallelConfigError, match="needs 2 devices but 1 are visible"):
        resolve_parallel({"tensor_parallel_size": 2}, cfg, torch.device("cuda"))
    monkeypatch.setattr("revolta.llm_load.visible_gpus", lambda: [H200] * 2)
    assert resolve_parallel({"tensor_parallel_size": 2}, cfg, torch.device("cuda")).tp == 2
    monkeypatch.setattr("revolta.llm_load.visible_gpus", lambda: pytest.fail("GPUs counted for a CPU run"))
    assert resolve_parallel({"tensor_parallel_size": 2}, cfg, torch.device("cpu")).tp == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_cuda_group_without_gpus_is_refused_before_anything_starts(monkeypatch):
    monkeypatch.setattr(tp_executor.mp, "get_context", lambda *a: pytest.fail("spawned a rank"))
    with pytest.raises(ParallelConfigError, match="needs 2 devices but 0 are visible"):
        tp_executor.TPGroup.start(tiny(), "/nonexistent", 2, with_mtp=False, device="cuda")


def test_each_rank_sets_its_gpu_before_joining_the_nccl_group(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(tp_executor.torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(tp_executor.dist, "init_process_group",
                        lambda backend, **kw: calls.append(("init", backend, kw["device_id"], kw["timeout"], kw["rank"])))
    monkeypatch.setattr(tp_executor.dist, "FileStore", lambda path, n: None)
    monkeypatch.setattr(tp_executor.ParallelContext, "from_group", classmethod(lambda cls, g, timeout: timeout))
    rs = tp_executor.RankSpec(tiny(), "ckpt", 4, 1, False, torch.float16, str(tmp_path / "store"), 5.0, device="cuda")
    wait, device = tp_executor._init_group(3, rs)
    cuda3 = torch.device("cuda", 3)
    assert calls == [("set_device", cuda3), ("init", "nccl", cuda3, timedelta(seconds=5) + NCCL_WATCHDOG_MARGIN, 3)]
    assert (wait, device) == (timedelta(seconds=5), cuda3)  # the context's bound is the wait itself
    calls.clear()
    wait, device = tp_executor._init_group(1, tp_executor.RankSpec(tiny(), "ckpt", 2, 1, False, torch.float32,
                                                                   str(tmp_path / "s2"), 5.0))
    assert calls == [("init", "gloo", None, timedelta(seconds=5), 1)] and device == torch.device("cpu")


def test_tp_ranks_never_capture_cuda_graphs():
    assert EngineConfig(max_model_len=64, kernels="triton").use_cuda_graphs
    assert not EngineConfig(max_model_len=64, kernels="triton", tensor_parallel_size=2).use_cuda_graphs


def test_a_step_reaches_the_workers_as_it_was_sent():
    """Rank 0 attaches tensors (media rows on its GPU) to the step right after sending it; a worker must not see
    them (the queue's feeder thread pickles later, so the message is pickled when it is sent)."""
    inbox = stdlib_mp.get_context("spawn").Queue()
    step = {"token_ids": [1, 2, 3], "mm_embeds": None}
    tp_executor._send([inbox], "execute", (step,))
    step["mm_embeds"] = torch.ones(2, 4)  # what rank 0's execute does next
    step["token_ids"].append(4)
    op, (got,) = tp_executor._receive(inbox, timeout_s=10)
    assert op == "execute" and got == {"token_ids": [1, 2, 3], "mm_embeds": None}
    inbox.close()
    inbox.join_thread()


@pytest.mark.parametrize("op,exitcode", [("stop", 0), ("no_such_call", 1)], ids=["stopped", "failed"])
def test_a_worker_has_released_its_group_when_it_ends(tmp_path, op, exitcode):
    """A worker that stops, or fails (here: a call before its executor exists), ends its gloo threads before its
    function ends. Threads that outlive it die in the interpreter's teardown, and one that did aborted a cleanly
    stopped worker once ("terminate called without an active exception", a non-zero exit code)."""
    from revolta.weights import save_checkpoint
    from tp_run import gloo_threads, worker_then_threads
    from tp_tiny import full_model

    cfg = tiny()
    save_checkpoint(full_model(cfg), tmp_path / "ckpt", progress=False)
    rs = tp_executor.RankSpec(cfg, str(tmp_path / "ckpt"), 2, 1, False, torch.float32, str(tmp_path / "store"), 30.0)
    ctx = stdlib_mp.get_context("spawn")
    inbox, ready, out = ctx.Queue(), ctx.Queue(), tmp_path / "threads.txt"
    proc = ctx.Process(target=worker_then_threads, args=(1, rs, inbox, ready, str(out)), daemon=True)
    proc.start()
    try:
        assert ready.get(timeout=60) == 1
        tp_executor._init_group(0, rs)
        try:
            assert gloo_threads()  # the probe sees the threads of a live group
            tp_executor._send([inbox], op, ())
            proc.join(60)
        finally:
            tp_executor._leave_group(failed=False)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    assert proc.exitcode == exitcode and out.read_text() == ""
    reported = tp_executor.TPGroup(None, 2, [], [], str(tmp_path)).reported()  # the failed rank's error reached rank 0
    assert (reported is None) == (op == "stop")


def test_the_start_waits_for_every_worker_with_a_bound(tmp_path):
    """TPGroup.start waits twice on the workers' ready queue (joining, then loaded): a worker that never reports
    fails the start after the bound, naming the phase; one that dies meanwhile fails it at once, naming the phase."""
    import queue
    import time as time_mod
    from types import SimpleNamespace

    from revolta.errors import FatalEngineError

    alive = SimpleNamespace(name="revolta-tp-rank1", exitcode=None, is_alive=lambda: True)
    group = tp_executor.TPGroup(None, 2, [], [alive], str(tmp_path))
    t0 = time_mod.monotonic()
    with pytest.raises(FatalEngineError, match=r"1 tensor-parallel worker\(s\) did not load their shards within 1 s"):
        group._wait_ready(queue.Queue(), 1.0, "load their shards", hint=" while loading its shard")
    assert time_mod.monotonic() - t0 < 5
    ready = queue.Queue()
    ready.put(1)
    group._wait_ready(ready, 0.5, "load their shards", hint="")  # the message arrived: no wait
    dead = SimpleNamespace(name="revolta-tp-rank1", exitcode=-9, is_alive=lambda: False)
    with pytest.raises(FatalEngineError, match=r"exited \(exit codes \[-9\]\) while loading its shard"):
        tp_executor.TPGroup(None, 2, [], [dead], str(tmp_path))._wait_ready(queue.Queue(), 30, "load their shards",
                                                                             hint=" while loading its shard")

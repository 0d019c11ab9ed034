"""The engine with a 2-rank MultiProcExecutor (gloo, fp32, a spawned worker) gives the greedy tokens of the
single-process engine: concurrent requests, chunked prefill and prefix hits, with and without MTP speculation;
the worker exits on close.
A worker killed mid-request turns the next step into a FatalEngineError at once."""

from __future__ import annotations

import time

import pytest
import torch

from engine_spies import greedy_request  # tests/, on sys.path
from revolta.engine import Engine, EngineConfig
from revolta.engine.tp_executor import MultiProcExecutor
from revolta.errors import FatalEngineError
from revolta.weights import save_checkpoint
from tp_tiny import full_model, tiny

PROMPTS = [[(7 * i + 3 * n) % 500 for i in range(n)] for n in (21, 9, 50)]
PROMPTS.append(PROMPTS[2][:48] + [1, 2, 3])  # the third prompt's 3 full pages (its snapshot at 48): a prefix hit


def _engine(model, spec=None) -> Engine:
    return Engine(model, EngineConfig(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=24, block_size=16,
                                      kv_cache_gib=0.004, enable_prefix_caching=True,
                                      speculative_config=spec or {"method": None}))


def _generate(engine: Engine) -> tuple[list[list[int]], int | None]:
    """Greedy tokens of every prompt, and the prompt tokens served by the prefix cache."""
    reqs = [greedy_request(f"r{i}", p, max_tokens=5) for i, p in enumerate(PROMPTS)]
    steps = 0
    for batch in (reqs[:3], reqs[3:]):  # the last prompt once the others (and their pages) are done
        for r in batch:
            engine.add_request(r)
        while engine.has_unfinished():
            engine.step()
            steps += 1
            assert steps < 500
    return [r.token_ids for r in reqs], engine.allocator.stats.hit_tokens


@pytest.mark.parametrize("spec", [None, {"method": "mtp", "num_speculative_tokens": 2}], ids=["plain", "mtp"])
def test_tp2_engine_equals_tp1(tmp_path, spec):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # shared cores: see test_tp_forward
    try:
        cfg = tiny()
        model = full_model(cfg)
        save_checkpoint(model, tmp_path / "ckpt", progress=False)
        want = _generate(_engine(model, spec))
        engine = _engine(model, spec)
        engine.executor = MultiProcExecutor.start(cfg, tmp_path / "ckpt", engine.plan, engine.spec, engine.config,
                                                  tp=2, workdir=tmp_path, timeout_s=30)
        procs = engine.executor.procs
        assert engine.executor.local.model.lm_head.weight.shape[0] == cfg.text.vocab_size // 2  # rank 0's half
        try:
            got = _generate(engine)
        finally:
            engine.executor.close()
    finally:
        torch.set_num_threads(threads)
    assert got == want
    assert all(len(t) == 5 for t in got[0]) and got[1] == 48, got[1]  # 3 pages came from the prefix cache
    assert not any(p.is_alive() for p in procs) and all(p.exitcode == 0 for p in procs)
    if spec is not None:  # the drafter ran on the shards: drafts were proposed and verified
        assert engine.spec_stats.num_rounds > 0 and engine.spec_stats.num_draft_tokens > 0, engine.spec_stats


def test_a_killed_rank_is_a_fatal_engine_error(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = tiny()
        model = full_model(cfg)
        save_checkpoint(model, tmp_path / "ckpt", progress=False)
        engine = _engine(model)
        engine.executor = MultiProcExecutor.start(cfg, tmp_path / "ckpt", engine.plan, engine.spec, engine.config,
                                                  tp=2, workdir=tmp_path, timeout_s=30)
        worker = engine.executor.procs[0]
        try:
            engine.add_request(greedy_request("r", PROMPTS[2], max_tokens=5))
            engine.step()  # mid-request: the prompt is half prefilled
            worker.kill()
            worker.join(10)
            t0 = time.monotonic()
            with pytest.raises(FatalEngineError, match=r"worker\(s\) \['revolta-tp-rank1'\] exited"):
                engine.step()
            assert time.monotonic() - t0 < 5
        finally:
            engine.executor.close(timeout_s=5)
    finally:
        torch.set_num_threads(threads)
    assert not worker.is_alive()

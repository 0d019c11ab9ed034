"""Engine.pause while a CPU-tier KV load (a prefix hit swapped back in from pinned host memory) is pending.

A swap-in is issued inside the step that schedules it, so a pause either comes before that step (the load
has not started: clear_cache cancels it, keeping the cache lets it run after resume) or lands while it
runs (the load finishes with its step). Either way the tokens equal the reference and nothing leaks.
"""

from __future__ import annotations

import pytest
import torch

from test_engine import Req, assert_clean, ids, make_engine, model, reference, run  # noqa: F401 (model fixture)


def engine_with_a_pending_cpu_hit(model):
    """An engine whose CPU tier holds an evicted prefix, and a queued request that will load it back."""
    shared = [ids(60, seed=300 + i) for i in range(4)]  # 4 x 4 blocks > the 10 usable GPU blocks
    engine = make_engine(model, max_model_len=128, kv_cache_gib=0.00037, kv_offload_gib=0.002,
                         max_num_batched_tokens=64)
    for i, s in enumerate(shared):  # one after another: each evicts the previous prefixes from the GPU pool
        run(engine, [Req(f"f{i}", s + [7], max_tokens=4)])
    again = Req("again", shared[0] + [9, 9], max_tokens=4)
    engine.add_request(again)
    hit = engine.allocator._lookup(engine._seqs["again"], count=False)
    assert any(g is None for g in hit.gpu), "the prefix is still on the GPU: nothing would load from the CPU tier"
    return engine, again


def finish(engine):
    while engine.has_unfinished():
        engine.step()


@torch.no_grad()
@pytest.mark.parametrize("clear_cache", [True, False])
def test_pause_before_the_load_cancels_or_keeps_it(model, clear_cache):
    engine, again = engine_with_a_pending_cpu_hit(model)
    loaded = engine.allocator.stats.cpu_hit_blocks
    engine.pause(clear_cache=clear_cache)
    with pytest.raises(RuntimeError, match="paused"):
        engine.step()
    engine.resume()
    finish(engine)
    # cleared: the request recomputed its prefix (the load never started); kept: it loaded it after resume
    assert (engine.allocator.stats.cpu_hit_blocks > loaded) is not clear_cache
    assert again.token_ids == reference(model, again.prompt_token_ids, 4)
    assert_clean(engine)


@torch.no_grad()
def test_pause_landing_during_the_load_lets_it_finish(model):
    engine, again = engine_with_a_pending_cpu_hit(model)
    cpu = engine.cpu_storage
    copy_blocks, loads = cpu.copy_blocks, []

    def load_then_pause(pairs, dst=None):  # a pause (clearing the cache) arrives while the swap-in runs
        copy_blocks(pairs, dst)
        loads.append(len(list(pairs)))
        engine.pause(clear_cache=True)

    cpu.copy_blocks = load_then_pause
    engine.step()  # the step that carries the load completes it
    cpu.copy_blocks = copy_blocks
    assert loads and loads[0] > 0 and engine.paused
    engine.allocator.check()
    with pytest.raises(RuntimeError, match="paused"):
        engine.step()
    engine.resume()
    finish(engine)
    assert again.token_ids == reference(model, again.prompt_token_ids, 4)
    assert_clean(engine)

"""Preemption at tensor_parallel_size=2: a per-rank cache too small for the four concurrent requests forces the
scheduler to preempt (and later recompute) some of them while MTP drafts are verified; every rank drops and
recomputes the same sequences, so the greedy tokens are the TP1 engine's with an ample cache, and every block and
state slot is free again at the end."""

from __future__ import annotations


from engine_spies import greedy_request, run_to_completion  # tests/, on sys.path
from revolta.engine import Engine, EngineConfig
from revolta.engine.tp_executor import TPGroup
from revolta.weights import save_checkpoint
from tp_tiny import full_model, tiny

PROMPTS = [[(11 * i + 5 * n + 1) % 500 for i in range(n)] for n in (70, 79, 88, 97)]
SPEC = {"method": "mtp", "num_speculative_tokens": 2}


def _run(engine: Engine) -> list[list[int]]:
    reqs = [greedy_request(f"p{i}", p, max_tokens=8) for i, p in enumerate(PROMPTS)]
    run_to_completion(engine, reqs)
    return [r.token_ids for r in reqs]


def test_tp2_preemption_with_mtp_gives_the_tp1_tokens(tmp_path, one_thread):
    kw = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, block_size=16,
              enable_prefix_caching=False, speculative_config=SPEC)
    cfg = tiny()
    model = full_model(cfg)
    save_checkpoint(model, tmp_path / "ckpt", progress=False)
    want = _run(Engine(model, EngineConfig(**kw, kv_cache_gib=0.004)))
    group = TPGroup.start(cfg, tmp_path / "ckpt", 2, with_mtp=True, timeout_s=30)
    procs = group.procs
    try:
        # 16 blocks per rank at TP2 with MTP (13 state slots take 240 KiB): the four prompts need ~26 at
        # once (measured: p2 was preempted 6 times)
        engine = Engine(group.model, EngineConfig(**kw, kv_cache_gib=0.00045, tensor_parallel_size=2),
                        tp_group=group)
        blocks = engine.plan.num_blocks
        preempted: list[str] = []
        orig = engine.scheduler._preempt
        engine.scheduler._preempt = lambda seq: (preempted.append(seq.request_id), orig(seq))
        got = _run(engine)
        free_blocks, free_slots = engine.allocator.blocks.num_free, engine.allocator.slots.num_free
        slots = engine.allocator.config.num_slots
    finally:
        group.close()
    assert preempted, f"{blocks} blocks per rank held every request: the test did not preempt"
    assert got == want
    assert (free_blocks, free_slots) == (blocks - 1, slots - 1)  # all but the null block / slot are free again
    assert engine.spec_stats.num_rounds > 0 and engine.spec_stats.num_draft_tokens > 0, engine.spec_stats
    assert not any(p.is_alive() for p in procs) and all(p.exitcode == 0 for p in procs)

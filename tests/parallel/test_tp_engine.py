"""The engine at tensor_parallel_size=2 (rank 0's shard and a TPGroup: a 2-rank MultiProcExecutor, gloo, fp32, a
spawned worker) gives the greedy tokens of the single-process engine: concurrent requests, chunked prefill and prefix
hits, with and without MTP speculation; so do TP2 + DCP2 (with MTP) and TP4 + DCP2, the trunk K/V striped over the
ranks that share a KV head; the worker exits on close.
A worker killed mid-request (TP2, and TP2 + DCP2) turns the next step into a FatalEngineError at once, and the engine
stays failed."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from engine_spies import greedy_request, kill_rank_and_expect_fatal, run_to_completion  # tests/, on sys.path
from revolta.cache.capacity import plan_cache
from revolta.engine import Engine, EngineConfig
from revolta.engine.tp_executor import TPGroup
from revolta.errors import FatalEngineError
from revolta.weights import save_checkpoint
from tp_tiny import full_model, tiny

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/parallel/conftest.py

PROMPTS = [[(7 * i + 3 * n) % 500 for i in range(n)] for n in (21, 9, 50)]
PROMPTS.append(PROMPTS[2][:48] + [1, 2, 3])  # the third prompt's 3 full pages (its snapshot at 48): a prefix hit


def _engine(model, spec=None, group: TPGroup | None = None) -> Engine:
    tp, dcp = (1, 1) if group is None else (group.tp, group.dcp)
    return Engine(model, EngineConfig(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=24, block_size=16,
                                      kv_cache_gib=0.004, enable_prefix_caching=True,
                                      speculative_config=spec or {"method": None}, tensor_parallel_size=tp,
                                      decode_context_parallel_size=dcp),
                  tp_group=group)


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
    cfg = tiny()
    model = full_model(cfg)
    save_checkpoint(model, tmp_path / "ckpt", progress=False)
    want = _generate(_engine(model, spec))
    group = TPGroup.start(cfg, tmp_path / "ckpt", 2, with_mtp=spec is not None, timeout_s=30)
    procs = group.procs
    try:
        engine = _engine(group.model, spec, group)
        assert engine.executor.local.model.lm_head.weight.shape[0] == cfg.text.vocab_size // 2  # rank 0's half
        assert engine.plan.layout.tp == 2
        assert engine.plan.budget.weights_bytes == 0  # kv_cache_gib: a fixed allowance (see test_tp_llm)
        got = _generate(engine)
    finally:
        group.close()
    assert got == want
    assert all(len(t) == 5 for t in got[0]) and got[1] == 48, got[1]  # 3 pages came from the prefix cache
    assert not any(p.is_alive() for p in procs) and all(p.exitcode == 0 for p in procs)
    if spec is not None:  # the drafter ran on the shards: drafts were proposed and verified
        assert engine.spec_stats.num_rounds > 0 and engine.spec_stats.num_draft_tokens > 0, engine.spec_stats


@pytest.mark.parametrize("tp,dcp,text,spec", [
    (2, 2, dict(num_key_value_heads=1), {"method": "mtp", "num_speculative_tokens": 2}),
    (4, 2, dict(linear_num_key_heads=4), None),
], ids=["tp2-dcp2-mtp", "tp4-dcp2"])
def test_dcp_engine_equals_tp1(tmp_path, tp, dcp, text, spec):
    """DCP through the engine: chunked prefill, a prefix hit (its pages' stripes on every rank), decode and (TP2)
    MTP verify rows all attend the striped K/V; the greedy tokens are TP1's, and a DCP2 rank's cache plan holds
    more blocks than TP alone in the same allowance (each page is half the trunk K/V)."""
    cfg = tiny(**text)
    model = full_model(cfg)
    save_checkpoint(model, tmp_path / "ckpt", progress=False)
    want = _generate(_engine(model, spec))
    group = TPGroup.start(cfg, tmp_path / "ckpt", tp, with_mtp=spec is not None, timeout_s=30, dcp=dcp)
    procs = group.procs
    try:
        engine = _engine(group.model, spec, group)
        layout = engine.plan.layout
        assert (layout.tp, layout.dcp) == (tp, dcp)
        assert engine.storage.qsa[3].k_cache.shape[1] == 16 // dcp  # rank 0's stripe of each block
        tp_alone = plan_cache(cfg, engine.plan.cache, engine.plan.budget, tp=tp, dtype="float32")
        assert engine.plan.num_blocks > tp_alone.num_blocks, (engine.plan.num_blocks, tp_alone.num_blocks)
        got = _generate(engine)
    finally:
        group.close()
    assert got == want
    assert got[1] == 48, got[1]
    assert not any(p.is_alive() for p in procs) and all(p.exitcode == 0 for p in procs)
    if spec is not None:
        assert engine.spec_stats.num_rounds > 0 and engine.spec_stats.num_draft_tokens > 0, engine.spec_stats


@pytest.mark.parametrize("dcp", [1, 2], ids=["tp2", "tp2-dcp2"])
def test_a_killed_rank_is_a_fatal_engine_error(tmp_path, dcp):
    cfg = tiny(num_key_value_heads=1) if dcp > 1 else tiny()
    model = full_model(cfg)
    save_checkpoint(model, tmp_path / "ckpt", progress=False)
    group = TPGroup.start(cfg, tmp_path / "ckpt", 2, with_mtp=False, timeout_s=30, dcp=dcp)
    worker = group.procs[0]
    try:
        engine = _engine(group.model, None, group)
        engine.add_request(greedy_request("r", PROMPTS[2], max_tokens=5))
        engine.step()  # mid-request: the prompt is half prefilled
        kill_rank_and_expect_fatal(engine, group, "r", bound_s=5)
    finally:
        group.close(timeout_s=5)
    assert not worker.is_alive()


def test_a_stalled_rank_is_a_parallel_timeout_then_a_fatal_engine_error(tmp_path):
    """A worker that stops answering (SIGSTOP) mid-request: rank 0's collective gives up after timeout_s, the
    step raises FatalEngineError naming the ParallelTimeout, and the stalled worker is killed (no orphan)."""
    cfg = tiny()
    save_checkpoint(full_model(cfg), tmp_path / "ckpt", progress=False)
    group = TPGroup.start(cfg, tmp_path / "ckpt", 2, with_mtp=False, timeout_s=3)
    worker = group.procs[0]
    try:
        engine = _engine(group.model, None, group)
        engine.add_request(greedy_request("r", PROMPTS[2], max_tokens=5))
        engine.step()
        os.kill(worker.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(FatalEngineError, match="ParallelTimeout"):
            engine.step()
        took = time.monotonic() - t0
    finally:
        group.close(timeout_s=5)
    assert 2.5 < took < 10, took  # the 3 s collective timeout, plus stopping the group
    assert not worker.is_alive()


def test_tp2_engine_with_image_prompts_equals_tp1(tmp_path):
    """Rank 0 holds the vision tower and encodes; each step's vision rows are broadcast to the other rank: image
    prompts (chunked prefill across the pads, two images in one prompt, a text request alongside) give the TP1
    tokens."""
    from revolta.config import ModelConfig
    from revolta.model import FlashNextModel, init_random_weights
    from test_mm_engine import IMG, VE, VS, image, mm_request, text  # tests/engine
    from tiny_configs import T4_TEXT, TOKENS, V_TINY

    cfg = ModelConfig.from_dict(dict(model_type="qwen4_exp", text_config=dict(T4_TEXT, model_type="qwen4_exp_text"),
                                     vision_config=dict(V_TINY, model_type="qwen4_exp_vision"), **TOKENS))
    model = FlashNextModel(cfg, with_mtp=False).eval()
    init_random_weights(model, seed=3)
    save_checkpoint(model, tmp_path / "ckpt", progress=False)

    def run(engine: Engine) -> list[list[int]]:
        reqs = [mm_request(model, "two", text(5, 1) + [VS, IMG, VE] + text(3, 2) + [VS, IMG, VE] + text(4, 3),
                           {"image": [image(32, 48, 1), image(40, 24, 2)]}),
                mm_request(model, "one", text(6, 4) + [VS, IMG, VE] + text(2, 5), {"image": [image(24, 32, 3)]}),
                greedy_request("text", text(9, 6), max_tokens=6)]
        run_to_completion(engine, reqs, max_steps=500)
        return [r.token_ids for r in reqs]

    kw = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=20, block_size=16, kv_cache_gib=0.004,
              max_num_encoder_input_tokens=48, encoder_cache_size=64)
    want = run(Engine(model, EngineConfig(**kw)))
    group = TPGroup.start(cfg, tmp_path / "ckpt", 2, with_mtp=False, timeout_s=30)
    try:
        engine = Engine(group.model, EngineConfig(**kw, tensor_parallel_size=2), tp_group=group)
        assert group.model.model.visual is not None and engine.encoder_cache is not None
        got = run(engine)
    finally:
        group.close()
    assert got == want and all(len(t) == 6 for t in got)


def _record_drafts(engine: Engine) -> list:
    """Every step's drafts as rank 0's executor returns them (appended to the returned list)."""
    seen, execute = [], engine.executor.execute

    def recording(step):
        result = execute(step)
        seen.append(result.drafts)
        return result

    engine.executor.execute = recording
    return seen


def test_tp2_engine_with_dflash2_equals_tp1(tmp_path):
    """A DFlash2 drafter (random weights) at TP2, its layers split like a decoder layer: it reads the tapped layer
    boundaries (whole on every rank) and embeds / projects through the target's vocabulary-parallel layers, so both
    ranks draft the same tokens; greedy output equals TP1's, drafts proposed and verified. With
    sharded_selector_codebook (the default at TP2) rank 0's selector holds its half of the vocabulary rows of both
    codebooks and the drafts are those of the replicated codebooks (false, the second engine over the same ranks);
    the engine's budget counts what the rank holds."""
    import json

    from revolta.presets.default_drafter import init_drafter_weights
    from revolta.spec.dflash2.checkpoint import save_draft_model
    from revolta.spec.dflash2.draft_config import DFlash2DraftConfig
    from revolta.spec.dflash2.model import DFlash2DraftModel
    from revolta.spec.dflash2.sharded_codebook import vocab_shard

    cfg = tiny()
    model = full_model(cfg)
    save_checkpoint(model, tmp_path / "ckpt", progress=False)
    L, V = cfg.text.num_hidden_layers, cfg.text.vocab_size
    raw = {"architectures": ["DFlash2DraftModel"], "vocab_size": V, "hidden_size": cfg.text.hidden_size,
           "intermediate_size": 2 * cfg.text.hidden_size, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "num_target_layers": L,
           "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64, "use_sliding_window": True,
           "dflash_config": {"block_size": 4, "mask_token_id": 3, "selector_rank": 16, "selector_top_k": 4,
                             "conv_kernel_size": 2, "conv_group_size": 16, "target_layer_ids": [0, L // 2, L - 1]}}
    draft = DFlash2DraftModel(DFlash2DraftConfig.from_dict(json.loads(json.dumps(raw)), source="test drafter"))
    init_drafter_weights(draft, seed=4)
    with torch.no_grad():  # codebook terms that move the walk off the top-1 candidates, so wrong rows change drafts
        for table in (draft.candidate_selector.predecessor_codebook, draft.candidate_selector.successor_codebook):
            table.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(5))
        draft.candidate_selector.hidden_projection.weight.mul_(20.0)
    path = str(save_draft_model(draft, tmp_path / "drafter"))
    full_bytes = sum(p.numel() * p.element_size() for p in draft.parameters())
    runs = {}
    want = _generate(_engine(model))
    group = TPGroup.start(cfg, tmp_path / "ckpt", 2, with_mtp=False, timeout_s=30)
    try:
        for sharded in (True, False):  # the first engine's ranks build the second's executors over the same shards
            engine = _engine(group.model, {"method": "dflash2", "model": path,
                                           "sm70_dflash2": {"sharded_selector_codebook": sharded}}, group)
            drafts = _record_drafts(engine)
            mine = engine.drafter.drafter
            assert mine.layers[0].self_attn.q_proj.weight.shape[0] == 2 * 16  # 2 of the 4 query heads
            assert mine.layers[1].mlp.down_proj.weight.shape[1] == cfg.text.hidden_size  # half of 2 H channels
            held = sum(p.numel() * p.element_size() for p in mine.parameters())
            runs[sharded] = (_generate(engine), drafts, engine.spec_stats, mine.candidate_selector, held,
                             engine.drafter_weights_bytes)
    finally:
        group.close()
    for sharded, (got, drafts, stats, selector, held, planned) in runs.items():
        assert got == want, sharded
        assert stats.num_rounds > 0 and stats.num_draft_tokens > 0, stats
        assert held == planned, (sharded, held, planned)  # the budget counts what rank 0 holds
        if sharded:
            start, end = vocab_shard(V, 0, 2)
            books = selector.codebook_shards
            assert (books.start, books.end) == (start, end) and end - start == -(-V // 2)
            assert books.predecessor_codebook.shape == books.successor_codebook.shape == (end - start, 16)
            assert not hasattr(selector, "predecessor_codebook")  # the whole tables are not held
        else:
            assert selector.codebook_shards is None and selector.predecessor_codebook.weight.shape == (V, 16)
            assert held < full_bytes  # the layers are split in both runs
    assert runs[False][4] - runs[True][4] == 2 * (V - -(-V // 2)) * 16 * 4  # fp32: the other half's rows of both books
    assert runs[True][1] == runs[False][1] and any(any(d) for d in runs[True][1])  # the same drafts every step

"""Engine on the paged hybrid cache: continuous batching, chunked prefill, preemption, prefix hits.

Greedy outputs must equal each request run alone on the simple per-sequence path, whatever
the batch, the chunking, preemptions or prefix-cache hits; nothing may leak.
"""

from __future__ import annotations

import pytest
import torch

from revolta.engine import Engine, EngineConfig
from engine_spies import greedy_request
from revolta.state import SequenceState
from test_paged_model import TINY, ids  # noqa: F401  (the tiny config and id helper)

from revolta.config import ModelConfig
from revolta.model import FlashNextModel, init_random_weights


Req = greedy_request  # a greedy request that runs to exactly max_tokens


@pytest.fixture(scope="module")
def model():
    m = FlashNextModel(ModelConfig.from_dict(TINY)).eval()
    init_random_weights(m, seed=11)
    return m


@torch.no_grad()
def reference(model, prompt, n):
    st, out = SequenceState(), []
    logits = model(torch.tensor(prompt), cu_seqlens=[0, len(prompt)], states=[st])[-1]
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = model(torch.tensor(out[-1:]), cu_seqlens=[0, 1], states=[st])[-1]
    return out


def run(engine, reqs, abort_after=None, on_step=None):
    for r in reqs:
        engine.add_request(r)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if abort_after is not None and steps == abort_after[0]:
            engine.abort(abort_after[1])
        if on_step is not None:
            on_step(engine)
        assert steps < 10_000
    return steps


def assert_clean(engine):
    a = engine.allocator
    a.check()
    assert not a._seqs, "requests still hold cache"
    assert a.blocks.num_free == a.config.num_blocks - 1  # everything but the null block is reusable
    assert a.slots.num_free == a.config.num_slots - 1


def make_engine(model, **kw):
    cfg = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=24, block_size=16, kv_cache_gib=0.002)
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg))


@torch.no_grad()
def test_concurrent_chunked_requests_equal_single_runs(model):
    prompts = [ids(n, seed=n) for n in (5, 41, 17, 3, 29, 60, 11)]
    reqs = [Req(f"r{i}", p, max_tokens=6 + i) for i, p in enumerate(prompts)]
    engine = make_engine(model, enable_prefix_caching=False)
    steps = run(engine, reqs)
    assert steps > len(prompts)  # prompts were chunked over several steps (budget 24 tokens)
    for r in reqs:
        assert r.token_ids == reference(model, r.prompt_token_ids, r.max_tokens), r.request_id
    assert_clean(engine)


@torch.no_grad()
def test_preemption_recomputes_to_identical_tokens(model):
    prompts = [ids(70 + 9 * i, seed=100 + i) for i in range(4)]
    reqs = [Req(f"p{i}", p, max_tokens=30) for i, p in enumerate(prompts)]
    engine = make_engine(model, kv_cache_gib=0.0005, max_num_batched_tokens=64)
    preempted = []
    orig = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: (preempted.append(seq.request_id), orig(seq))
    run(engine, reqs)
    assert preempted, "the cache was large enough for everything: the test did not preempt"
    for r in reqs:
        assert r.token_ids == reference(model, r.prompt_token_ids, 30), r.request_id
    assert_clean(engine)


@torch.no_grad()
def test_prefix_hit_gives_identical_outputs(model):
    shared = ids(53, seed=7)
    first = Req("a", shared + ids(5, seed=8), max_tokens=8)
    second = Req("b", shared + ids(9, seed=9), max_tokens=8)
    again = Req("c", list(first.prompt_token_ids), max_tokens=8)
    engine = make_engine(model)
    run(engine, [first])
    run(engine, [second])
    run(engine, [again])
    assert engine.allocator.stats.hit_tokens >= 2 * 48, engine.allocator.stats  # both later requests hit
    for r in (first, second, again):
        assert r.token_ids == reference(model, r.prompt_token_ids, 8), r.request_id
    assert again.token_ids == first.token_ids
    assert_clean(engine)


@torch.no_grad()
def test_cpu_tier_brings_evicted_prefixes_back(model):
    """A GPU pool too small to keep old prefixes: they go to the CPU tier and come back on a hit."""
    shared = [ids(60, seed=300 + i) for i in range(9)]  # 9 x 4 blocks > the 26 usable GPU blocks
    engine = make_engine(model, kv_cache_gib=0.0005, kv_offload_gib=0.002, max_num_batched_tokens=64)
    assert engine.cpu_storage is not None
    first = [Req(f"f{i}", s + [7], max_tokens=4) for i, s in enumerate(shared)]
    for r in first:  # one after another: each evicts the previous prefixes from the GPU pool
        run(engine, [r])
    again = [Req(f"g{i}", s + [9, 9], max_tokens=4) for i, s in enumerate(shared)]
    run(engine, again[:1])
    assert engine.allocator.stats.cpu_hit_blocks > 0, engine.allocator.stats
    for r in first + again[:1]:
        assert r.token_ids == reference(model, r.prompt_token_ids, 4), r.request_id
    assert_clean(engine)


@torch.no_grad()
def test_abort_frees_everything_and_others_continue(model):
    reqs = [Req(f"x{i}", ids(30, seed=200 + i), max_tokens=12) for i in range(3)]
    engine = make_engine(model, enable_prefix_caching=False)
    run(engine, reqs, abort_after=(4, "x1"))
    assert len(reqs[1].token_ids) < 12
    for r in (reqs[0], reqs[2]):
        assert r.token_ids == reference(model, r.prompt_token_ids, 12)
    assert_clean(engine)


def test_bad_requests_are_rejected_cleanly(model):
    engine = make_engine(model)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(Req("e", [], 3))
    with pytest.raises(ValueError, match="max_model_len=256"):
        engine.add_request(Req("long", ids(300, seed=1), 3))
    engine.add_request(Req("ok", ids(4, seed=2), 3))
    with pytest.raises(ValueError, match="already running"):
        engine.add_request(Req("ok", ids(4, seed=2), 3))
    run(engine, [])
    assert_clean(engine)


def test_fp8_kv_scales_from_the_checkpoint_reach_the_cache(model, tmp_path):
    """A checkpoint that ships `self_attn.{k,v}_scale` loads (they are cache metadata, not unexpected
    weights) and the fp8 pages use them; one without them falls back to 1.0."""
    import json

    from safetensors.torch import load_file, save_file

    from revolta.model import load_model
    from revolta.weights import save_checkpoint

    save_checkpoint(model, tmp_path, progress=False)
    model.cfg.save(tmp_path)
    plain = load_model(tmp_path, progress=False)
    assert plain.kv_scales == {}
    engine = Engine(plain, EngineConfig(max_model_len=64, kv_cache_dtype="fp8_e4m3", block_size=16,
                                        kv_cache_gib=0.01))
    assert float(engine.storage.qsa[3].k_scale) == 1.0
    files = sorted(tmp_path.glob("*.safetensors"))
    tensors = load_file(files[0])
    tensors["model.language_model.layers.3.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.language_model.layers.3.self_attn.v_scale"] = torch.tensor(0.25)
    save_file(tensors, files[0])
    index = tmp_path / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        for k in ("k", "v"):
            data["weight_map"][f"model.language_model.layers.3.self_attn.{k}_scale"] = files[0].name
        index.write_text(json.dumps(data))
    scaled = load_model(tmp_path, progress=False)
    engine = Engine(scaled, EngineConfig(max_model_len=64, kv_cache_dtype="fp8_e4m3", block_size=16,
                                         kv_cache_gib=0.01))
    assert (float(engine.storage.qsa[3].k_scale), float(engine.storage.qsa[3].v_scale)) == (0.5, 0.25)
    req = Req("s", ids(20, seed=1), max_tokens=3)
    run(engine, [req])
    assert len(req.token_ids) == 3


@torch.no_grad()
def test_a_thousand_short_requests_leave_the_pools_as_they_started(model):
    # one-token prompts (so every step runs the cheap decode path on CPU), 1-3 new tokens each, a pool
    # with room for few of them at once and aborts mixed in: afterwards every block and slot is free
    # again and the bookkeeping checks out
    engine = make_engine(model, max_num_seqs=32, max_num_batched_tokens=128, kv_cache_gib=0.003)
    start_blocks, start_slots = engine.allocator.blocks.num_free, engine.allocator.slots.num_free
    reqs = [Req(f"s{i}", [1 + i % 500], max_tokens=1 + i % 3) for i in range(1000)]

    steps = [0]

    def abort_now_and_then(engine):  # one running request every 10 steps
        steps[0] += 1
        assert steps[0] < 5_000
        if steps[0] % 10 == 0:
            victim = next((r for r in reqs if not r.finished and r.token_ids), None)
            if victim is not None:
                engine.abort(victim.request_id)

    run(engine, reqs, on_step=abort_now_and_then)
    assert sum(r.finished for r in reqs) >= 900
    assert_clean(engine)
    assert (engine.allocator.blocks.num_free, engine.allocator.slots.num_free) == (start_blocks, start_slots)

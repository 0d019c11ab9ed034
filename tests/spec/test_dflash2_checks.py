"""DFlash2 configuration checks before any weight loads (spec/engine.md §8 items 11-23, release note
0.1.3 "INT8 draft KV with DFlash2"), the engine's refusal once they pass, and the ladder in the
engine's lookahead."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest
import torch

from revolta.cache.capacity import MemoryBudget, plan_cache, CacheConfig
from revolta.config import ModelConfig
from revolta.engine import Engine, EngineConfig
from revolta.model import FlashNextModel, init_random_weights
from revolta.spec.config import SpeculativeConfig
from revolta.spec.dflash2.checks import check_dflash2
from revolta.weights import CheckpointError
from dflash2_fixtures import tiny_target, write_drafter
from test_engine import Req, ids
from test_engine import run as run_engine
from test_paged_model import TINY
from engine_spies import record_gaps

INT8_MESSAGE = ("int8 draft KV does not support sliding windows or sinks. Use a 16-bit draft cache beside the int8 "
                "target cache (speculative_config {'kv_cache_dtype': 'auto'} or 'float16'), or kv_cache_dtype "
                "'fp8_e4m3' / 'fp16' for both, or method 'mtp' with int8 KV")


def spec_for(drafter: str, **extra) -> SpeculativeConfig:
    return SpeculativeConfig.resolve({"method": "dflash2", "model": drafter, **extra}, has_mtp=False, env={})


def check(spec, kv="auto", **kw):
    return check_dflash2(spec, tiny_target(), kv_cache_dtype=kv, dtype=kw.pop("dtype", "float16"),
                         env=kw.pop("env", {}), **kw)


def test_int8_draft_kv_with_sliding_or_sink_layers_is_rejected(tmp_path):
    sliding = spec_for(write_drafter(tmp_path / "swa"))
    with pytest.raises(ValueError) as e:
        check(sliding, "int8")
    assert "2 sliding-window layers (window 64)" in str(e.value)
    assert "inherited from kv_cache_dtype='int8'" in str(e.value) and INT8_MESSAGE in str(e.value)
    sinks = spec_for(write_drafter(tmp_path / "sinks", layer_types=["full_attention"] * 3,
                                   dflash_config={"attention_sink_bias": True}))
    with pytest.raises(ValueError, match="has attention sinks, and its KV cache would be int8"):
        check(sinks, "int8")
    explicit = spec_for(str(tmp_path / "swa"), kv_cache_dtype="int8")
    with pytest.raises(ValueError, match=r"int8 \(speculative_config kv_cache_dtype\)"):
        check(explicit, "fp8_e4m3")


def test_working_alternatives_pass(tmp_path):
    drafter = write_drafter(tmp_path / "swa")
    # an int8 target with a separate 16-bit draft cache
    for draft in ("float16", "auto", "fp16"):
        spec = spec_for(drafter, kv_cache_dtype=draft)
        assert check(spec, "int8") == []
        group = spec.cache_fields("int8", "float16")["draft_kv_group"]
        assert group.kv_cache_dtype == "fp16"
        plan = plan_cache(tiny_target(), CacheConfig(max_model_len=256, kv_cache_dtype="int8", block_size=16,
                                                     **spec.cache_fields("int8", "float16")),
                          MemoryBudget(gpu_memory_bytes=2**26, gpu_memory_utilization=1.0, cudagraph_reserve_bytes=0,
                                       other_bytes=0))
        assert plan.layout.kv_cache_dtype == "int8" and not plan.layout.with_mtp
        assert plan.draft_kv_bytes_per_request == (64 * 2 + 256) * 2 * 2 * 16 * 2  # fp16 K+V, 2 heads x 16
    # 1-byte formats that work for both, and int8 for a drafter without sliding windows or sinks
    # revolta's drafter cache is 16-bit: an inherited 1-byte format gives a 16-bit drafter cache and a warning
    assert check(spec_for(drafter), "fp16") == []
    (warning,) = check(spec_for(drafter), "fp8_e4m3")
    assert "context K/V is kept at float16 beside the fp8_e4m3 target cache" in warning
    full = write_drafter(tmp_path / "full", layer_types=["full_attention"] * 3)
    (warning,) = check(spec_for(full), "int8")
    assert "beside the int8 target cache" in warning
    assert spec_for(full).cache_fields("int8", "float16")["draft_kv_group"].kv_cache_dtype == "fp16"
    with pytest.raises(ValueError, match="a int8 drafter cache is not implemented"):
        check(spec_for(full, kv_cache_dtype="int8"), "int8")


def test_pipeline_parallel_and_target_mismatch_are_rejected(tmp_path):
    spec = spec_for(write_drafter(tmp_path / "d"))
    with pytest.raises(ValueError, match="pipeline_parallel_size=2: DFlash2 does not support pipeline parallelism"):
        check(spec, pipeline_parallel_size=2)
    wide = spec_for(write_drafter(tmp_path / "wide", hidden_size=128))
    with pytest.raises(ValueError, match="hidden_size=128 but the target has 64"):
        check(wide)
    vocab = spec_for(write_drafter(tmp_path / "vocab", vocab_size=1000))
    with pytest.raises(ValueError, match="vocab_size=1000 but the target has 512"):
        check(vocab)
    layers = tiny_target().text.num_hidden_layers
    taps = spec_for(write_drafter(tmp_path / "taps", dflash_config={"target_layer_ids": [0, layers]},
                                  num_target_layers=None))
    with pytest.raises(ValueError, match=f"taps target layers \\[{layers}\\], outside this target's 0..{layers - 1}"):
        check(taps)
    with pytest.raises(ValueError, match=f"target_layer_ids \\[{layers}\\] do not exist in a target with {layers} layers"):
        spec_for(write_drafter(tmp_path / "taps2", dflash_config={"target_layer_ids": [0, layers]}))
    trained = spec_for(write_drafter(tmp_path / "trained", num_target_layers=layers + 1))
    with pytest.raises(ValueError, match=f"num_target_layers={layers + 1} layers but this target has {layers}"):
        check(trained)
    assert check(spec_for(write_drafter(tmp_path / "ok", num_target_layers=layers,
                                        dflash_config={"target_layer_ids": [0, layers - 1]}))) == []


def test_tail_graphs_and_probabilistic_drafting(tmp_path):
    drafter = write_drafter(tmp_path / "d")
    with pytest.raises(ValueError, match="VLLM_SM70_DFLASH2_TAIL_CUDAGRAPHS='1': revolta captures no"):
        check(spec_for(drafter), env={"VLLM_SM70_DFLASH2_TAIL_CUDAGRAPHS": "1"})
    assert check(spec_for(drafter), env={"VLLM_SM70_DFLASH2_TAIL_CUDAGRAPHS": "0"}) == []
    (warning,) = check(spec_for(drafter, draft_sample_method="probabilistic"))
    assert "'probabilistic' is not validated for this model" in warning and "lossless" in warning


@pytest.fixture(scope="module")
def tiny_model():
    m = FlashNextModel(ModelConfig.from_dict(TINY)).eval()
    init_random_weights(m, seed=5)
    return m


def test_engine_checks_and_plans_before_loading_the_drafter(tmp_path, tiny_model, caplog):
    drafter = write_drafter(tmp_path / "d")  # a config.json without weights
    cfg = dict(max_model_len=256, max_num_seqs=4, block_size=16, kv_cache_gib=0.004)
    with caplog.at_level(logging.INFO, logger="revolta.engine.engine"):
        with pytest.raises(CheckpointError, match="no model.safetensors.index.json or model.safetensors in"):
            Engine(tiny_model, EngineConfig(**cfg, speculative_config={"method": "dflash2", "model": drafter}))
    assert any("KV cache size" in r.message for r in caplog.records)  # planned (and logged) first
    # a failing check wins over loading
    with pytest.raises(ValueError, match="int8 draft KV does not support"):
        Engine(tiny_model, EngineConfig(**cfg, kv_cache_dtype="int8",
                                        speculative_config={"method": "dflash2", "model": drafter}))


def test_llm_checks_before_loading_weights(tmp_path, monkeypatch):
    import revolta.llm as llm

    def no_weights(*a, **k):
        raise AssertionError("weights were loaded before the DFlash2 configuration was refused")

    monkeypatch.setattr(llm, "load_model", no_weights)
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TINY))
    drafter = write_drafter(tmp_path / "d")
    dflash = {"method": "dflash2", "model": drafter}
    with pytest.raises(AssertionError, match="weights were loaded"):  # every check passed: loading starts
        llm.LLM(str(target), speculative_config=dflash)
    with pytest.raises(ValueError, match="int8 draft KV does not support"):
        llm.LLM(str(target), speculative_config=dflash, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="DFlash2 does not support pipeline parallelism"):
        llm.LLM(str(target), speculative_config=dflash, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="sm70_dflash2 fused_gdn_norm=True .config. has no effect in revolta"):
        llm.LLM(str(target), speculative_config={**dflash, "sm70_dflash2": {"fused_gdn_norm": True}})


@torch.no_grad()
def test_the_ladder_sets_the_lookahead(monkeypatch):
    """The engine's lookahead reads the ladder at the running count (here on the MTP path, the only
    drafter wired in): 1 draft while 2 or more requests run, all 4 when one is left."""
    model = FlashNextModel(ModelConfig.from_dict(dict(TINY, mtp_num_hidden_layers=1))).eval()
    init_random_weights(model, seed=11)
    cfg = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32, block_size=16, kv_cache_gib=0.004)
    prompts = [ids(5 + 4 * i, seed=i) for i in range(3)]
    plain = [Req(f"r{i}", p, max_tokens=4 + 6 * i) for i, p in enumerate(prompts)]
    base = Engine(model, EngineConfig(**cfg, speculative_config={"method": None}))
    record_gaps(base)
    run_engine(base, plain)
    engine = Engine(model, EngineConfig(**cfg, speculative_config={"method": "mtp", "num_speculative_tokens": 4}))
    engine.spec = replace(engine.spec, dflash_concurrency_drafts=((2, 1),))
    seen = []
    propose = engine.drafter.propose

    def record(items):
        seen.extend((len(engine.scheduler.running), it.num_drafts) for it in items if it.num_drafts)
        return propose(items)

    engine.drafter.propose = record
    reqs = [Req(r.request_id, r.prompt_token_ids, r.max_tokens) for r in plain]
    record_gaps(engine)
    run_engine(engine, reqs)
    assert [r.token_ids for r in reqs] == [r.token_ids for r in plain]
    assert seen and all(n == 1 for running, n in seen if running >= 2)
    assert any(n == 4 for running, n in seen if running == 1)

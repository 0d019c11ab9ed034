"""What a vLLM user meets first: wrong arguments fail before any weight is read with one error naming the fix, the
start-up summary says what was loaded and the size actually in force, and `detokenize=False` works (found by
acceptance testing as a vLLM user)."""

from __future__ import annotations

import json
import re

import pytest

import revolta.llm
from revolta import LLM, SamplingParams
from revolta.cache.capacity import CacheConfig, CacheConfigError, MemoryBudget, plan_cache
from revolta.cli import main
from revolta.engine import EngineConfig
from revolta.llm_config import model_origin
from revolta.presets.default import PRESET_MARKER, default_config
from test_llm import write_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"))


@pytest.fixture
def no_loading(monkeypatch):
    """Reading weights fails the test: the errors below must come before it."""
    def load(*args, **kwargs):
        raise AssertionError("weights were loaded before the argument was checked")

    monkeypatch.setattr(revolta.llm, "load_model", load)


@pytest.mark.parametrize("kwargs, says", [
    ({"max_model_len": "4096"}, "max_model_len='4096' must be an integer"),
    ({"seed": "a"}, "seed='a' must be an integer"),
    ({"quantization": "gptq"}, "quantization='gptq' does not match"),
    ({"quantization": "awq"}, "16-bit weights"),
    ({"kv_cache_gib": 0}, "kv_cache_gib=0 must be > 0"),
    ({"gpu_memory_utilization": 2.0}, r"gpu_memory_utilization=2.0 must be in \(0, 1\]"),
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching='no' must be True or False"),
    ({"enforce_eager": 1}, "enforce_eager=1 must be True or False"),
])
def test_bad_arguments_fail_before_loading(tiny_dir, no_loading, kwargs, says):
    with pytest.raises(ValueError, match=says):
        LLM(model=str(tiny_dir), **kwargs)


def test_a_cache_allowance_too_small_names_kv_cache_gib():
    """On the CPU (or with kv_cache_gib) the cache is a fixed allowance: the fix is kv_cache_gib, with the size that
    works, not GPU flags or "lower max_model_len to 0"."""
    cfg = default_config()
    cache = CacheConfig(max_model_len=1024, block_size=64, max_num_seqs=16)
    for gib in (0.002, 1e-6):
        budget = MemoryBudget(gpu_memory_bytes=int(gib * 2**30), gpu_memory_utilization=1.0, cudagraph_reserve_bytes=0,
                              other_bytes=0, allowance=f"kv_cache_gib={gib:g}")
        with pytest.raises(CacheConfigError) as e:
            plan_cache(cfg, cache, budget, dtype="float32")
        text = str(e.value)
        assert f"kv_cache_gib={gib:g}" in text and "gpu-memory-utilization" not in text and "0 or less" not in text
        need = float(text.split("raise kv_cache_gib to at least ")[1].split()[0])
        fits = MemoryBudget(gpu_memory_bytes=int(need * 2**30), gpu_memory_utilization=1.0, cudagraph_reserve_bytes=0,
                            other_bytes=0)
        assert plan_cache(cfg, cache, fits, dtype="float32").kv_cache_tokens >= 1024  # the size it names works


def test_engine_config_checks_its_switches():
    with pytest.raises(ValueError, match="kv_cache_gib=-1"):
        EngineConfig(max_model_len=64, kv_cache_gib=-1)
    assert EngineConfig(max_model_len=64, kv_cache_gib=0.25, enable_prefix_caching=False).kv_cache_gib == 0.25


def test_model_origin_names_the_preset(tmp_path):
    trained, random_ = tmp_path / "t", tmp_path / "r"
    for d, name in ((trained, "trained-default"), (random_, "default")):
        d.mkdir()
        (d / PRESET_MARKER).write_text(json.dumps({"preset": name}))
    assert "random weights" not in model_origin(trained, True) and "trained" in model_origin(trained, True)
    assert "random weights" in model_origin(random_, True)
    assert model_origin(tmp_path, False) == "checkpoint"


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(model=str(tiny_dir), speculative_config={"method": None})


def test_effective_config_shows_the_cpu_cache_allowance(llm):
    rows = {name: (value, source) for name, value, source in llm.effective_config()}
    assert rows["kv_cache_gib"] == (0.5, "default (the CPU allowance)")


def test_detokenize_off(llm):
    params = {"temperature": 0, "max_tokens": 6, "ignore_eos": True, "logprobs": 1}
    on = llm.generate("Hello", SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    off = llm.generate("Hello", SamplingParams(**params, detokenize=False), use_tqdm=False)[0].outputs[0]
    assert off.token_ids == on.token_ids and on.text and off.text == ""
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)


def test_sampling_params_as_a_dict_says_what_to_pass(llm):
    with pytest.raises(TypeError, match=r"got dict; build one with SamplingParams\(\*\*fields\)"):
        llm.generate("Hello", {"temperature": 0}, use_tqdm=False)


def test_cli_user_errors_come_before_loading(monkeypatch, capsys):
    monkeypatch.setattr(revolta.llm, "LLM", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["generate", ""]) == 2
    assert "empty" in capsys.readouterr().err
    assert main(["generate", "x", "--no-thinking"]) == 2  # a flag that would do nothing without --chat
    assert "--no-thinking needs --chat" in capsys.readouterr().err


def test_an_unwritable_preset_cache_names_revolta_cache(tmp_path):
    from revolta.presets.default import build_once

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="REVOLTA_CACHE to a writable directory") as e:
        build_once(blocker / "default-x", lambda d: pytest.fail("nothing is written"), "the embedded default model")
    assert str(blocker) in str(e.value)


@pytest.mark.parametrize("flags, says", [
    (["--max-model-len", "0"], "--max-model-len=0 must be >= 1"),
    (["--weights-gib", "-3"], "--weights-gib=-3.0 must be > 0"),
    (["--num-speculative-tokens", "9"], r"--num-speculative-tokens=9 must be in \[0, 8\]"),
])
def test_info_dry_run_refuses_out_of_range_flags(flags, says, capsys):
    assert main(["info", "tests/data/qwen3_8_flash_next_config.json", "--gpu-memory", "32", "--tp", "4", *flags]) == 2
    err = capsys.readouterr().err
    assert re.search(says, err) and "Traceback" not in err


def test_chat_template_kwargs_may_carry_enable_thinking(llm):
    """vLLM's (and Qwen3's documented) way to turn thinking off is chat_template_kwargs={"enable_thinking": False}."""
    m = [{"role": "user", "content": "hi"}]
    params = SamplingParams(temperature=0, max_tokens=2)
    off = llm.chat(m, params, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})[0]
    assert off.prompt == llm.render_chat(m, enable_thinking=False) != llm.render_chat(m)


def test_largest_seed_and_its_siblings_sample(llm):
    """The largest int64 seed and its n > 1 siblings (seed + i, past int64: wrapped as torch's generator takes it)
    sample reproducibly; they raised 'Overflow when unpacking long long' mid-generate."""
    params = SamplingParams(temperature=1.0, seed=2**63 - 1, n=2, max_tokens=3, ignore_eos=True)
    a, b = (llm.generate("Hello", params, use_tqdm=False)[0] for _ in range(2))
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len(a.outputs[1].token_ids) == 3

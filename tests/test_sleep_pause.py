"""LLM.sleep / wake_up and LLM.pause / resume on CPU (the "device" is the CPU).

Every path must give back bitwise the greedy tokens of an engine that never slept or paused; sleep must
really free the weight and KV storages (level 1 through a host copy, level 2 by a reload from the
checkpoint files); a refused preflight must leave the engine and its requests untouched. The level 1/2
round trip runs on the embedded default (its checkpoint is on disk); the request-level modes run on the
tiny random checkpoint with an MTP head (also on disk, and much faster to step).
"""

from __future__ import annotations

import pytest
import torch

from revolta import LLM, SamplingParams
from revolta.engine.sleep import EngineAsleepError, SleepRefused
from test_llm import write_tiny_checkpoint

PROMPTS = ["Hello there", "The capital of France is"]
PARAMS = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def default_llm():
    return LLM(seed=0, kv_cache_gib=0.05, max_model_len=256)  # the embedded default


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_mtp"), with_mtp=True)
    return LLM(model=str(path), seed=0, kv_cache_gib=0.02, max_model_len=320, block_size=64)


@pytest.fixture(scope="module")
def reference(llm):
    return greedy(llm)


def greedy(llm, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def finish(llm, rid):
    """Step until request `rid` finishes; its last output."""
    last = None
    for _ in range(100):
        last = next((o for o in llm.step() if o.request_id == rid), last)
        if last is not None and last.finished:
            return last
    raise AssertionError(f"request {rid} did not finish in 100 steps")


def storage_bytes(tensors):
    return sum(t.untyped_storage().nbytes() for t in tensors)


def test_sleep_levels_free_memory_and_wake_to_identical_outputs(default_llm):
    llm = default_llm
    reference = greedy(llm, PROMPTS[:1])
    params = list(llm.model.parameters())
    kv = llm.engine.storage.block_tensors() + llm.engine.storage.slot_tensors()
    weight = llm.model.lm_head.weight
    saved = weight.detach().clone()
    for level in (1, 2):
        with torch.no_grad():
            weight.add_(1.0)  # level 1 must bring these bytes back; level 2 must read the checkpoint's instead
        llm.sleep(level=level)
        assert llm.is_sleeping()
        assert storage_bytes(params) == 0 and storage_bytes(kv) == 0
        backups = [h.backup for h in llm.engine.executor._asleep.held if h.backup is not None]
        if level == 1:  # every weight byte went to a separate host buffer
            assert sum(b.numel() for b in backups) >= sum(p.numel() * p.element_size() for p in params)
        else:  # the parameters were dropped without a copy (buffers may still be kept)
            assert sum(b.numel() for b in backups) < weight.numel() * weight.element_size()
        with pytest.raises(EngineAsleepError, match="wake_up"):
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        llm.wake_up()
        assert not llm.is_sleeping() and storage_bytes(kv) > 0
        if level == 1:
            assert torch.equal(weight, saved + 1.0)
            with torch.no_grad():
                weight.copy_(saved)
        else:
            assert torch.equal(weight, saved)
        assert greedy(llm, PROMPTS[:1]) == reference, level


@pytest.mark.parametrize("mode", ["abort", "wait"])
def test_sleep_with_a_request_in_flight(llm, reference, mode):
    rid = llm.add_request(PROMPTS[0], PARAMS)
    llm.step()  # the prefill: one token of five
    outputs = llm.sleep(level=1 if mode == "abort" else 2, mode=mode)
    (out,) = [o for o in outputs if o.finished and o.request_id == rid]
    tokens = out.outputs[0].token_ids
    if mode == "abort":
        assert out.outputs[0].finish_reason == "abort"
        assert 0 < len(tokens) < len(reference[0]) and tokens == reference[0][:len(tokens)]
    else:
        assert tokens == reference[0]
    assert not llm.has_unfinished_requests()
    llm.wake_up()
    assert greedy(llm) == reference


def test_refused_preflight_leaves_the_engine_serving(llm, reference, monkeypatch):
    rid = llm.add_request(PROMPTS[0], PARAMS)
    llm.step()
    monkeypatch.setattr(llm.engine, "host_memory", lambda: 64 << 20)  # a host with 64 MiB available
    with pytest.raises(SleepRefused, match="host memory"):
        llm.sleep(level=1)
    assert not llm.is_sleeping() and llm.has_unfinished_requests()
    assert storage_bytes(llm.model.parameters()) > 0
    assert finish(llm, rid).outputs[0].token_ids == reference[0]  # the request in flight carried on
    monkeypatch.setattr(llm.model, "checkpoint_dir", llm.model.checkpoint_dir / "gone")
    with pytest.raises(SleepRefused, match="cannot be read"):
        llm.sleep(level=2)
    monkeypatch.undo()
    assert greedy(llm) == reference


def test_sleep_level_0_and_bad_arguments(llm, reference):
    with pytest.raises(ValueError, match="sleep level 3"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="keep"):
        llm.sleep(level=1, mode="keep")
    llm.sleep(level=0)  # frees nothing; still refuses requests until wake_up
    assert llm.is_sleeping() and storage_bytes(llm.model.parameters()) > 0
    with pytest.raises(EngineAsleepError):
        llm.add_request(PROMPTS[0], PARAMS)
    llm.wake_up()
    assert greedy(llm) == reference


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_pause_modes(llm, reference, mode):
    rid = llm.add_request(PROMPTS[0], PARAMS)
    llm.step()  # the prefill: one token of five
    outputs = llm.pause(mode=mode, clear_cache=mode != "keep")
    assert llm.is_paused()
    late = llm.add_request(PROMPTS[1], PARAMS)  # accepted while paused; waits for resume
    with pytest.raises(RuntimeError, match="paused"):
        llm.step()
    llm.resume()
    if mode == "keep":
        assert outputs == []
        assert finish(llm, rid).outputs[0].token_ids == reference[0]  # continued where it stood
    else:
        (out,) = [o for o in outputs if o.finished and o.request_id == rid]
        tokens = out.outputs[0].token_ids
        assert tokens == reference[0] if mode == "wait" else tokens == reference[0][:len(tokens)]
    assert finish(llm, late).outputs[0].token_ids == reference[1]
    assert not llm.has_unfinished_requests()


@pytest.mark.parametrize("clear_cache", [True, False])
def test_pause_clears_or_keeps_the_prefix_cache(llm, clear_cache):
    prompt = {"prompt_token_ids": list(range(1000, 1000 + 3 * llm.engine.allocator.block_size))}
    first = llm.generate(prompt, PARAMS, use_tqdm=False)[0]
    assert llm.engine.allocator.blocks.cached  # the prompt's full blocks are cached
    llm.pause(clear_cache=clear_cache)
    assert bool(llm.engine.allocator.blocks.cached) is not clear_cache
    llm.resume()
    again = llm.generate(prompt, PARAMS, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert (again.num_cached_tokens > 0) is not clear_cache


@pytest.fixture(scope="module")
def async_llm(llm):
    """The same checkpoint without speculation and with async_scheduling: greedy tokens equal `reference`."""
    return LLM(model=str(llm.model_path), seed=0, kv_cache_gib=0.02, max_model_len=320, block_size=64,
               speculative_config={"method": None}, async_scheduling=True)


def launch_ahead(llm) -> str:
    """A request past its prefill with its next decode step launched and not yet read (async scheduling)."""
    rid = llm.add_request(PROMPTS[0], PARAMS)
    llm.step()  # the prefill
    llm.step()  # a decode step launched ahead
    assert llm.engine._inflight is not None and llm.engine._inflight.row_of(rid) is not None
    return rid


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_pause_with_a_step_in_flight(async_llm, reference, mode):
    rid = launch_ahead(async_llm)
    outputs = async_llm.pause(mode=mode, clear_cache=mode != "keep")
    with pytest.raises(RuntimeError, match="paused"):
        async_llm.step()
    async_llm.resume()
    if mode == "keep":
        assert outputs == [] and finish(async_llm, rid).outputs[0].token_ids == reference[0]
    else:
        (out,) = [o for o in outputs if o.finished and o.request_id == rid]
        tokens = out.outputs[0].token_ids
        assert tokens == reference[0] if mode == "wait" else tokens == reference[0][:len(tokens)]
    assert greedy(async_llm) == reference  # the engine serves on, nothing left behind
    assert async_llm.engine.num_chained_steps > 0


@pytest.mark.parametrize("mode", ["abort", "wait"])
def test_sleep_with_a_step_in_flight(async_llm, reference, mode):
    rid = launch_ahead(async_llm)
    outputs = async_llm.sleep(level=1, mode=mode)
    (out,) = [o for o in outputs if o.finished and o.request_id == rid]
    tokens = out.outputs[0].token_ids
    assert tokens == reference[0] if mode == "wait" else tokens == reference[0][:len(tokens)]
    assert async_llm.engine._inflight is None
    async_llm.wake_up()
    assert greedy(async_llm) == reference

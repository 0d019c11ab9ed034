"""LLM with speculative decoding (MTP4, the default for a checkpoint with an MTP layer): the
behaviours of test_llm.py hold with speculation on exactly as with it off, acceptance
statistics reach the outputs, and a draft cache format that cannot work is refused."""

from __future__ import annotations

import logging

import pytest

from revolta import LLM, SamplingParams
from test_llm import PROMPTS, write_tiny_checkpoint

OFF = {"method": None}


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_mtp_ckpt"), with_mtp=True)


@pytest.fixture(scope="module")
def spec(mtp_dir):
    return LLM(model=str(mtp_dir), seed=0)  # no speculative_config: MTP4


@pytest.fixture(scope="module")
def plain(mtp_dir):
    return LLM(model=str(mtp_dir), seed=0, speculative_config=OFF)


def force_target_drafts(llm, continuations):
    """Drafts = the target's own greedy continuation (every draft accepted); the MTP head still runs."""
    propose = llm.engine.drafter.propose

    def forced(items):
        out = propose(items)
        for it, d in zip(items, out):
            full = next(c for c in continuations if c[:len(it.all_token_ids)] == it.all_token_ids)
            new = full[len(it.all_token_ids):len(it.all_token_ids) + it.num_drafts]
            d[:] = new + [0] * (it.num_drafts - len(new))
        return out

    llm.engine.drafter.propose = forced
    return lambda: setattr(llm.engine.drafter, "propose", propose)


def same(a, b):
    for x, y in zip(a, b):
        for cx, cy in zip(x.outputs, y.outputs):
            assert (cx.token_ids, cx.text, cx.finish_reason, cx.stop_reason) == \
                (cy.token_ids, cy.text, cy.finish_reason, cy.stop_reason)
            if cx.logprobs is not None:
                assert cx.cumulative_logprob == pytest.approx(cy.cumulative_logprob, abs=1e-5)
                for px, py in zip(cx.logprobs, cy.logprobs):
                    assert px.keys() == py.keys()


def test_mtp4_is_the_default_and_off_turns_it_off(spec, plain, mtp_dir, caplog):
    assert spec.speculative_config.enabled and spec.speculative_config.num_speculative_tokens == 4
    assert spec.model.mtp is not None and spec.engine.plan.layout.with_mtp
    assert not plain.speculative_config.enabled and plain.model.mtp is None
    with caplog.at_level(logging.INFO, logger="revolta"):
        LLM(model=str(mtp_dir), speculative_config={"method": "mtp", "num_speculative_tokens": 2,
                                                    "spec_state_replay": True})
    assert "MTP x2 (replay" in caplog.text


def test_greedy_batch_with_logprobs_equals_no_spec(spec, plain):
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    a, b = spec.generate(PROMPTS, params, use_tqdm=False), plain.generate(PROMPTS, params, use_tqdm=False)
    same(a, b)
    st = a[0].metrics.spec_decode
    assert st is not None and st.num_rounds > 0 and st.num_draft_tokens > 0
    assert st.acceptance_length is not None and len(st.per_position_rates) == 4
    assert b[0].metrics.spec_decode is None


def test_eos_and_stops_inside_accepted_drafts_end_where_decoding_would(spec, plain):
    prompt = PROMPTS[1]
    free = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    ids = free.outputs[0].token_ids
    k = next(i for i in range(4, len(ids)) if ids[i] not in ids[:i])  # first occurrence at i >= 4
    text = free.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cases = [SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[ids[k]]),
             SamplingParams(temperature=0, max_tokens=10, stop=[stop], include_stop_str_in_output=True),
             SamplingParams(temperature=0, max_tokens=5),
             SamplingParams(temperature=0, max_tokens=10, frequency_penalty=1.5, min_tokens=3)]
    restore = force_target_drafts(spec, [free.prompt_token_ids + ids])
    try:
        for params in cases[:3]:
            a = spec.generate(prompt, params, use_tqdm=False)
            same(a, plain.generate(prompt, params, use_tqdm=False))
            assert a[0].metrics.spec_decode.num_accepted_tokens > 0  # the stop came inside accepted drafts
    finally:
        restore()
    same(spec.generate(prompt, cases[3], use_tqdm=False), plain.generate(prompt, cases[3], use_tqdm=False))
    assert spec.engine.allocator.usage == 0.0


def test_seeded_sampling_and_n_completions(spec):
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=8, n=2)
    a = spec.generate(PROMPTS[0], params, use_tqdm=False)
    b = spec.generate(PROMPTS[0], params, use_tqdm=False)
    same(a, b)
    assert len(a[0].outputs) == 2 and a[0].outputs[0].token_ids != a[0].outputs[1].token_ids


def test_seeded_sampling_equals_no_spec(mtp_dir, plain):
    """A seeded sampled request gives the tokens decoding without drafts gives: drafting (which the adaptive
    policy turns on and off by timing) must not change what a seed produces."""
    always = LLM(model=str(mtp_dir), seed=0, speculative_config={"method": "mtp", "draft_policy": "always"})
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=12, n=2, ignore_eos=True)
    a = always.generate(PROMPTS[:2], params, use_tqdm=False)
    same(a, plain.generate(PROMPTS[:2], params, use_tqdm=False))
    assert a[0].metrics.spec_decode.num_rounds > 0


def test_fp8_draft_cache_without_calibrated_scales_is_refused(mtp_dir):
    with pytest.raises(ValueError, match="no calibrated draft K/V scales"):
        LLM(model=str(mtp_dir), kv_cache_dtype="fp8_e4m3")
    llm = LLM(model=str(mtp_dir), kv_cache_dtype="fp8_e4m3", speculative_config={"kv_cache_dtype": "auto"})
    assert llm.engine.plan.layout.draft_kv_cache_dtype == "fp32"

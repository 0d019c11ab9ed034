"""A seeded sampled request gives the same tokens whether speculative decoding drafts or not (spec/server.md B8:
`seed=123, temperature=0.8` twice gives identical text). The default deployment drafts with MTP4 only while it
pays (adaptive), so whether a request's tokens come from plain decoding or from a verify round depends on the
traffic before it: verification must draw the request's randomness exactly as plain decoding does."""

from __future__ import annotations

from revolta import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):", "import os\n"]


def test_seeded_sampling_is_the_same_with_and_without_drafting():
    params = [SamplingParams(temperature=0.8, seed=seed, max_tokens=24, ignore_eos=True) for seed in (0, 123)]
    always = {"method": "mtp", "num_speculative_tokens": 4, "draft_policy": "always"}
    drafting = LLM(max_model_len=256, speculative_config=always).generate(PROMPTS, params, use_tqdm=False)
    plain = LLM(max_model_len=256, speculative_config={"method": None}).generate(PROMPTS, params, use_tqdm=False)
    for d, p in zip(drafting, plain):
        assert d.outputs[0].token_ids == p.outputs[0].token_ids

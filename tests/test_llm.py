"""SamplingParams, the Sampler, and LLM.generate on a tiny random checkpoint with the real tokenizer."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch

from revolta import LLM, SamplingParams, load_model
from revolta.config import ModelConfig
from revolta.model import FlashNextModel, init_random_weights
from revolta.presets.default import DEFAULT_CONFIG
from revolta.progress import GenerationBar
from revolta.engine.sampling import Sampler, make_generator
from revolta.tokenizer import write_qwen_tokenizer_dir
from revolta.weights import save_checkpoint

PROMPTS = ["Hello, my name is", "The capital of France is Paris, and the capital of Germany is",
           {"prompt_token_ids": [9707, 11, 1879]}]
GREEDY = SamplingParams(temperature=0, max_tokens=16)


# ---- SamplingParams -----------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("top_k", 1.5), ("min_p", -0.1), ("min_p", 1.1), ("seed", "x"), ("max_tokens", 0),
    ("logprobs", -1), ("logprobs", 21), ("stop", 3), ("stop", ["a", 1]), ("stop_token_ids", [-1]),
    ("stop_token_ids", "abc"),
])  # fmt: skip
def test_sampling_params_rejects(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**{field: value})


def test_sampling_params_normalises():
    p = SamplingParams(stop="END", stop_token_ids=[5, 7], top_k=-1, max_tokens=None)
    assert p.stop_strings == ("END",) and p.stop_token_ids == (5, 7)
    assert SamplingParams(stop=["a", "", "b"]).stop_strings == ("a", "b")
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    with pytest.raises(ValueError, match="n=0"):
        SamplingParams(n=0)


# ---- Sampler --------------------------------------------------------------------------------------

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


@pytest.mark.parametrize("kwargs,expected", [
    ({}, [0.5, 0.3, 0.15, 0.05]),
    ({"top_k": 3}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
    ({"top_k": 1}, [1.0, 0.0, 0.0, 0.0]),
    ({"top_p": 0.8}, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
    ({"top_p": 0.81}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
    ({"top_k": 2, "top_p": 0.5}, [1.0, 0.0, 0.0, 0.0]),
    ({"min_p": 0.35}, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
    ({"temperature": 0.5}, (PROBS**2 / (PROBS**2).sum()).tolist()),
])  # fmt: skip
def test_sampler_distribution(kwargs, expected):
    logits = PROBS.log()[None].repeat(2, 1)
    # row 1 is a plain row: its distribution must not be touched by row 0's filters
    probs = Sampler.probs(logits, [SamplingParams(**kwargs), SamplingParams()])
    probs = probs / probs.sum(-1, keepdim=True)
    torch.testing.assert_close(probs[0], torch.tensor(expected), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(probs[1], PROBS, atol=1e-6, rtol=1e-5)


def test_sampler_greedy_and_frequencies():
    sampler = Sampler()
    logits = torch.tensor([[0.1, 2.0, 0.3, -1.0]])
    assert sampler(logits, [SamplingParams(temperature=0)], [None]).tolist() == [1]
    gen = make_generator(0)
    draws = [sampler(PROBS.log()[None], [SamplingParams(top_k=3)], [gen]).item() for _ in range(3000)]
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95, atol=0.03, rtol=0)
    assert freq[3] == 0


def test_sampler_seed_is_independent_of_batch():
    sampler = Sampler()
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    seeded = SamplingParams(temperature=1.0, seed=7)
    alone = [sampler(logits[1:2], [seeded], [make_generator(7)]).item() for _ in range(1)]
    gens = [make_generator(1), make_generator(7), make_generator(2)]
    params = [SamplingParams(top_k=5), seeded, SamplingParams(temperature=0)]
    batched = sampler(logits, params, gens)
    assert batched[1].item() == alone[0]
    assert batched[2].item() == logits[2].argmax().item()
    # a generator's draws continue: two steps from one seed reproduce two steps from the same seed
    g1, g2 = make_generator(3), make_generator(3)
    a = [sampler(logits[:1], [seeded], [g1]).item() for _ in range(5)]
    b = [sampler(logits[:1], [seeded], [g2]).item() for _ in range(5)]
    assert a == b and len(set(a)) > 1


# ---- LLM on a tiny random checkpoint --------------------------------------------------------------

def tiny_config(with_mtp: bool = False) -> ModelConfig:
    raw = copy.deepcopy(DEFAULT_CONFIG)
    raw.pop("vision_config")
    t = raw["text_config"]
    if not with_mtp:
        for key in ("mtp", "mtp_num_hidden_layers"):
            t.pop(key)
    t.update(hidden_size=64, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
             linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=32, shared_expert_intermediate_size=32, hc_lowrank=8, ple_embed_dim=64,
             ngram_vocab_size_base=97, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=1,
             indexer_head_dim=16, indexer_budget=8)  # sparse from position 11: generation crosses it
    t["rope_parameters"]["mrope_section"] = [2, 1, 1]
    return ModelConfig.from_dict(raw)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"))


def write_tiny_checkpoint(path, with_mtp: bool = False):
    """The tiny random model with the real tokenizer as a checkpoint directory (with its MTP layer on request)."""
    cfg = tiny_config(with_mtp)
    with torch.device("meta"):
        model = FlashNextModel(cfg)
    model.to_empty(device="cpu").init_buffers()
    init_random_weights(model, seed=1)
    save_checkpoint(model.to_dtype(torch.bfloat16), path, progress=False)
    cfg.save(path)
    write_qwen_tokenizer_dir(path)
    return path


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(model=str(tiny_dir), seed=0)


def _greedy(llm, prompt, **kwargs):
    params = SamplingParams(**{"temperature": 0, "max_tokens": 16, **kwargs})
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


def test_batch_equals_single(llm):
    batch = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in batch] == [PROMPTS[0], PROMPTS[1], None]
    for prompt, out in zip(PROMPTS, batch):
        alone = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        assert alone.outputs[0].text == out.outputs[0].text
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 16
        assert out.finished and out.outputs[0].text


def test_prompt_forms(llm):
    ids = llm.tokenizer.encode(PROMPTS[0])
    a = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0]
    b = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    c = llm.generate({"prompt": PROMPTS[0]}, GREEDY, use_tqdm=False)[0]
    assert a.prompt_token_ids == b.prompt_token_ids == c.prompt_token_ids == ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    assert b.prompt is None and a.prompt == PROMPTS[0]
    assert a.metrics.time_to_first_token > 0 and a.metrics.tokens_per_s > 0


def test_greedy_matches_full_forward(llm, tiny_dir):
    # the incremental path's first token is the argmax of the uncached [B, S] forward
    model = load_model(tiny_dir, progress=False)
    ids = llm.tokenizer.encode(PROMPTS[1])
    out = _greedy(llm, PROMPTS[1], max_tokens=4)
    full = torch.tensor([ids + out.token_ids[:3]])
    with torch.inference_mode():
        logits = model(full)
    assert logits.shape == (1, full.shape[1], llm.cfg.text.vocab_size)
    text_vocab = llm.tokenizer.vocab_size
    assert logits[0, len(ids) - 1:, :text_vocab].argmax(-1).tolist() == out.token_ids


def test_max_tokens_and_length(llm):
    out = _greedy(llm, PROMPTS[0], max_tokens=5)
    assert len(out.token_ids) == 5 and out.finish_reason == "length" and out.stop_reason is None
    short = LLM(model=str(llm.model_path), max_model_len=len(llm.tokenizer.encode(PROMPTS[0])) + 3)
    out = short.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=50), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_generate_bar_moves_every_step(llm, monkeypatch, capsys):
    ref = _greedy(llm, PROMPTS[0]).token_ids
    seen, update = [], GenerationBar.update

    def spy(bar, changed):
        update(bar, changed)
        seen.append((bar.n, bar.total, bar.generated))

    monkeypatch.setattr(GenerationBar, "update", spy)
    params = [SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[ref[4]]), GREEDY]
    outs = llm.generate(PROMPTS[:2], params, use_tqdm=True)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated < 32 and len(seen) >= 16  # one update per step; the first prompt stops early
    assert seen[0][0] > 0  # moved at the first step (a bar over sequences read 0/2 until one finished)
    assert all(a[0] < b[0] for a, b in zip(seen, seen[1:]))
    assert seen[-1] == (32, 32, generated)  # the early stop handed its unused budget back: the bar ends full
    err = capsys.readouterr().err
    assert f"{generated} tokens" in err and "tok/s" in err and "2/2 done" in err


def test_stop_token_ids(llm):
    ref = _greedy(llm, PROMPTS[0]).token_ids
    stop_id = ref[4]
    out = _greedy(llm, PROMPTS[0], stop_token_ids=[stop_id])
    cut = ref.index(stop_id) + 1
    assert out.token_ids == ref[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_eos_and_ignore_eos(llm):
    ref = _greedy(llm, PROMPTS[0]).token_ids
    saved = llm.eos_token_ids
    llm.eos_token_ids = frozenset({ref[3]})  # pretend the model's 4th token is end-of-sequence
    try:
        out = _greedy(llm, PROMPTS[0])
        assert out.token_ids == ref[: ref.index(ref[3]) + 1]
        assert out.finish_reason == "stop" and out.stop_reason is None
        out = _greedy(llm, PROMPTS[0], ignore_eos=True)
        assert out.token_ids == ref and out.finish_reason == "length"
    finally:
        llm.eos_token_ids = saved
    assert {248044, 248046} <= llm.eos_token_ids


def test_stop_strings(llm):
    full = _greedy(llm, PROMPTS[1], max_tokens=24)
    text = full.text
    assert len(text) > 12
    stop = text[8:11]
    expected = text[: text.find(stop)]
    out = _greedy(llm, PROMPTS[1], max_tokens=24, stop=["never-there", stop])
    assert out.text == expected
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == full.token_ids[: len(out.token_ids)] and len(out.token_ids) < 24
    kept = _greedy(llm, PROMPTS[1], max_tokens=24, stop=stop, include_stop_str_in_output=True)
    assert kept.text == expected + stop


def test_async_scheduling_gives_the_synchronous_outputs(llm, tiny_dir):
    """LLM(async_scheduling=True): a stop string (detokenized while the next step is already launched), plain greedy
    and seeded sampling give the synchronous engine's outputs; the startup summary names the setting."""
    full = _greedy(llm, PROMPTS[1], max_tokens=24)
    stop = full.text[8:11]
    params = [SamplingParams(temperature=0, max_tokens=24, stop=[stop]), SamplingParams(temperature=0, max_tokens=20),
              SamplingParams(temperature=1.0, top_k=50, seed=123, max_tokens=16)]
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[2]]
    fast = LLM(model=str(tiny_dir), seed=0, async_scheduling=True)

    def seen(outs):
        return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in (o.outputs[0] for o in outs)]

    expected = seen(llm.generate(prompts, params, use_tqdm=False))
    assert seen(fast.generate(prompts, params, use_tqdm=False)) == expected
    assert expected[0][3] == stop and len(expected[0][0]) < 24
    assert fast.engine.num_chained_steps >= 5
    assert ("async_scheduling", True, "argument") in fast.effective_config()
    assert ("async_scheduling", False, "default") in llm.effective_config()


def test_seeded_sampling(llm):
    params = SamplingParams(temperature=1.0, top_k=50, seed=123, max_tokens=10)
    alone = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.9, max_tokens=6)
    batch = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [others, params, GREEDY], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    different = SamplingParams(temperature=1.0, top_k=50, seed=124, max_tokens=10)
    assert llm.generate(PROMPTS[0], different, use_tqdm=False)[0].outputs[0].token_ids != alone
    # unseeded requests draw their seeds from LLM(seed=...): a fresh LLM reproduces the run
    unseeded = SamplingParams(temperature=1.0, max_tokens=6)
    a = LLM(model=str(llm.model_path), seed=5).generate(PROMPTS[:2], unseeded, use_tqdm=False)
    b = LLM(model=str(llm.model_path), seed=5).generate(PROMPTS[:2], unseeded, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_logprobs(llm):
    out = _greedy(llm, PROMPTS[0], max_tokens=4, logprobs=3)
    assert len(out.logprobs) == 4
    total = 0.0
    for token_id, entry in zip(out.token_ids, out.logprobs):
        assert entry[token_id].rank == 1  # greedy picks the most likely token
        assert len(entry) == 3 and sorted(lp.rank for lp in entry.values()) == [1, 2, 3]
        total += entry[token_id].logprob
    assert math.isclose(out.cumulative_logprob, total, rel_tol=1e-6)
    assert _greedy(llm, PROMPTS[0], max_tokens=2).logprobs is None


def test_num_cached_tokens_is_the_prefix_hit_of_the_first_admission(tiny_dir):
    llm = LLM(model=str(tiny_dir), block_size=16)
    ids = llm.tokenizer.encode(" ".join(f"w{i}" for i in range(40)))
    params = SamplingParams(temperature=0, max_tokens=2)
    first, second = (llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == 0
    # whole blocks, up to the last boundary before the final prompt token (the hybrid cache's snapshot point)
    assert second.num_cached_tokens == (len(ids) - 1) // 16 * 16 > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_prompt_logprobs_match_the_full_forward(tiny_dir):
    # a small token budget splits the prompt into chunks; the second run would hit the prefix cache
    # if prompt-logprob requests did not compute their whole prompt
    llm = LLM(model=str(tiny_dir), max_num_batched_tokens=8)
    model = load_model(tiny_dir, progress=False)
    ids = llm.tokenizer.encode("one two three four five six seven eight nine ten eleven twelve")
    with torch.inference_mode():
        ref = model(torch.tensor([ids]))[0, :, : llm.tokenizer.vocab_size].log_softmax(-1)  # [S, V]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    for _ in range(2):
        out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
            lp = entry[ids[i]]
            assert abs(lp.logprob - ref[i - 1, ids[i]].item()) < 1e-4
            # the engine's logits differ from the full forward by ~1e-5 (chunked prefill), so a rank is exact
            # only up to the tokens whose reference logprob lies within that tolerance of this one
            target = ref[i - 1, ids[i]]
            lo, hi = int((ref[i - 1] > target + 1e-4).sum()) + 1, int((ref[i - 1] > target - 1e-4).sum()) + 1
            assert lo <= lp.rank <= hi
            assert {1, 2} <= {v.rank for v in entry.values()} and len(entry) in (2, 3)
    assert llm.engine.allocator.stats.hit_tokens == 0
    plain = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == out.outputs[0].token_ids
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


def test_startup_summary_names_each_setting_and_its_source(tiny_dir, monkeypatch, caplog):
    monkeypatch.setenv("REVOLTA_CUDAGRAPH_MEM_MIB", "512")
    with caplog.at_level(logging.INFO, logger="revolta.llm"):
        llm = LLM(model=str(tiny_dir), max_num_seqs=3, enforce_eager=True)
    rows = {name: (value, source) for name, value, source in llm.effective_config()}
    assert rows["max_num_seqs"] == (3, "argument") and rows["enforce_eager"] == (True, "argument")
    assert rows["max_num_batched_tokens"] == (8192, "default")
    assert rows["cudagraph_mem_mib"] == (512.0, "environment (REVOLTA_CUDAGRAPH_MEM_MIB)")
    assert rows["max_model_len"][1].startswith("checkpoint")
    assert "effective configuration" in caplog.text and "max_num_batched_tokens" in caplog.text
    monkeypatch.setenv("REVOLTA_CUDAGRAPH_MEM_MIB", "lots")
    with pytest.raises(ValueError, match="REVOLTA_CUDAGRAPH_MEM_MIB"):
        LLM(model=str(tiny_dir))
    monkeypatch.delenv("REVOLTA_CUDAGRAPH_MEM_MIB")
    with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
        LLM(model=str(tiny_dir), cudagraph_capture_sizes=[0, 2])
    assert rows["dflash2_graph_rounds"] == (False, "default (no CUDA graphs here)")  # on where graphs run
    assert rows["dflash2_draft_graph"] == (False, "default (no CUDA graphs here)")
    # the DFlash2 graph options reach the EngineConfig, which refuses them where no CUDA graphs run (the CPU)
    with pytest.raises(ValueError, match="dflash2_graph_rounds=True needs CUDA graphs"):
        LLM(model=str(tiny_dir), dflash2_graph_rounds=True)
    # the start-up warm-up (engine/warmup.py): off with the CPU's torch kernels unless asked for
    assert rows["warmup"] == ("off", "default (off with the torch kernels)")
    warm = LLM(model=str(tiny_dir), max_num_seqs=3, warmup=True)
    value, source = {n: (v, s) for n, v, s in warm.effective_config()}["warmup"]
    k = warm.engine.spec.drafts_at(1) if warm.engine.spec.enabled else 0
    assert source == "argument" and value.startswith(f"{k + 1} request") and warm.warmup.requests == k + 1
    assert not warm.engine.has_unfinished() and warm.engine.spec_stats.num_rounds == 0
    with pytest.raises(ValueError, match="warmup='yes' must be True or False"):
        LLM(model=str(tiny_dir), warmup="yes")


def test_stream_and_chat(llm):
    params = SamplingParams(temperature=0, max_tokens=8)
    final = None
    seen = 0
    for out in llm.stream(PROMPTS[0], params):
        assert len(out.outputs[0].text) >= seen
        seen, final = len(out.outputs[0].text), out
    assert final.finished
    assert final.outputs[0].text == llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].text
    chat = llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)[0]
    assert chat.prompt.startswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert len(chat.outputs[0].token_ids) == 8
    two = llm.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]], params, use_tqdm=False)
    assert len(two) == 2


def test_chat_continues_the_final_message(llm):
    """continue_final_message: the prompt ends inside the assistant's text and the output is what generate gives
    for that open prompt (vLLM's LLM.chat); both flags true, or a last message not the assistant's, raise."""
    params = SamplingParams(temperature=0, max_tokens=4)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello,"}]
    out = llm.chat(messages, params, use_tqdm=False, continue_final_message=True)[0]
    assert out.prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello,"
    assert out.outputs[0].token_ids == llm.generate(out.prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    closed = llm.chat(messages, params, use_tqdm=False, add_generation_prompt=False)[0]
    assert closed.prompt == out.prompt + "<|im_end|>\n"
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(messages, params, continue_final_message=True, add_generation_prompt=True)
    with pytest.raises(ValueError, match="must be the assistant's"):
        llm.chat(messages[:1], params, continue_final_message=True)


def test_default_sampling_params_from_generation_config(llm, tiny_dir):
    assert llm.get_default_sampling_params() == SamplingParams()  # tiny checkpoint has no generation_config.json
    llm.generation_config = {"temperature": 0.6, "top_k": 20, "do_sample": True, "max_new_tokens": 9}
    try:
        p = llm.get_default_sampling_params()
        assert (p.temperature, p.top_k, p.max_tokens) == (0.6, 20, 9)
    finally:
        llm.generation_config = {}


def test_errors(llm, tiny_dir):
    with pytest.raises(TypeError, match="max_num_seq.*did you mean 'max_num_seqs'"):
        LLM(model=str(tiny_dir), max_num_seq=4)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2: only 1 is supported"):
        LLM(model=str(tiny_dir), pipeline_parallel_size=2)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        LLM(model=str(tiny_dir / "nope"))
    with pytest.raises(ValueError, match="dtype"):
        LLM(model=str(tiny_dir), dtype="int3")
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [1, 10**7]}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="2 prompts but 3 sampling_params"):
        llm.generate(PROMPTS[:2], [GREEDY] * 3, use_tqdm=False)
    with pytest.raises(TypeError, match="prompt must be"):
        llm.generate([123], GREEDY, use_tqdm=False)


def test_accepts_vllm_engine_args(tiny_dir):
    llm = LLM(model=str(tiny_dir), max_num_seqs=4, gpu_memory_utilization=0.8, enforce_eager=True,
              dtype="bfloat16")
    assert llm.dtype == torch.bfloat16 and llm.engine_args["max_num_seqs"] == 4
    out = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3


def test_min_tokens_holds_back_eos(llm):
    ref = _greedy(llm, PROMPTS[0]).token_ids
    first = ref.index(ref[3])
    saved = llm.eos_token_ids
    llm.eos_token_ids = frozenset({ref[3]})  # pretend the model's 4th token is end-of-sequence
    try:
        out = _greedy(llm, PROMPTS[0], min_tokens=first + 3)
        assert len(out.token_ids) >= first + 3
        assert ref[3] not in out.token_ids[: first + 2]  # masked while too few tokens exist
    finally:
        llm.eos_token_ids = saved


def test_frequency_penalty_changes_repetitive_greedy_output(llm):
    from collections import Counter

    plain = _greedy(llm, PROMPTS[0], max_tokens=24).token_ids
    penalised = _greedy(llm, PROMPTS[0], max_tokens=24, frequency_penalty=2.0, presence_penalty=2.0).token_ids
    assert Counter(penalised).most_common(1)[0][1] <= Counter(plain).most_common(1)[0][1]
    if Counter(plain).most_common(1)[0][1] > 1:
        assert penalised != plain


def test_n_completions_per_prompt(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8)
    outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert len(outs) == 2 and [len(o.outputs) for o in outs] == [3, 3]
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    samples = {tuple(c.token_ids) for c in outs[0].outputs}
    assert len(samples) > 1  # siblings draw with seed + i
    again = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in outs[0].outputs]
    greedy = llm.generate(PROMPTS[0], SamplingParams(n=2, temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_incremental_api_matches_generate(llm):
    """add_request/step/abort_request: the same tokens as generate, abort frees the cache."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)]
    free_before = llm.engine.allocator.num_free_blocks
    a = llm.add_request(PROMPTS[0], params, request_id="a")
    b = llm.add_request(PROMPTS[1], params)
    with pytest.raises(ValueError, match="already in use"):
        llm.add_request(PROMPTS[0], params, request_id="a")
    c = llm.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    final = {}
    steps = 0
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 3:
            llm.abort_request(c)
    assert final[a] == expected[0] and final[b] == expected[1]
    assert c not in final
    assert llm.engine.allocator.num_free_blocks == free_before

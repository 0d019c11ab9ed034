"""A checkpoint as transformers' save_pretrained writes it: the config declares the MTP layer, no mtp.* tensor ships,
and max_position_embeddings is the family's 262,144. It loads with default arguments, runs without speculation,
matches the reference, and without a max_model_len fits its length to the CPU cache."""

import logging

import pytest
import torch

pytest.importorskip("transformers")

from hf_oracle import assert_matches_reference, build_pair, deterministic_topk  # noqa: E402

import revolta  # noqa: E402
from revolta import LLM, SamplingParams  # noqa: E402
from revolta.cache.capacity import CacheConfigError  # noqa: E402
from revolta.cli import main  # noqa: E402
from revolta.weights import CheckpointError  # noqa: E402

LONG = 262_144


@pytest.fixture(scope="module")
def no_mtp(tmp_path_factory):
    """(checkpoint directory, the transformers model that wrote it)."""
    hf, _, _ = build_pair("T2", seed=5, mtp_num_hidden_layers=1, max_position_embeddings=LONG)
    path = tmp_path_factory.mktemp("no_mtp_ckpt")
    hf.save_pretrained(path)
    return path, hf


def _reference_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad(), deterministic_topk():
        for _ in range(n):
            ids.append(int(hf(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def test_loads_with_default_arguments_and_matches_the_reference(no_mtp, caplog):
    path, hf = no_mtp
    model = revolta.load_model(path, progress=False)
    assert model.cfg.text.mtp is not None and model.mtp is None  # declared, not built
    ids = assert_matches_reference(model, hf, 40)

    with caplog.at_level(logging.INFO, logger="revolta"):
        llm = LLM(model=path, max_model_len=4096)
    assert llm.max_model_len == 4096 and llm.model.mtp is None and not llm.speculative_config.enabled
    assert "speculative decoding off" in caplog.text and "ships no mtp.* weights" in caplog.text
    rows = {name: source for name, _, source in llm.effective_config()}
    assert rows["speculative_config"].startswith("default (off") and rows["max_model_len"] == "argument"
    prompt = [int(t) for t in ids[0, :12]]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert out[0].outputs[0].token_ids == _reference_greedy(hf, prompt, 8)


def test_without_max_model_len_the_length_fits_the_cache(no_mtp, caplog):
    path, hf = no_mtp
    with caplog.at_level(logging.WARNING):
        llm = LLM(model=path)  # the CPU default cache holds one 262,144-token sequence of this tiny model
    assert llm.max_model_len == LONG and "does not fit the KV cache" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        small = LLM(model=path, kv_cache_gib=0.02)  # ~0.5 MiB of K/V per 1k tokens: far from 262,144 tokens
    fitted = [r.getMessage() for r in caplog.records if "does not fit the KV cache" in r.getMessage()]
    assert len(fitted) == 1 and "kv_cache_gib" in fitted[0] and "--max-model-len" in fitted[0]
    bs = small.engine.plan.block_size
    assert 0 < small.max_model_len < LONG and small.max_model_len % bs == 0
    assert f"max_model_len={small.max_model_len:,}" in fitted[0]
    assert small.engine.config.max_model_len == small.max_model_len
    assert small.engine.plan.kv_cache_tokens < small.max_model_len + bs  # the longest whole-block length that fits
    row = {name: (value, source) for name, value, source in small.effective_config()}["max_model_len"]
    assert row == (small.max_model_len, f"fitted to the KV cache (the checkpoint's {LONG:,} does not fit)")
    prompt = list(range(3, 40))
    out = small.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert out[0].outputs[0].token_ids == _reference_greedy(hf, prompt, 6)
    with pytest.raises(CacheConfigError, match=f"max_model_len={LONG:,} needs"):  # an explicit length: today's error
        LLM(model=path, kv_cache_gib=0.02, max_model_len=LONG)


def test_asking_for_mtp_without_its_weights_is_one_clear_error(no_mtp):
    path, _ = no_mtp
    with pytest.raises(CheckpointError) as e:
        revolta.load_model(path, with_mtp=True, progress=False)
    msg = str(e.value)
    assert "ships no MTP weights" in msg and "31 of its tensors" in msg and "mtp.fc_embedding.weight" in msg
    assert "with_mtp=None" in msg and "\n" not in msg
    with pytest.raises(ValueError, match=r"method='mtp' needs the MTP head's weights.*'method': None"):
        LLM(model=path, speculative_config={"method": "mtp"})


def test_info_says_whether_the_mtp_weights_ship(no_mtp, default_dir, capsys):
    assert main(["info", str(no_mtp[0])]) == 0
    out = capsys.readouterr().out
    assert "MTP layers: 1 (QSA); NO mtp.* weights in the checkpoint" in out
    assert main(["info", str(default_dir)]) == 0
    assert "MTP layers: 1 (QSA); weights in the checkpoint" in capsys.readouterr().out
    assert main(["info", str(default_dir / "config.json")]) == 0  # a config alone: nothing to say about weights
    assert "MTP layers: 1 (QSA)\n" in capsys.readouterr().out

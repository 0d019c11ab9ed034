"""The embedded default model: config coverage, deterministic offline build, atomic cache, generation."""

from __future__ import annotations

import hashlib
import socket
import threading

import pytest
import torch

from revolta import LLM, SamplingParams, load_model
from revolta.config import GDN, QSA
from revolta.presets import default as preset
from revolta.tokenizer import Tokenizer

CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                    "generation_config.json", preset.PRESET_MARKER)


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_config_has_every_layer_type():
    cfg = preset.default_config()
    t = cfg.text
    assert set(t.layer_types) == {GDN, QSA} and t.num_hidden_layers == 8
    assert t.ple_layer_indices == (1,) and t.num_mtp_layers == 1 and cfg.vision is not None
    assert t.num_experts == 16 and t.num_experts_per_tok == 4 and t.hc_count == 4
    assert t.qsa_sparse_onset == 67  # sparse within a few hundred tokens
    assert (t.vocab_size, t.eos_token_id) == (248320, 248044)
    assert (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id) == (
        248056, 248057, 248053, 248054)
    assert preset.default_config() == cfg


def test_build_is_deterministic_and_offline(default_dir, tmp_path, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the default preset must build without network access")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    again = preset.write_default_checkpoint(tmp_path / "again")
    for name in CHECKPOINT_FILES:
        assert (default_dir / name).is_file(), name
        assert _sha(default_dir / name) == _sha(again / name), name
    assert (default_dir / "model.safetensors").stat().st_size < 200e6


def test_directory_loads_as_a_checkpoint(default_dir):
    tok = Tokenizer.from_pretrained(default_dir)
    assert tok.vocab_size == 248077 and tok.token_to_id("<|im_end|>") == 248046
    assert set(tok.stop_token_ids) == {248046, 248044}
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.startswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    model = load_model(default_dir, progress=False)
    assert model.mtp is not None and model.model.visual is not None
    ids = torch.tensor([tok.encode("Hello world, this is revolta.")[:5], tok.encode("A different prompt here!!")[:5]])
    with torch.inference_mode():
        logits = model(ids)
    assert logits.shape == (2, 5, 248320) and logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_ensure_reuses_the_built_directory(default_dir):
    stamp = (default_dir / "model.safetensors").stat().st_mtime_ns
    assert preset.ensure_default_model(default_dir.parent) == default_dir
    assert (default_dir / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in default_dir.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_hash_follows_the_preset(monkeypatch):
    before = preset.preset_hash()
    monkeypatch.setitem(preset.DEFAULT_CONFIG["text_config"], "seed", 4321)
    assert preset.preset_hash() != before
    monkeypatch.undo()
    monkeypatch.setattr(preset, "DEFAULT_WEIGHT_SEED", 1)
    assert preset.preset_hash() != before


def _fake_writer(calls, fail=False):
    def write(directory, progress=False):
        calls.append(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text("{}")
        if fail:
            raise RuntimeError("crash in the middle of the build")
        (directory / preset.PRESET_MARKER).write_text("{}")
        return directory

    return write


def test_crash_leaves_nothing_behind(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(preset, "write_default_checkpoint", _fake_writer(calls, fail=True))
    with pytest.raises(RuntimeError, match="crash"):
        preset.ensure_default_model(tmp_path)
    assert list(tmp_path.iterdir()) == []
    # an unfinished directory at the final path (no marker) is rebuilt
    preset.default_model_dir(tmp_path).mkdir()
    monkeypatch.setattr(preset, "write_default_checkpoint", _fake_writer(calls))
    path = preset.ensure_default_model(tmp_path)
    assert preset.is_complete(path) and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_concurrent_builders_keep_one_copy(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(preset, "write_default_checkpoint", _fake_writer(calls))
    results = []
    threads = [threading.Thread(target=lambda: results.append(preset.ensure_default_model(tmp_path)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and preset.is_complete(results[0])
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]


def test_cache_root_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("REVOLTA_CACHE", str(tmp_path / "rc"))
    assert preset.default_cache_root() == tmp_path / "rc"
    monkeypatch.delenv("REVOLTA_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert preset.default_cache_root() == tmp_path / "xdg" / "revolta"
    assert preset.default_model_dir().name == f"default-{preset.preset_hash()}"


def test_default_by_name(default_dir, monkeypatch, tmp_path):
    """revolta.load_model("default") and LLM(model="default") name the embedded default; no other name does."""
    monkeypatch.setenv("REVOLTA_CACHE", str(default_dir.parent))
    model = load_model("default", progress=False)
    assert model.checkpoint_dir == default_dir and model.mtp is not None  # it ships its MTP weights
    llm = LLM(model="default", max_model_len=256, max_num_seqs=1, enforce_eager=True)
    assert llm.model_path == default_dir and llm.is_default_model and llm.speculative_config.method == "mtp"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="'defaults' is not a directory.*'default' for the embedded default"):
        load_model("defaults")


def test_llm_without_model_uses_the_default(default_dir, monkeypatch):
    monkeypatch.setenv("REVOLTA_CACHE", str(default_dir.parent))
    llm = LLM()
    assert llm.model_path == default_dir and llm.is_default_model
    outs = llm.generate(["Hello", "Tell me a story"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 and o.outputs[0].text for o in outs)
    sampled = llm.generate("Hello", use_tqdm=False)[0].outputs[0]  # generation_config.json defaults
    assert sampled.text and sampled.finish_reason in ("length", "stop")

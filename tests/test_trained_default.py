"""The trained embedded default (presets/trained.py, issue 25): shipped files, held-out loss, speculative equality,
the vocabulary mask and `revolta generate` out of the box."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from revolta import LLM, SamplingParams
from revolta.presets import trained, trained_eval
from revolta.presets.load import default_preset, resolve_model
from revolta.weights import VOCAB_MASK

# Held-out CE of the shipped weights on the shipped eval set (8 held-out stdlib files x 128 tokens, fp32 CPU):
# measured 4.491 nats (29 of 1016 targets are tokens never seen in training and are left out); the random default
# gives 12.54. The threshold leaves room for CPU numerics only: a broken conversion (a wrong row scatter, a missing
# layer, the int8 scales) costs far more than 0.25 nats.
HELDOUT_CE_MAX = 4.75
HELDOUT_SKIPPED_MAX = 40


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.getbasetemp() / "revolta_cache"
    trained.ensure_trained_model(root)
    trained.ensure_trained_drafter(root)
    return root


@pytest.fixture
def trained_env(cache, monkeypatch):
    monkeypatch.setenv("REVOLTA_CACHE", str(cache))
    monkeypatch.setenv("REVOLTA_DEFAULT_MODEL", "trained")
    return cache


def test_shipped_files_match_their_checksums_and_size_limit():
    for name, want in trained.WEIGHT_SHA256.items():
        assert trained.file_sha256(trained.WEIGHTS_DIR / name) == want, name
    weights = sorted(p.name for p in trained.WEIGHTS_DIR.glob("*.safetensors"))
    assert weights == sorted(n for n in trained.WEIGHT_SHA256 if n.endswith(".safetensors"))
    assert sum((trained.WEIGHTS_DIR / n).stat().st_size for n in weights) <= 30 << 20


def test_default_names_the_trained_model_unless_told_otherwise(trained_env):
    assert default_preset({}) == "trained-default" and default_preset({"REVOLTA_DEFAULT_MODEL": "random"}) == \
        "random-default"
    with pytest.raises(ValueError, match="REVOLTA_DEFAULT_MODEL"):
        default_preset({"REVOLTA_DEFAULT_MODEL": "big"})
    path, is_default = resolve_model(None)
    assert is_default and path == trained.trained_model_dir(trained_env)
    assert resolve_model("random-default")[0].name.startswith("default-")


def test_heldout_loss_below_threshold(cache):
    from revolta.model import load_model

    model = load_model(trained.trained_model_dir(cache), progress=False)
    ce, skipped = trained_eval.heldout_ce(model)
    assert ce < HELDOUT_CE_MAX, ce
    assert skipped <= HELDOUT_SKIPPED_MAX, skipped
    allowed = json.loads((trained.trained_model_dir(cache) / VOCAB_MASK).read_text())["allowed_token_ids"]
    assert model.logit_mask.sum() == len(allowed) == 23567  # the kept tokens less the drafter's mask token


def _generate(llm: LLM, prompts, n: int) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_greedy_mtp4_and_dflash2_equal_greedy_without_and_never_an_unseen_token(trained_env):
    prompts = trained_eval.prompts(48, 2)  # both in one batch: on CPU a verify round costs ~4 plain steps
    allowed = set(json.loads((trained.trained_model_dir(trained_env) / VOCAB_MASK).read_text())["allowed_token_ids"])
    runs, accepted = {}, {}
    for name, spec in [("none", {"method": None}), ("mtp4", None), ("dflash2", {"method": "dflash2"})]:
        llm = LLM(speculative_config=spec, max_model_len=256, max_num_seqs=2, enforce_eager=True)
        if name == "mtp4":
            assert llm.speculative_config.method == "mtp"  # MTP4 is the default: the checkpoint ships its head
        if name == "dflash2":  # the drafter trained beside the model, not the random default's
            assert Path(llm.speculative_config.model) == trained.trained_drafter_dir(trained_env)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        runs[name] = [list(o.outputs[0].token_ids) for o in outs]
        accepted[name] = sum(o.metrics.spec_decode.num_accepted_tokens for o in outs
                             if o.metrics is not None and o.metrics.spec_decode is not None)
        del llm
    assert runs["mtp4"] == runs["none"] and runs["dflash2"] == runs["none"]
    assert accepted["mtp4"] > 0 and accepted["dflash2"] > 0  # the trained drafts are accepted, not all rejected
    assert all(t in allowed for row in runs["none"] for t in row)


def test_vocab_mask_keeps_every_logit_path_inside_the_allowed_ids(default_dir, tmp_path):
    """The random default predicts any id; with a vocab_mask.json of 64 ids, plain decoding, MTP drafts and DFlash2
    drafts all stay inside them (and greedy speculation still equals greedy without)."""
    from revolta.presets.default_drafter import ensure_default_drafter

    masked = tmp_path / "masked"
    masked.mkdir()
    for f in default_dir.iterdir():
        (masked / f.name).symlink_to(f)
    allowed = list(range(1000, 1064))
    (masked / VOCAB_MASK).write_text(json.dumps({"allowed_token_ids": allowed}))
    prompt = [[9707, 11, 1879]]
    plain = LLM(model=str(default_dir), speculative_config={"method": None}, max_model_len=128, enforce_eager=True)
    free = _generate(plain, prompt, 16)
    del plain
    assert not set(free[0]) <= set(allowed)  # without the mask the random model leaves the 64 ids
    runs = {}
    for name, spec in [("none", {"method": None}), ("mtp", {"method": "mtp", "num_speculative_tokens": 4}),
                       ("dflash2", {"method": "dflash2", "model": str(ensure_default_drafter(default_dir.parent))})]:
        llm = LLM(model=str(masked), speculative_config=spec, max_model_len=128, enforce_eager=True)
        ids = torch.arange(llm.cfg.text.vocab_size)
        assert torch.equal(llm.model.logit_mask.nonzero()[:, 0], ids[1000:1064])
        runs[name] = _generate(llm, prompt, 16)
        del llm
    assert all(set(r[0]) <= set(allowed) for r in runs.values()), runs
    assert runs["mtp"] == runs["none"] and runs["dflash2"] == runs["none"]


def test_revolta_generate_prints_python(trained_env):
    # the user's draft policy (adaptive), not the suite's "always": on CPU drafting does not pay and is switched off
    env = {**os.environ, "REVOLTA_CACHE": str(trained_env), "REVOLTA_DEFAULT_MODEL": "trained",
           "REVOLTA_SPEC_DRAFT_POLICY": "adaptive"}
    proc = subprocess.run([sys.executable, "-m", "revolta.cli", "generate", "--max-tokens", "40",
                           "def fibonacci(n):"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    text = "def fibonacci(n):" + proc.stdout
    lines = text.splitlines()
    # plausible Python: the prompt and the first complete generated lines parse (the cut last line may not)
    parsed = max(k for k in range(1, len(lines) + 1) if _parses(lines[:k]))
    assert parsed >= 3, text
    assert any(line.startswith("    ") and line.strip() for line in lines[1:]), text  # an indented body


def _parses(lines: list[str]) -> bool:
    """Whether the lines are Python, closing a block they open on their last line with `pass`."""
    last = lines[-1]
    tail = [" " * (len(last) - len(last.lstrip()) + 4) + "pass"] if last.rstrip().endswith(":") else []
    try:
        ast.parse("\n".join(lines + tail) + "\n")
    except SyntaxError:
        return False
    return True


def test_image_request_runs_on_the_random_vision_tower(cache):
    """The trained model is text-only; its checkpoint carries the random default's vision tower (at the trained
    width) so image requests still run end to end, and the vocabulary mask holds for them too."""
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8)).save(buf, format="PNG")
    llm = LLM(model=str(trained.trained_model_dir(cache)), speculative_config={"method": None}, max_model_len=256,
              enforce_eager=True)
    out = llm.generate({"prompt": "<|vision_start|><|image_pad|><|vision_end|>def f(x):",
                        "multi_modal_data": {"image": buf.getvalue()}}, SamplingParams(temperature=0.0, max_tokens=4),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids.count(llm.cfg.image_token_id) > 1  # the placeholder expanded to the tower's rows
    assert len(out.outputs[0].token_ids) == 4
    assert all(bool(llm.model.logit_mask[t]) for t in out.outputs[0].token_ids)

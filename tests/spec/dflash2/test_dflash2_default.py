"""The embedded default drafter on the embedded default target: it loads, fits, and drafts deterministically."""

from __future__ import annotations

import hashlib

import pytest
import torch

from revolta.model import load_model
from revolta.presets import ensure_default_drafter
from revolta.presets.default import default_config
from revolta.spec.dflash2 import DraftKVCache, load_draft_model
from revolta.spec.dflash2.taps import capture_boundaries, context_features, reduce_tap

PROMPT = [9707, 11, 1879, 0, 1156, 374, 264, 1273, 315, 279, 12314, 13]


@pytest.fixture(scope="module")
def target(default_dir):
    return load_model(default_dir, dtype=torch.float32, with_vision=False, progress=False)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    return ensure_default_drafter(tmp_path_factory.mktemp("cache"))


def _run_target(target, ids: list[int], layers: tuple[int, ...]):
    text = target.model.language_model
    with torch.no_grad(), capture_boundaries(text, layers) as out:
        logits = target(torch.tensor([ids]))[0]
    return logits, {i: rows[0] for i, rows in out.items()}


def _draft(drafter, target, features: torch.Tensor, anchor: int):
    cache = DraftKVCache()
    sel = drafter([features], [cache], torch.tensor([anchor]), target.model.language_model.embed_tokens,
                  target.compute_logits)
    return sel.tokens, cache


def test_builds_once_and_bitwise_reproducibly(drafter_dir, tmp_path):
    assert ensure_default_drafter(drafter_dir.parent) == drafter_dir  # complete: reused, not rebuilt
    again = ensure_default_drafter(tmp_path)
    digest = [hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest() for d in (drafter_dir, again)]
    assert digest[0] == digest[1]
    assert (drafter_dir / "config.json").read_text() == (again / "config.json").read_text()


def test_drafts_deterministically_on_the_default_target(drafter_dir, target):
    drafter = load_draft_model(drafter_dir)
    cfg = drafter.cfg
    text = default_config().text
    cfg.check_target(text.num_hidden_layers, text.hidden_size, text.vocab_size)
    logits, wide = _run_target(target, PROMPT, cfg.target_layer_ids)
    features = context_features(target.model.language_model, cfg, wide)
    assert features.shape == (len(PROMPT), cfg.num_taps * cfg.hidden_size)
    anchor = int(logits[-1].argmax())
    tokens, cache = _draft(drafter, target, features, anchor)
    assert tokens.shape == (1, cfg.num_drafts) and cache.length == len(PROMPT)
    assert ((0 <= tokens) & (tokens < cfg.vocab_size)).all()
    again, _ = _draft(load_draft_model(drafter_dir), target, features, anchor)
    assert torch.equal(tokens, again)
    # the drafts depend on the context: other features, other drafts
    other, _ = _draft(drafter, target, features.flip(0), anchor)
    assert not torch.equal(tokens, other)


def test_tap_reductions(target):
    """hc_read after the last layer is the LM head's input; the other two are the plain stream reductions."""
    text = target.model.language_model
    last = text.cfg.num_hidden_layers - 1
    logits, wide = _run_target(target, PROMPT, (2, last))
    torch.testing.assert_close(target.compute_logits(reduce_tap(text, last, wide[last], "hc_read")), logits,
                               atol=0, rtol=0)
    h, d = text.cfg.hc_count, text.cfg.hidden_size
    streams = wide[2].unflatten(-1, (h, d))
    torch.testing.assert_close(reduce_tap(text, 2, wide[2], "stream0"), streams[:, 0], atol=0, rtol=0)
    torch.testing.assert_close(reduce_tap(text, 2, wide[2], "stream_mean"), streams.mean(1), atol=0, rtol=0)
    read = reduce_tap(text, 2, wide[2], "hc_read")
    torch.testing.assert_close(read, text.layers[3].attn_hyper_connection.read(wide[2])[0], atol=0, rtol=0)
    assert not torch.allclose(read, streams.mean(1), atol=1e-3)

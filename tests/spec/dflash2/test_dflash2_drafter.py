"""DFlash2Drafter on the embedded default, driven through the paged ModelRunner outside the engine.

Each round commits a forced number of drafts (as if the target had accepted them) with an ordinary
runner step, so the drafter's bookkeeping (pending rows -> its context cache -> the next block) is
checked against the drafter model fed the whole committed sequence's features from a plain forward.
"""

from __future__ import annotations

import pytest
import torch

from revolta.cache.capacity import CacheLayout
from revolta.cache.storage import CacheStorage
from revolta.model import load_model
from revolta.presets import ensure_default_drafter
from revolta.engine.runner import ModelRunner, StepSequence
from revolta.spec.dflash2 import DraftKVCache, load_draft_model
from revolta.spec.dflash2.drafter import DFlash2Drafter
from revolta.spec.dflash2.taps import capture_boundaries, context_features
from revolta.spec.mtp import DraftItem

BLOCK, PER = 8, 8  # page size, pages per request
PROMPTS = [[9707, 11, 1879, 0, 1156, 374, 264, 1273, 315, 279, 12314, 13], [785, 3974, 13876, 38835, 34208, 916, 279]]


@pytest.fixture(scope="module")
def target(default_dir):
    return load_model(default_dir, dtype=torch.float32, with_vision=False, progress=False)


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory):
    return load_draft_model(ensure_default_drafter(tmp_path_factory.mktemp("cache")))


def _runner(target):
    layout = CacheLayout(num_blocks=1 + PER * len(PROMPTS), block_size=BLOCK, num_slots=1 + len(PROMPTS),
                         kv_cache_dtype="fp32", draft_kv_cache_dtype="fp32", dtype="float32")
    return ModelRunner(target, CacheStorage(target.cfg, layout), kernels="torch")


def _step(b: int, ids: list[int], done: int) -> StepSequence:
    return StepSequence(ids, done, list(range(1 + b * PER, 1 + (b + 1) * PER)), slot=b + 1)


def _reference_drafts(target, draft_model, tokens: list[int], anchor: int) -> list[int]:
    """The drafter model on the features of all of `tokens` (one plain forward), drafting from `anchor`."""
    with torch.no_grad(), capture_boundaries(target.model.language_model, draft_model.cfg.target_layer_ids) as out:
        target(torch.tensor([tokens]))
    feats = context_features(target.model.language_model, draft_model.cfg, {i: r[0] for i, r in out.items()})
    sel = draft_model([feats], [DraftKVCache()], torch.tensor([anchor]), target.model.language_model.embed_tokens,
                      target.compute_logits)
    return sel.tokens[0].tolist()


@torch.no_grad()
def test_drafts_follow_the_committed_context(target, draft_model):
    runner = _runner(target)
    drafter = DFlash2Drafter(runner, draft_model, 7)
    assert runner.hidden_taps is not None
    committed = [list(p) for p in PROMPTS]
    done = [0, 0]
    # prefill: request 0 whole, request 1 in two chunks (the second one shares the first verify step)
    chunks = {0: committed[0], 1: committed[1][:4]}
    items = [DraftItem(str(b), _step(b, c, 0), committed[b], 0, 0) for b, c in chunks.items()]
    assert drafter.propose(items) == [[], []]
    logits, rows = runner.execute([it.step for it in items], return_hidden=True)
    assert rows.shape == (len(committed[0]) + 4, draft_model.cfg.num_taps * draft_model.cfg.hidden_size)
    drafter.keep("0", rows[:12], 0, 0)
    drafter.keep("1", rows[12:], 0, 0)
    done = [12, 4]
    next_token = {0: int(logits[0].argmax())}
    for accept in (3, 0, 7, 2):  # forced acceptance per round for request 0
        anchor = next_token[0]
        committed[0].append(anchor)
        items = [DraftItem("0", _step(0, [anchor], done[0]), committed[0], 0, 7)]
        if done[1] < len(committed[1]):  # request 1's last prefill chunk rides along once
            items.append(DraftItem("1", _step(1, committed[1][4:], 4), committed[1], 0, 0))
        assert drafter.has_pending("0", done[0], 0)
        drafts = drafter.propose(items)
        assert drafts[0] == _reference_drafts(target, draft_model, committed[0][:-1], anchor)
        assert all(d == [] for d in drafts[1:])
        # commit the anchor and `accept` drafts with one runner step, keep their rows
        new = [anchor, *drafts[0][:accept]]
        committed[0].extend(new[1:])
        steps = [_step(0, new, done[0])] + [it.step for it in items[1:]]
        logits, rows = runner.execute(steps, return_hidden=True)
        drafter.keep("0", rows[:len(new)], done[0], 0)
        done[0] += len(new)
        if len(items) > 1:
            drafter.keep("1", rows[len(new):], 4, 0)
            done[1] = len(committed[1])
            next_token[1] = int(logits[1].argmax())
        next_token[0] = int(logits[0].argmax())
    # request 1 drafts too: its cache holds both prefill chunks
    committed[1].append(next_token[1])
    drafts = drafter.propose([DraftItem("1", _step(1, committed[1][-1:], done[1]), committed[1], 0, 4)])
    assert drafts[0] == _reference_drafts(target, draft_model, committed[1][:-1], committed[1][-1])[:4]


@torch.no_grad()
def test_the_runners_tapped_rows_are_the_plain_forwards(target, draft_model):
    runner = _runner(target)
    DFlash2Drafter(runner, draft_model, 7)
    ids = PROMPTS[0]
    _, rows = runner.execute([_step(0, ids[:5], 0)], return_hidden=True)
    _, more = runner.execute([_step(0, ids[5:], 5)], return_hidden=True)
    with capture_boundaries(target.model.language_model, draft_model.cfg.target_layer_ids) as out:
        target(torch.tensor([ids]))
    want = context_features(target.model.language_model, draft_model.cfg, {i: r[0] for i, r in out.items()})
    torch.testing.assert_close(torch.cat([rows, more]), want, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_preempted_or_unknown_requests_cannot_draft(target, draft_model):
    runner = _runner(target)
    drafter = DFlash2Drafter(runner, draft_model, 5)
    _, rows = runner.execute([_step(0, PROMPTS[0], 0)], return_hidden=True)
    drafter.keep("0", rows, 0, 0)
    assert drafter.has_pending("0", 12, 0)
    assert not drafter.has_pending("0", 12, 1)  # preempted since: its rows are stale
    assert not drafter.has_pending("0", 11, 0)
    item = DraftItem("0", _step(0, [5], 12), PROMPTS[0] + [5], 1, 5)
    with pytest.raises(ValueError, match="no pending DFlash2 context rows"):
        drafter.propose([item])
    assert "0" not in drafter.pending and "0" not in drafter.caches
    with pytest.raises(ValueError, match="blocks of 8 hold 7 drafts"):
        DFlash2Drafter(runner, draft_model, 8)

"""A verify step whose requests all have R rows (every round graph's) takes the fast forms: padding as
views, QSA through the decode kernels' [B, R] rows, the records written straight into the storage
`VerifyMeta.buffers` hands out. With the Triton kernels (interpreter) its logits and committed state
must be bitwise those of the general path (padding copies, QSA through the prefill kernels, fresh
records): the same kernels compute every row with the same arithmetic either way."""

from __future__ import annotations

import copy

import pytest
import torch

from revolta.engine import runner as runner_module
from revolta.engine.runner import ModelRunner, StepSequence, offsets
from revolta.forward import VerifyMeta
from revolta.spec.commit import commit_verified
from test_paged_model import BLOCK, ids, model, storage_for  # noqa: F401

PROMPTS = [ids(21, 4), ids(14, 5)]  # past the QSA sparse onset of the tiny config (budget 2 blocks)
DRAFTS = [[7, 9], [3, 3]]  # R = 3 rows per request


@pytest.fixture(scope="module")
def prefilled(model):  # noqa: F811
    """The cache after both prompts (the torch path: faster, and both runs start from it alike)."""
    runner = ModelRunner(model, storage_for(model), kernels="torch")
    runner.execute([StepSequence(p, 0, list(range(1 + 8 * b, 9 + 8 * b)), slot=b + 1)
                    for b, p in enumerate(PROMPTS)])
    return runner.storage


def _verify(runner, replay, buffers):
    steps = [StepSequence([p[-1] + 1] + d, len(p), list(range(1 + 8 * b, 9 + 8 * b)), slot=b + 1)
             for b, (p, d) in enumerate(zip(PROMPTS, DRAFTS))]
    inputs = runner._inputs(steps)
    R = len(steps[0].token_ids)
    table = None if replay else torch.tensor([[1, 5, 6], [2, 7, 3]], dtype=torch.int32)
    logits, hidden, paged = runner.verify_packed(inputs, offsets([R] * len(steps)), table,
                                                 torch.arange(R * len(steps)), record_buffers=buffers)
    keep = torch.tensor([1, 2] if replay else [5, 2], dtype=torch.int32)  # request 0 keeps 2 rows, 1 keeps 1
    commit_verified(runner.storage, runner.ops, paged.spec, paged.cu_seqlens, inputs.input_ids, paged.slots, keep,
                    torch.tensor([2, 1], dtype=torch.int32))
    return paged.spec.equal_rows, logits, hidden, runner.storage


@torch.no_grad()
@pytest.mark.parametrize("replay", [True, False], ids=["replay", "draft_slots"])
def test_equal_rows_forms_equal_the_general_path(model, prefilled, replay, monkeypatch):  # noqa: F811
    stored = {}

    def poisoned(name, shape, dtype):  # what a layer does not write stays NaN (or -1) and shows
        if name not in stored:
            stored[name] = torch.full(shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype)
        return stored[name]

    fast = _verify(ModelRunner(model, copy.deepcopy(prefilled), kernels="triton"), replay, poisoned)
    assert fast[0] and stored and all(not t.isnan().any() for t in stored.values() if t.is_floating_point())
    monkeypatch.setattr(runner_module, "VerifyMeta", lambda **kw: VerifyMeta(**{**kw, "equal_rows": False}))
    general = _verify(ModelRunner(model, copy.deepcopy(prefilled), kernels="triton"), replay, None)
    assert not general[0]
    assert torch.equal(fast[1], general[1]) and torch.equal(fast[2], general[2])
    for a, b in zip(_cache_tensors(fast[3]), _cache_tensors(general[3])):
        assert torch.equal(a, b)


def _cache_tensors(storage):
    return storage.slot_tensors() + [x for q in storage.qsa.values() for x in (q.k_cache, q.v_cache, q.index_cache)]

"""The model on the paged hybrid cache equals the simple per-sequence state path.

Chunked prefills at odd splits, mixed prefill + decode batches, sequences sharing a step, and
the KV formats (fp8/int8 within a stated tolerance of the 16-bit cache), with the torch
references and, on small shapes, the Triton kernels (interpreter on CPU).
"""

from __future__ import annotations

import pytest
import torch

from revolta.cache.capacity import CacheLayout
from revolta.cache.storage import CacheStorage
from revolta.config import ModelConfig
from revolta.model import FlashNextModel, init_random_weights
from revolta.engine.runner import ModelRunner, StepSequence
from revolta.state import SequenceState
from tiny_configs import T4_TEXT

TINY = dict(T4_TEXT, model_type="qwen4_exp_text")  # T4 of spec §12.2 (tests/parity/tiny_configs.py)
BLOCK = 8


@pytest.fixture(scope="module")
def model():
    m = FlashNextModel(ModelConfig.from_dict(TINY)).eval()
    init_random_weights(m, seed=5)
    return m


def storage_for(model, kv="fp32", num_blocks=64, num_slots=8):
    kv_dtype = {"fp32": "fp32", "fp8": "fp8_e4m3", "int8": "int8"}[kv]
    layout = CacheLayout(num_blocks=num_blocks, block_size=BLOCK, num_slots=num_slots, kv_cache_dtype=kv_dtype,
                         draft_kv_cache_dtype=kv_dtype, dtype="float32")
    return CacheStorage(model.cfg, layout)


class Driver:
    """Feeds token chunks of several sequences through ModelRunner with fixed pages and slots."""

    def __init__(self, runner, num_seqs):
        self.runner = runner
        self.done = [0] * num_seqs
        per = 16
        self.blocks = [list(range(1 + b * per, 1 + (b + 1) * per)) for b in range(num_seqs)]

    def step(self, chunks: dict[int, list[int]]) -> torch.Tensor:
        seqs = [StepSequence(ids, self.done[b], self.blocks[b], slot=b + 1) for b, ids in chunks.items()]
        out = self.runner.execute(seqs, all_logits=True)
        for b, ids in chunks.items():
            self.done[b] += len(ids)
        return out


def reference_logits(model, seqs):
    return [model(torch.tensor(s)[None])[0] for s in seqs]


def ids(n, seed):
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_paged_equals_per_sequence_state(model, kernels):
    seqs = [ids(33, 1), ids(13, 2), ids(23, 3)]  # 3 decode-only steps after the chunked prefills
    seqs[0][9] = 511  # an EOS inside: n-gram context reset carried through the slot
    ref = reference_logits(model, seqs)
    drv = Driver(ModelRunner(model, storage_for(model), kernels=kernels), 3)
    got = [[] for _ in seqs]
    # step 1: prefill chunks of different sizes; step 2: more prefill mixed with a 1-token chunk;
    # then decode-only steps (one token each) until every sequence is done
    plan = [{0: seqs[0][:5], 1: seqs[1][:13], 2: seqs[2][:7]},
            {0: seqs[0][5:17], 1: [], 2: seqs[2][7:8]},
            {0: seqs[0][17:30], 2: seqs[2][8:20]}]
    for chunks in plan:
        chunks = {b: c for b, c in chunks.items() if c}
        out = drv.step(chunks)
        pos = 0
        for b, c in chunks.items():
            got[b].append(out[pos:pos + len(c)])
            pos += len(c)
    while any(drv.done[b] < len(s) for b, s in enumerate(seqs)):
        chunks = {b: [s[drv.done[b]]] for b, s in enumerate(seqs) if drv.done[b] < len(s)}
        out = drv.step(chunks)
        for i, b in enumerate(chunks):
            got[b].append(out[i:i + 1])
    tol = 2e-5 if kernels == "torch" else 2e-4
    for b, s in enumerate(seqs):
        out = torch.cat(got[b])
        assert out.shape == ref[b].shape
        rel = ((out - ref[b]).abs().max() / ref[b].abs().max()).item()
        assert rel <= tol, (b, rel)
        assert torch.equal(out.argmax(-1), ref[b].argmax(-1))


@torch.no_grad()
@pytest.mark.parametrize("kv,dense_tol", [("fp8", 5e-3), ("int8", 1e-3)])
def test_quantised_kv_close_to_full_precision(model, kv, dense_tol):
    """fp8-e4m3 (scale 1.0) and int8 (per-token-head scales) pages, relative to the max logit.

    Before the sparse onset (t < 11 here) only the K/V rounding differs: <= dense_tol. After it,
    the 1-byte compressed index keys can flip which block wins the top-budget selection; with
    this tiny budget (2 blocks) one flip moves logits by a few percent, so the whole sequence is
    held to 0.1.
    """
    tol = 0.1
    seqs = [ids(40, 7), ids(19, 8)]
    ref = reference_logits(model, seqs)
    drv = Driver(ModelRunner(model, storage_for(model, kv), kernels="torch"), 2)
    out0 = drv.step({0: seqs[0][:30], 1: seqs[1][:10]})
    got0, got1 = [out0[:30]], [out0[30:]]
    for i in range(10):  # decode: both sequences while the shorter lasts, then the longer alone
        chunks = {0: [seqs[0][30 + i]]} | ({1: [seqs[1][10 + i]]} if 10 + i < 19 else {})
        out = drv.step(chunks)
        got0.append(out[:1])
        if len(chunks) == 2:
            got1.append(out[1:2])
    got0, got1 = torch.cat(got0), torch.cat(got1)
    onset = model.cfg.text.qsa_sparse_onset
    for got, r in ((got0, ref[0]), (got1, ref[1])):
        dense = ((got[:onset] - r[:onset]).abs().max() / r.abs().max()).item()
        assert 0 < dense <= dense_tol, dense  # > 0: the pages really are quantised
        rel = ((got - r).abs().max() / r.abs().max()).item()
        assert rel <= tol, rel


def test_runner_rejects_missing_pages(model):
    runner = ModelRunner(model, storage_for(model), kernels="torch")
    with pytest.raises(ValueError, match="needs 2 blocks"):
        runner.execute([StepSequence(ids(9, 1), 0, [1], slot=1)])

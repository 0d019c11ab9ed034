"""On a GPU: the PLE table's placements with the Triton kernels and CUDA graphs on (issue 22).

- the gather kernel reads a pinned host table through its mapped view, also replayed from a CUDA
  graph, with the reference's bits;
- device / host (mapped, and staged for prefill chunks) / disk give the same logits and greedy tokens
  through the engine, decode steps and MTP rounds replayed from graphs. The criterion is what the
  device placement gives run to run: bitwise when two device runs agree bitwise (the usual case),
  else within their own difference;
- the disk worker killed while the engine replays graphs fails the step within the bound (the GPU never
  waits on the worker: the rows are in place before a replay).

Run: PYTHONPATH=src python -m pytest -q tests/gpu/test_ple_gpu.py
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from revolta.config import ModelConfig
from revolta.engine import Engine, EngineConfig
from revolta.kernels.ple_gather import FP8, ple_gather, ple_gather_ref
from revolta.model import FlashNextModel, init_random_weights, load_model
from revolta.ple.disk import PLEWorkerError
from revolta.ple.load import host_tensor
from revolta.ple.table import pin_host_memory
from test_kernel_path_gpu import SMALL
from test_placement import write_checkpoint
from test_spec_gpu import Req

pytestmark = pytest.mark.gpu
CFG = dict(SMALL, mtp_num_hidden_layers=1, make_ngram_vocab_size_divisible_by=32, split_ngram_parts=4)
TIMEOUT_S = 10.0


def _checkpoint(tmp_path_factory, fp8: bool):
    m = FlashNextModel(ModelConfig.from_dict(CFG)).eval()
    init_random_weights(m, seed=7)
    return write_checkpoint(m.to_dtype(torch.bfloat16), tmp_path_factory.mktemp("ple_gpu"), fp8=fp8, cfg=CFG,
                            max_shard_bytes=4 << 20)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The small model in bf16, its table in four shards over several files."""
    return _checkpoint(tmp_path_factory, fp8=False)


@pytest.fixture(scope="module")
def ckpt_fp8(tmp_path_factory):
    """The same with its table in FP8 and one global scale (one file)."""
    return _checkpoint(tmp_path_factory, fp8=True)


@pytest.mark.parametrize("dtype", [FP8, torch.bfloat16])
@torch.no_grad()
def test_mapped_host_gather_in_a_graph_equals_the_reference(dtype):
    R, d, T, H = 1 << 20, 160, 8, 16  # 160 MiB of FP8 rows: real row width, rows spread over the table
    table = host_tensor(R * d * dtype.itemsize).view(dtype).view(R, d)
    table.copy_((torch.randn(R, d, device="cuda") * 4).to(dtype))
    unpin = pin_host_memory(table)
    try:
        scale = torch.tensor(0.03125, device="cuda") if dtype == FP8 else None
        rows = torch.randint(0, R, (T, H), device="cuda")
        out = torch.empty(T, H * d, dtype=torch.float16, device="cuda")
        ple_gather(table, rows, scale, out)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ple_gather(table, rows, scale, out)
        for seed in range(3):  # new rows each replay
            rows.copy_(torch.randint(0, R, (T, H), device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
            graph.replay()
            want = ple_gather_ref(table, rows, scale, torch.empty_like(out))
            assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    finally:
        torch.cuda.synchronize()
        unpin()


def prompts():
    g = torch.Generator().manual_seed(1)
    out = [torch.randint(0, 4000, (n,), generator=g).tolist() for n in (5, 70, 33, 130)]
    out[1][20] = CFG["eos_token_id"]  # an n-gram context reset
    return out


def run(model, spec):
    engine = Engine(model, EngineConfig(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64,
                                        kv_cache_gib=0.5, kernels="triton", speculative_config=spec))
    assert (engine.spec_graphs if spec["method"] else engine.graphs) is not None
    calls, reqs = [], [Req(str(i), p, 12) for i, p in enumerate(prompts())]

    sampler = engine.sampler  # every logits tensor the engine samples from, in order
    sample, verify = sampler.sample, sampler.verify
    sampler.sample = lambda requests, logits: (calls.append(logits.float().clone()), sample(requests, logits))[1]
    sampler.verify = lambda requests, logits, drafts: (calls.append(logits.float().clone()),
                                                       verify(requests, logits, drafts))[1]

    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    replays = (engine.spec_graphs or engine.graphs).num_replays
    if engine.runner.ple_feeder is not None:
        engine.runner.ple_feeder.close()
    return [r.token_ids for r in reqs], calls, replays


def max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


MTP = {"method": "mtp", "num_speculative_tokens": 3}


@pytest.mark.parametrize("table,spec", [("ckpt", {"method": None}), ("ckpt", MTP), ("ckpt_fp8", {"method": None})],
                         ids=["bf16-decode-graphs", "bf16-mtp-graphs", "fp8-decode-graphs"])
@torch.no_grad()
def test_placements_agree_with_graphs(request, table, spec, monkeypatch):
    path = request.getfixturevalue(table)

    def load(placement):
        return load_model(path, dtype=torch.float16, device="cuda", ple_placement=placement, progress=False)

    ref_tokens, ref, replays = run(load("device"), spec)
    again_tokens, again, _ = run(load("device"), spec)
    assert replays > 5 and again_tokens == ref_tokens
    deterministic = all(torch.equal(x, y) for x, y in zip(ref, again))
    tol = 0.0 if deterministic else max_diff(ref, again)
    print(f"device run to run: {'bitwise' if deterministic else f'max |diff| {tol:.3g}'}")
    cases = [("host", {}), ("host", {"REVOLTA_PLE_STAGED_MIN_TOKENS": "16"}), ("disk", {})]
    for placement, env in cases:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        tokens, got, _ = run(load(placement), spec)
        for k in env:
            monkeypatch.delenv(k)
        assert tokens == ref_tokens, (placement, env)
        assert len(got) == len(ref)
        diff = max_diff(got, ref)
        assert diff <= tol, f"{placement} {env}: max |diff| {diff:.3g} > {tol:.3g}"


@torch.no_grad()
def test_a_killed_worker_fails_a_graph_replayed_step_within_the_bound(ckpt):
    model = load_model(ckpt, dtype=torch.float16, device="cuda", ple_placement="disk", progress=False)
    engine = Engine(model, EngineConfig(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64,
                                        kv_cache_gib=0.5, kernels="triton", speculative_config={"method": None}))
    reqs = [Req(str(i), p, 400) for i, p in enumerate(prompts())]
    for r in reqs:
        engine.add_request(r)
    while engine.graphs.num_replays < 3:
        engine.step()
    os.kill(engine.runner.ple_feeder.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(PLEWorkerError, match="SIGKILL"):
        for _ in range(100):
            engine.step()
    assert time.monotonic() - start < TIMEOUT_S
    torch.cuda.synchronize()  # nothing on the device waits for the dead worker
    for r in reqs:
        engine.abort(r.request_id)
    assert engine.allocator.blocks.num_free == engine.allocator.config.num_blocks - 1

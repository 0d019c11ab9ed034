"""The PLE table's placements on CPU (issue 22): device, host and disk give bitwise-identical logits and
greedy tokens through the engine (PLE at decoder layer 1, a table in several shards spread over several
files, EOS resets, prefix hits, preemption, MTP speculation), for a 32-bit and an FP8 + scale table;
a bad table is one clear error at load; and the dead or stalled disk worker fails the step within the
bound, frees every block and stops the engine.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
from safetensors.torch import save_file

from revolta.config import ModelConfig
from revolta.engine import Engine, EngineConfig
from revolta.errors import FatalEngineError
from revolta.model import FlashNextModel, init_random_weights, load_model
from revolta.ple.disk import PLEWorkerError
from revolta.ple.table import PLETable, StagedRows
from revolta.weights import CheckpointError, checkpoint_tensors, save_checkpoint
from test_engine import Req, assert_clean, ids
from test_paged_model import TINY

CFG = dict(TINY, mtp_num_hidden_layers=1, split_ngram_parts=4)  # PLE at zero-based layer 1; 4 shards of 102 rows
EOS = CFG["eos_token_id"]
PLE = "model.language_model.layers.1.ple.ple_embedding.ngram_embedding"
TIMEOUT_S = 10.0  # the bound for a dead or stalled worker


def write_checkpoint(model, path, fp8: bool = False, cfg: dict = CFG, max_shard_bytes: int = 150_000):
    """Shards over several files (max_shard_bytes); fp8: one file, the table as E4M3 shards with one global
    weight_scale (fp32(q) * scale is the table the model computes with), the rest as the model holds it."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    if not fp8:
        save_checkpoint(model, path, max_shard_bytes=max_shard_bytes, progress=False)
        return path
    sd = dict(checkpoint_tensors(model, cfg["split_ngram_parts"]))
    table = model.get_parameter(PLE + ".weight").detach().float()
    scale = table.abs().max() / 448
    for s, part in enumerate((table / scale).to(torch.float8_e4m3fn).chunk(cfg["split_ngram_parts"])):
        sd[f"{PLE}.shard_{s}.weight"] = part.contiguous()
    sd[f"{PLE}.weight_scale"] = scale.reshape(1)
    save_file({k: v.contiguous() for k, v in sd.items()}, path / "model.safetensors")
    return path


@pytest.fixture(scope="module")
def ckpt(source, tmp_path_factory):
    return write_checkpoint(source, tmp_path_factory.mktemp("ple32"))


@pytest.fixture(scope="module")
def ckpt_fp8(source, tmp_path_factory):
    return write_checkpoint(source, tmp_path_factory.mktemp("ple8"), fp8=True)


@pytest.fixture(scope="module")
def source():
    """The model the checkpoints are written from (random weights)."""
    model = FlashNextModel(ModelConfig.from_dict(CFG))
    init_random_weights(model, seed=21)
    return model.eval()


def make_engine(model, **kw):
    cfg = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, block_size=16, kv_cache_gib=0.0007,
               speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg))


def workload(full: bool = True):
    """Prompts with EOS inside (n-gram context resets), the later ones sharing the first one's 40-token prefix
    (hits); in full, a fourth prompt that the 10-block pool can only hold by preempting."""
    shared = ids(40, seed=3)
    shared[12] = EOS
    prompts = [shared + ids(3, seed=1), shared + ids(6, seed=4), ids(35, seed=5) + [EOS, 7], ids(40, seed=6)]
    return [Req(f"r{i}", p, max_tokens=4) for i, p in enumerate(prompts if full else prompts[:2])]


def run_recording(engine, reqs):
    """Greedy with speculation; every logits tensor handed to sampling, in order; preemptions seen."""
    logits, preempted = [], []
    orig = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: (preempted.append(seq.request_id), orig(seq))

    sampler = engine.sampler
    sample, verify = sampler.sample, sampler.verify
    sampler.sample = lambda requests, rows: (logits.append(rows.clone()), sample(requests, rows))[1]
    sampler.verify = lambda requests, rows, drafts: (logits.append(rows.clone()), verify(requests, rows, drafts))[1]

    for r in reqs[:1]:  # the first request alone, so the later ones hit its cached prefix
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    for r in reqs[1:]:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    return logits, preempted


def close(engine):
    if engine.runner.ple_feeder is not None:
        engine.runner.ple_feeder.close()


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32-table", "fp8-table"])
@torch.no_grad()
def test_placements_give_bitwise_identical_logits_and_tokens(request, fp8):
    """The fp32 table runs the whole workload with MTP on; the FP8 table a short one without speculation."""
    path = request.getfixturevalue("ckpt_fp8" if fp8 else "ckpt")
    runs = {}
    for placement in ("device", "host", "disk"):
        model = load_model(path, ple_placement=placement, progress=False)
        table = model.model.language_model.layers[1].ple.ple_embedding.table
        want = {"device": PLETable if fp8 else type(None), "host": PLETable, "disk": StagedRows}[placement]
        assert isinstance(table, want), (placement, table)
        engine = make_engine(model, **({"speculative_config": {"method": None}} if fp8 else {}))
        reqs = workload(full=not fp8)
        logits, preempted = run_recording(engine, reqs)
        assert engine.allocator.stats.hit_tokens >= 32, engine.allocator.stats
        assert fp8 or (preempted and engine.spec_stats.num_draft_tokens > 0), (preempted, engine.spec_stats)
        assert_clean(engine)
        close(engine)
        runs[placement] = ([r.token_ids for r in reqs], logits)
    tokens, logits = runs["device"]
    for placement in ("host", "disk"):
        assert runs[placement][0] == tokens, placement
        assert len(runs[placement][1]) == len(logits), placement
        assert all(torch.equal(a, b) for a, b in zip(runs[placement][1], logits)), placement


@torch.no_grad()
def test_disk_rows_reach_the_speculative_round_buffers(ckpt):
    """MTP rounds through spec/graphs.py's static buffers (graphs=False runs the captured code eagerly): the
    verify reads the rows the worker gathered for its padded batch, device-drafted tokens included."""
    from revolta.spec.graphs import SpecGraphs

    runs = []
    for placement in ("device", "disk"):
        engine = make_engine(load_model(ckpt, ple_placement=placement, progress=False), kv_cache_gib=0.004)
        width = -(-(engine.config.max_model_len + 2) // engine.plan.layout.block_size)
        engine.executor.spec_graphs = SpecGraphs(engine.runner, [1, 2, 4], 2, False, width)
        engine.spec_graphs.capture(graphs=False)
        reqs = workload(full=False)
        logits, _ = run_recording(engine, reqs)
        assert engine.spec_graphs.num_replays > 0
        assert_clean(engine)
        close(engine)
        runs.append(([r.token_ids for r in reqs], logits))
    assert runs[1][0] == runs[0][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[1][1], runs[0][1]))


@torch.no_grad()
def test_fp8_table_equals_its_dequantised_weight(source, ckpt_fp8):
    """The FP8 table, looked up anywhere, is the fp32 table fp32(q) * scale used as a plain weight."""
    table = source.get_parameter(PLE + ".weight").detach()
    scale = table.abs().max() / 448
    plain = FlashNextModel(ModelConfig.from_dict(CFG)).eval()
    plain.load_state_dict(source.state_dict())
    plain.get_parameter(PLE + ".weight").copy_((table / scale).to(torch.float8_e4m3fn).float() * scale)
    plain.merge_projections()  # as load_model does: the merged GEMM's last bits differ from the separate ones
    x = torch.tensor([ids(17, seed=8), ids(17, seed=9)])
    x[0, 5] = EOS
    host = load_model(ckpt_fp8, ple_placement="host", progress=False)
    assert torch.equal(host(x), plain(x))


def test_host_memory_is_one_copy_of_the_table(ckpt_fp8):
    model = load_model(ckpt_fp8, ple_placement="host", progress=False)
    emb = model.model.language_model.layers[1].ple.ple_embedding
    assert not hasattr(emb, "ngram_embedding") and emb.table.weight.dtype == torch.float8_e4m3fn
    assert emb.table.nbytes == emb.num_rows * emb.head_dim  # 1 byte per value, as stored
    assert all("ngram_embedding" not in n for n, _ in model.named_parameters())


# ---- load errors ---------------------------------------------------------------------------------------------------

def _rewrite(src, dst, edit):
    """A copy of the single-file FP8 checkpoint with its tensors edited by `edit(dict)`."""
    from safetensors.torch import load_file

    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    sd = load_file(src / "model.safetensors")
    edit(sd)
    save_file(sd, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("placement", ["device", "host", "disk"])
def test_a_bad_table_is_one_clear_error_at_load(ckpt_fp8, tmp_path, placement):
    wrong = _rewrite(ckpt_fp8, tmp_path / "wrong", lambda sd: sd.update(
        {f"{PLE}.shard_2.weight": sd[f"{PLE}.shard_2.weight"][:, :5].contiguous()}))
    with pytest.raises(CheckpointError, match=r"shard_2.weight: shape \[102, 5\], expected \[rows, 16\]"):
        load_model(wrong, ple_placement=placement, progress=False)
    missing = _rewrite(ckpt_fp8, tmp_path / "missing", lambda sd: sd.pop(f"{PLE}.shard_1.weight"))
    with pytest.raises(CheckpointError, match=r"shard_\[1\] missing") as e:
        load_model(missing, ple_placement=placement, progress=False)
    assert str(e.value).count("\n") == 1  # one problem, one line
    no_scale = _rewrite(ckpt_fp8, tmp_path / "no_scale", lambda sd: sd.pop(f"{PLE}.weight_scale"))
    with pytest.raises(CheckpointError, match="without its global scale"):
        load_model(no_scale, ple_placement=placement, progress=False)


def test_a_shard_file_the_index_lists_must_exist(ckpt, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    victim = index["weight_map"][f"{PLE}.shard_3.weight"]
    (broken / victim).unlink()
    with pytest.raises(CheckpointError, match=f"missing from .*{victim}"):
        load_model(broken, ple_placement="disk", progress=False)


# ---- the disk worker's failures --------------------------------------------------------------------------------

def _start(ckpt, n=3):
    engine = make_engine(load_model(ckpt, ple_placement="disk", progress=False), speculative_config={"method": None})
    reqs = [Req(f"k{i}", ids(20 + i, seed=30 + i), max_tokens=40) for i in range(n)]
    for r in reqs:
        engine.add_request(r)
    for _ in range(4):  # prefill and a few decode steps
        engine.step()
    assert any(r.token_ids for r in reqs)
    return engine, reqs


def _fails_within(engine, bound):
    start = time.monotonic()
    with pytest.raises(PLEWorkerError) as e:
        while True:
            engine.step()
            assert time.monotonic() - start < bound + 5, "the step never failed"
    took = time.monotonic() - start
    assert took < bound, f"the step failed after {took:.1f} s"
    assert isinstance(e.value, FatalEngineError)
    return str(e.value)


def _abort_all(engine, reqs):
    for r in reqs:
        engine.abort(r.request_id)
    assert_clean(engine)


@torch.no_grad()
def test_a_killed_worker_fails_the_step_frees_every_block_and_stops_the_engine(ckpt):
    engine, reqs = _start(ckpt)
    pid = engine.runner.ple_feeder.pid
    os.kill(pid, signal.SIGKILL)
    message = _fails_within(engine, TIMEOUT_S)
    assert f"PLE worker process (pid {pid}) was killed by SIGKILL" in message and "stops" in message
    _abort_all(engine, reqs)
    with pytest.raises(PLEWorkerError):
        engine.check_health()
    again = Req("again", ids(5, seed=1), max_tokens=2)
    engine.add_request(again)
    with pytest.raises(PLEWorkerError, match="killed by SIGKILL"):  # the engine does not run again
        engine.step()
    _abort_all(engine, [again])


@torch.no_grad()
def test_a_stalled_worker_is_killed_after_the_timeout(ckpt, monkeypatch):
    monkeypatch.setenv("REVOLTA_PLE_WORKER_TIMEOUT_S", "1")
    engine, reqs = _start(ckpt, n=1)
    pid = engine.runner.ple_feeder.pid
    os.kill(pid, signal.SIGSTOP)  # alive, silent: no reply, no heartbeat
    try:
        message = _fails_within(engine, 4.0)
    finally:
        os.kill(pid, signal.SIGCONT) if engine.runner.ple_feeder.proc.poll() is None else None
    assert "sent nothing for 1 s" in message and "was killed" in message
    assert engine.runner.ple_feeder.proc.poll() is not None  # the watchdog ended it
    _abort_all(engine, reqs)


@torch.no_grad()
def test_an_idle_engine_notices_its_worker_died(ckpt):
    engine = make_engine(load_model(ckpt, ple_placement="disk", progress=False), speculative_config={"method": None})
    engine.check_health()
    feeder = engine.runner.ple_feeder
    os.kill(feeder.pid, signal.SIGKILL)
    feeder.proc.wait(timeout=TIMEOUT_S)
    with pytest.raises(PLEWorkerError, match="was killed by SIGKILL while idle"):
        engine.check_health()

"""`LLM(model=DIR, tensor_parallel_size=2)` (CPU, gloo, a spawned worker): the greedy tokens of the TP1 LLM through
the whole front (validation before loading, rank 0's shard loaded by slices, the cache planned per rank), with
chunked prefill and a prefix hit, without and with MTP speculation; the memory budget counts the rank's own weights;
close() leaves no worker; TP2 + DCP2 gives the same tokens; layouts the path cannot run are refused before any
process starts."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from revolta import LLM
from revolta.engine.sampling import SamplingParams
from revolta.model import FlashNextModel
from revolta.multimodal.media import MediaError
from revolta.parallel import ParallelConfigError
from revolta.weights import save_checkpoint
from revolta.ple.load import ple_memory
from tp_tiny import full_model, tiny, write_fp8_ple_checkpoint

PROMPTS = [[(7 * i + 3 * n) % 500 for i in range(n)] for n in (21, 9, 50)]
LATER = PROMPTS[2][:48] + [1, 2, 3]  # after the first batch: the third prompt's 3 full pages are a prefix hit
ARGS = dict(device="cpu", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=24, block_size=16,
            kv_cache_gib=0.004, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = tiny()
    path = tmp_path_factory.mktemp("tp_llm") / "ckpt"
    save_checkpoint(full_model(cfg), path, progress=False)
    cfg.save(path)
    return path


def _run(llm: LLM) -> tuple[list[list[int]], int]:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    later = llm.generate([{"prompt_token_ids": LATER}], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in first + later], llm.engine.allocator.stats.hit_tokens


def _budget_weights(llm: LLM, monkeypatch) -> int:
    """The weights the CUDA memory budget subtracts (read on CPU by making the model look like it is on a GPU)."""
    with monkeypatch.context() as m:
        m.setattr(FlashNextModel, "device", property(lambda self: torch.device("cuda")))
        m.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=32 << 30))
        m.setattr(llm.engine, "config", replace(llm.engine.config, kv_cache_gib=None))
        return llm.engine._budget().weights_bytes


@pytest.mark.parametrize("spec", [{"method": None}, {"method": "mtp", "num_speculative_tokens": 2}],
                         ids=["plain", "mtp"])
def test_llm_tp2_gives_the_tp1_tokens(ckpt, spec, one_thread, monkeypatch):
    llm1 = LLM(model=ckpt, speculative_config=spec, **ARGS)
    want = _run(llm1)
    full_weights = _budget_weights(llm1, monkeypatch)
    llm2 = LLM(model=ckpt, speculative_config=spec, tensor_parallel_size=2, **ARGS)
    procs = llm2.engine.executor.procs
    try:
        assert llm2.engine.plan.layout.tp == 2 and llm2.model.lm_head.weight.shape[0] == llm2.cfg.text.vocab_size // 2
        assert ("tensor_parallel_size", 2, "argument") in llm2.effective_config()
        share = ple_memory(llm2.model).share  # the device PLE table: rank 0 holds the first half of its rows
        assert share is not None and share[:2] == (0, -(-share[2] // 2)), ple_memory(llm2.model)
        got = _run(llm2)
        with pytest.raises(MediaError, match="this model has no vision tower"):
            llm2.engine.check_media(None)  # a text-only checkpoint: refused before anything is queued
        rank_weights = _budget_weights(llm2, monkeypatch)
        stats = llm2.engine.spec_stats
    finally:
        llm2.close()
    assert got == want
    assert got[1] == 48 and all(len(t) == 6 for t in got[0])  # the later prompt's 3 pages came from the cache
    assert 0.4 * full_weights < rank_weights < 0.7 * full_weights, (rank_weights, full_weights)
    if spec["method"] == "mtp":  # drafts were proposed on the shards and verified
        assert stats.num_rounds > 0 and stats.num_draft_tokens > 0, stats
    for p in procs:
        p.join(5)
    assert not any(p.is_alive() for p in procs) and all(p.exitcode == 0 for p in procs)


def test_llm_tp2_dcp2_gives_the_tp1_tokens(tmp_path, one_thread):
    """LLM(decode_context_parallel_size=2) reaches the ranks and the cache plan: one KV head shared by both ranks,
    each holding half of its tokens."""
    path = tmp_path / "ckpt"
    cfg = tiny(num_key_value_heads=1)
    save_checkpoint(full_model(cfg), path, progress=False)
    cfg.save(path)
    want = _run(LLM(model=path, **ARGS))
    llm = LLM(model=path, tensor_parallel_size=2, decode_context_parallel_size=2, **ARGS)
    try:
        assert (llm.engine.plan.layout.tp, llm.engine.plan.layout.dcp) == (2, 2)
        assert ("decode_context_parallel_size", 2, "argument") in llm.effective_config()
        got = _run(llm)
    finally:
        llm.close()
    assert got == want and got[1] == 48


def test_llm_tp2_with_the_ple_table_on_the_host_gives_the_tp1_tokens(tmp_path, one_thread):
    """An FP8 table in 3 shards (rank 0's rows end inside the second): each rank holds its half in host memory and
    the masked gathers' all-reduce gives TP1's rows (the FP8 table on the device there): the same tokens."""
    from revolta.parallel.ple import RankRowsTable
    from revolta.ple.load import ple_memory

    rows = write_fp8_ple_checkpoint(tiny(), tmp_path)
    want, _ = _run(LLM(model=tmp_path, **ARGS))
    llm = LLM(model=tmp_path, tensor_parallel_size=2, ple_placement="host", **ARGS)
    try:
        tables = [m.table for m in llm.model.modules() if isinstance(getattr(m, "table", None), RankRowsTable)]
        assert [(t.start_row, t.end_row) for t in tables] == [(0, rows // 2)]  # rank 0's half
        assert ple_memory(llm.model).host_bytes == rows // 2 * tables[0].weight.shape[1]  # FP8: one byte per value
        got, _ = _run(llm)
    finally:
        llm.close()
    assert got == want


@pytest.mark.parametrize("args, match", [
    (dict(tensor_parallel_size=3), r"tensor_parallel_size=3 does not divide text_config\.num_attention_heads"),
    (dict(tensor_parallel_size=2, decode_context_parallel_size=2),  # 2 KV heads at TP2: no copies to remove
     r"decode_context_parallel_size=2 exceeds tensor_parallel_size / num_key_value_heads = 2 / 2.*use at most 1"),
])
def test_layouts_it_cannot_run_are_refused_before_loading(ckpt, args, match, monkeypatch):
    monkeypatch.setattr("revolta.engine.tp_executor.TPGroup.start", lambda *a, **k: pytest.fail("started ranks"))
    monkeypatch.setattr("revolta.llm.load_model", lambda *a, **k: pytest.fail("loaded weights"))
    with pytest.raises(ParallelConfigError, match=match):
        LLM(model=ckpt, **{**ARGS, **args})

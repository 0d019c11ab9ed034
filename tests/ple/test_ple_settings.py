"""The `ple_placement` setting: argument and environment (the release note's variables with their meaning),
the knobs of the off-device placements, `revolta info` and the capacity report, and the LLM's startup
summary; through the LLM, a dead disk worker fails generation with its error and frees every block."""

from __future__ import annotations

import logging
import os
import signal

import pytest

from revolta.plan import dry_run_plan, dry_run_report
from revolta.cli import main
from revolta.config import ModelConfig
from revolta.ple.placement import PLEOptions, Placement, resolve_ple_placement

REAL = os.path.join(os.path.dirname(__file__), "..", "data", "qwen3_8_flash_next_config.json")


@pytest.mark.parametrize("env,value,source", [
    ({}, "device", "default"),
    ({"REVOLTA_PLE_PLACEMENT": "disk"}, "disk", "environment (REVOLTA_PLE_PLACEMENT)"),
    ({"VLLM_PLE_CPU_OFFLOAD": "1"}, "host", "environment (VLLM_PLE_CPU_OFFLOAD=1)"),
    ({"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_DISK_OFFLOAD": "1", "VLLM_SM70_QWEN38_HYBRID_PLE": "0"}, "disk",
     "environment (VLLM_PLE_CPU_OFFLOAD=1, VLLM_PLE_DISK_OFFLOAD=1, VLLM_SM70_QWEN38_HYBRID_PLE=0)"),
    # 1Cat's hybrid defaults set all three: the pinned-host mode wins (the disk mode must set hybrid to 0)
    ({"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_DISK_OFFLOAD": "1", "VLLM_SM70_QWEN38_HYBRID_PLE": "1"}, "host",
     "environment (VLLM_PLE_CPU_OFFLOAD=1, VLLM_PLE_DISK_OFFLOAD=1, VLLM_SM70_QWEN38_HYBRID_PLE=1: the pinned-host "
     "hybrid mode)"),
    ({"VLLM_PLE_CPU_OFFLOAD": "0"}, "device", "default"),
])
def test_placement_from_the_environment(env, value, source):
    assert resolve_ple_placement(None, env) == Placement(value, source)


def test_argument_wins_and_bad_values_are_named(caplog):
    with caplog.at_level(logging.WARNING):
        assert resolve_ple_placement("host", {"REVOLTA_PLE_PLACEMENT": "disk"}) == Placement("host", "argument")
    assert "overrides 'disk'" in caplog.text
    with caplog.at_level(logging.WARNING):  # REVOLTA_PLE_PLACEMENT over the vLLM names
        got = resolve_ple_placement(None, {"REVOLTA_PLE_PLACEMENT": "device", "VLLM_PLE_CPU_OFFLOAD": "1"})
    assert got.value == "device" and "REVOLTA_PLE_PLACEMENT=device overrides 'host'" in caplog.text
    with pytest.raises(ValueError, match="ple_placement='gpu'; use one of device, host, disk"):
        resolve_ple_placement("gpu", {})
    with pytest.raises(ValueError, match="REVOLTA_PLE_PLACEMENT='cpu'"):
        resolve_ple_placement(None, {"REVOLTA_PLE_PLACEMENT": "cpu"})
    with pytest.raises(ValueError, match="VLLM_PLE_DISK_OFFLOAD=1 needs VLLM_PLE_CPU_OFFLOAD=1"):
        resolve_ple_placement(None, {"VLLM_PLE_DISK_OFFLOAD": "1"})
    with pytest.raises(ValueError, match="VLLM_PLE_CPU_OFFLOAD='maybe' is not a boolean"):
        resolve_ple_placement(None, {"VLLM_PLE_CPU_OFFLOAD": "maybe"})
    assert resolve_ple_placement(None, {}, default="host") == Placement("host", "default")


def test_offload_options_from_the_environment():
    opts = PLEOptions.from_env({"REVOLTA_PLE_DISK_THREADS": "4", "VLLM_PLE_DISK_RELEASE_PAGES": "1",
                                "REVOLTA_PLE_WORKER_TIMEOUT_S": "2.5", "REVOLTA_PLE_STAGED_MIN_TOKENS": "4096"})
    assert (opts.disk_threads, opts.release_pages, opts.worker_timeout_s, opts.staged_min_tokens) == (4, True, 2.5, 4096)
    assert not PLEOptions.from_env({"REVOLTA_PLE_DISK_RELEASE_PAGES": "0", "VLLM_PLE_DISK_RELEASE_PAGES": "1"}).release_pages
    with pytest.raises(ValueError, match="REVOLTA_PLE_WORKER_TIMEOUT_S=0 must be >= 0.1"):
        PLEOptions.from_env({"REVOLTA_PLE_WORKER_TIMEOUT_S": "0"})


def test_the_capacity_report_gives_the_table_memory_to_the_kv_pool():
    """Two H200s: with the table on the host each GPU's KV pool holds its half of the 47.7 GiB FP8 table more
    (on one H200 the table on the device leaves no room for a 64K-token request at all)."""
    cfg = ModelConfig.from_pretrained(REAL)
    args = (cfg, 141.0, 2, 65_536, "fp8_e4m3")
    host, device = dry_run_plan(*args, ple_placement="host"), dry_run_plan(*args, ple_placement="device")
    per_gpu = 320_001_536 * 160 // 2  # FP8, 1 byte per value, vocab-parallel over TP 2
    assert device.budget.weights_bytes - host.budget.weights_bytes == per_gpu
    assert host.budget.cache_bytes - device.budget.cache_bytes == per_gpu
    assert host.kv_cache_tokens > device.kv_cache_tokens
    report = dry_run_report(*args, ple_placement="disk", ple_source="environment (REVOLTA_PLE_PLACEMENT)")
    assert "PLE table: placement disk [environment (REVOLTA_PLE_PLACEMENT)]: 47.68 GiB (23.84 GiB per TP rank)" in report
    assert "not in the GPU budget" in report
    assert "read by each rank's PLE worker process, which maps only its rows" in report  # TP 2: the rows are split


def test_revolta_info_shows_the_placement(capsys, monkeypatch):
    assert main(["info", REAL]) == 0
    assert "PLE table placement: host [default: the release note's reference deployment]" in capsys.readouterr().out
    monkeypatch.setenv("VLLM_PLE_CPU_OFFLOAD", "1")
    monkeypatch.setenv("VLLM_PLE_DISK_OFFLOAD", "1")
    assert main(["info", REAL, "--gpu-memory", "141", "--max-model-len", "65536", "--kv-cache-dtype", "fp8_e4m3"]) == 0
    out = capsys.readouterr().out
    assert "PLE table: placement disk [environment (VLLM_PLE_CPU_OFFLOAD=1, VLLM_PLE_DISK_OFFLOAD=1)]" in out
    assert main(["info", REAL, "--gpu-memory", "141", "--max-model-len", "65536", "--kv-cache-dtype", "fp8_e4m3",
                 "--ple-placement", "device", "--tp", "2"]) == 0
    assert "PLE table: placement device [argument]: 47.68 GiB (23.84 GiB per TP rank) in the GPU weights" in \
        capsys.readouterr().out


def test_llm_reports_the_placement_and_a_dead_worker_frees_every_block(tmp_path, monkeypatch, caplog):
    from revolta import LLM, SamplingParams
    from revolta.model import FlashNextModel, init_random_weights
    from revolta.ple.disk import PLEWorkerError
    from test_engine import assert_clean
    from test_placement import CFG, write_checkpoint

    model = FlashNextModel(ModelConfig.from_dict(CFG))
    init_random_weights(model, seed=2)
    path = write_checkpoint(model, tmp_path / "tiny")  # no tokenizer: prompts are token ids
    monkeypatch.setenv("VLLM_PLE_CPU_OFFLOAD", "1")
    monkeypatch.setenv("VLLM_PLE_DISK_OFFLOAD", "1")
    with caplog.at_level(logging.INFO, logger="revolta"):
        llm = LLM(model=str(path), max_num_seqs=2, max_model_len=128, speculative_config={"method": None})
    rows = {name: (value, source) for name, value, source in llm.effective_config()}
    assert rows["ple_placement"][0].startswith("disk (") and "VLLM_PLE_DISK_OFFLOAD=1" in rows["ple_placement"][1]
    assert "PLE worker process pid" in caplog.text and "PLE table placement 'disk'" in caplog.text
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    stream = llm.stream([{"prompt_token_ids": [97, 11, 187]}] * 2, params)
    next(stream)
    os.kill(llm.engine.runner.ple_feeder.pid, signal.SIGKILL)
    with pytest.raises(PLEWorkerError, match="killed by SIGKILL"):
        for _ in stream:
            pass
    assert_clean(llm.engine)  # the stream's cleanup aborted both requests
    with pytest.raises(PLEWorkerError):
        llm.check_health()

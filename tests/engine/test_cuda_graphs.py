"""CUDA-graph policy that needs no GPU: capture sizes, the reserve warning, config checks."""

from __future__ import annotations

import pytest

from revolta.engine.cuda_graphs import MiB, default_capture_sizes, graph_warning
from revolta.engine import EngineConfig


def test_default_capture_sizes():
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(8) == [1, 2, 4, 8]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]


def test_reserve_warning_threshold_and_suggestion():
    reserve = 700 * MiB
    assert graph_warning(700 * MiB, reserve) is None
    assert graph_warning(764 * MiB, reserve) is None  # within max(64 MiB, 5%) of the reserve
    msg = graph_warning(1000 * MiB, reserve)
    assert msg is not None and "cudagraph_mem_mib=1152" in msg and "REVOLTA_CUDAGRAPH_MEM_MIB" in msg
    big = 4000 * MiB  # 5% = 200 MiB of slack beats 64 MiB
    assert graph_warning(big + 150 * MiB, big) is None and graph_warning(big + 250 * MiB, big) is not None


def test_engine_config_graph_settings(monkeypatch):
    monkeypatch.delenv("REVOLTA_CUDAGRAPH_MEM_MIB", raising=False)
    assert EngineConfig(max_model_len=64).resolved_cudagraph_mem_mib() == 700.0
    monkeypatch.setenv("REVOLTA_CUDAGRAPH_MEM_MIB", "1200")
    assert EngineConfig(max_model_len=64).resolved_cudagraph_mem_mib() == 1200.0
    assert EngineConfig(max_model_len=64, cudagraph_mem_mib=256).resolved_cudagraph_mem_mib() == 256.0
    assert not EngineConfig(max_model_len=64, kernels="torch").use_cuda_graphs  # references sync mid-forward
    assert not EngineConfig(max_model_len=64, kernels="triton", enforce_eager=True).use_cuda_graphs
    with pytest.raises(ValueError, match="cudagraph_mem_mib"):
        EngineConfig(max_model_len=64, cudagraph_mem_mib=-1)
    monkeypatch.setenv("REVOLTA_CUDAGRAPH_MEM_MIB", "x")
    with pytest.raises(ValueError, match="REVOLTA_CUDAGRAPH_MEM_MIB"):
        EngineConfig(max_model_len=64)


def test_dflash2_graph_options_default_on_where_graphs_run_and_are_refused_where_they_cannot():
    ec = EngineConfig(max_model_len=64)  # None: on wherever the engine captures graphs (tp 1), on every path
    assert ec.dflash2_graph_rounds is None and ec.dflash2_draft_graph is None
    assert ec.dflash2_graphs("dflash2_graph_rounds") and ec.dflash2_graphs("dflash2_draft_graph")
    tp2 = EngineConfig(max_model_len=64, kernels="triton", tensor_parallel_size=2)
    assert not tp2.dflash2_graphs("dflash2_graph_rounds") and not tp2.dflash2_graphs("dflash2_draft_graph")
    off = EngineConfig(max_model_len=64, kernels="triton", dflash2_graph_rounds=False)
    assert not off.dflash2_graphs("dflash2_graph_rounds") and off.dflash2_graphs("dflash2_draft_graph")
    with pytest.raises(ValueError, match=r"dflash2_draft_graph='no' must be True or False \(or None"):
        EngineConfig(max_model_len=64, dflash2_draft_graph="no")
    spec = {"method": "dflash2", "model": "unused"}
    for name in ("dflash2_graph_rounds", "dflash2_draft_graph"):
        # tp 1 on the Triton path: accepted (with enforce_eager too: an eager reference run of the same config)
        EngineConfig(max_model_len=64, speculative_config=spec, kernels="triton", **{name: True})
        EngineConfig(max_model_len=64, speculative_config=spec, kernels="triton", enforce_eager=True, **{name: True})
        with pytest.raises(ValueError, match=f"{name}=True needs tensor_parallel_size=1"):
            EngineConfig(max_model_len=64, speculative_config=spec, kernels="triton", tensor_parallel_size=2,
                         **{name: True})
        with pytest.raises(ValueError, match=f"{name}=True needs CUDA graphs.*kernels='torch'"):
            EngineConfig(max_model_len=64, speculative_config=spec, **{name: True})  # the CPU path


def test_vllm_graph_reserve_variable_is_honoured(monkeypatch):
    """The release note's VLLM_V2_CUDAGRAPH_MEM_MIB (e.g. a 0.1.2 deployment's 1500) is read, not silently ignored;
    revolta's own variable wins, and a negative value is refused by name (spec/engine.md §8 item 5)."""
    monkeypatch.delenv("REVOLTA_CUDAGRAPH_MEM_MIB", raising=False)
    monkeypatch.setenv("VLLM_V2_CUDAGRAPH_MEM_MIB", "1500")
    assert EngineConfig(max_model_len=64).resolved_cudagraph_mem_mib() == 1500.0
    monkeypatch.setenv("REVOLTA_CUDAGRAPH_MEM_MIB", "900")
    assert EngineConfig(max_model_len=64).resolved_cudagraph_mem_mib() == 900.0
    monkeypatch.delenv("REVOLTA_CUDAGRAPH_MEM_MIB")
    monkeypatch.setenv("VLLM_V2_CUDAGRAPH_MEM_MIB", "-5")
    with pytest.raises(ValueError, match="VLLM_V2_CUDAGRAPH_MEM_MIB=-5"):
        EngineConfig(max_model_len=64)

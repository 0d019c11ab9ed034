"""On a GPU: the split-K fixup (kernels/quant/common.py, config key FIXUP), where the last K slice of each output tile
to finish adds the partials instead of a reduce launch. Its result must be bitwise the reduce launches' (the same
sums in the same order) on every call whatever order the programs finish in, and its counters must be zero again
after each launch (or the next call's last arrival would be wrong). Checked over many calls, eagerly and replayed
from a CUDA graph: the dense one-row AWQ GEMV on the word-column walk (fp32 and fp16 pairs, 64 slices) and the
nibble path (tl.dot, 16-row tiles, 2 rows), and the AWQ MoE on the word-column walk at 1 and 8 tokens (the act of a
(pair, tile) and the slot sum of a (token, tile) of 88 / 44 partial rows)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_quant_moe.py"
CALLS = 50


def _same_every_call(fn, want, replays=CALLS):
    for i in range(replays):
        assert torch.equal(fn(), want), f"call {i} differs from the reduce launches' result"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = fn()
    for i in range(replays):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, want), f"graph replay {i} differs from the reduce launches' result"


@pytest.mark.parametrize("path", ["wordcol", "half2", "nibble"])
def test_gemv_fixup_bitwise(path):
    from revolta.kernels.quant.awq import awq_gemv
    from revolta.kernels.quant.common import device_facts
    from revolta.kernels.quant.gemv_nibble import nibble_gemv_config
    from revolta.kernels.quant.gemv_wordcol import wordcol_config
    from revolta.quant.config import WeightScheme
    from revolta.quant.formats import weight_format

    N, K, M = 12288, 2560, 2 if path == "nibble" else 1
    gen = torch.Generator(device="cuda").manual_seed(7)
    fmt = weight_format(WeightScheme("awq", 4, 32, False))
    t = {n: torch.empty(s.shape, dtype=s.dtype, device="cuda") for n, s in fmt.specs(N, K).items()}
    fmt.random_(t, K ** -0.5, gen)
    sms, arch = device_facts(torch.device("cuda"))
    x = torch.randn(M, K, device="cuda", generator=gen).half()
    bias = torch.randn(N, device="cuda", generator=gen).half()
    cfg = {"wordcol": wordcol_config(N, K, 32, sms, split=64), "half2": wordcol_config(N, K, 32, sms, half2=True,
                                                                                          rows=16, split=64),
           "nibble": nibble_gemv_config(M, N, K, 32, "awq", sms, arch)}[path]
    assert cfg["SPLIT_K"] > 1
    want = awq_gemv(x, t["qweight"], t["qzeros"], t["scales"], 32, bias, config=cfg)
    w = fmt.dequantize(t, torch.float32)
    ref = x.float() @ w.t() + bias.float()
    assert ((want.float() - ref).abs().max() / ref.abs().max()).item() < 2e-3
    _same_every_call(lambda: awq_gemv(x, t["qweight"], t["qzeros"], t["scales"], 32, bias,
                                      config=cfg | dict(FIXUP=True)), want)


@pytest.mark.parametrize("M", [1, 8])
def test_moe_fixup_bitwise(M):
    from revolta.kernels import moe as MOE
    from revolta.kernels.quant import moe as QMOE

    spec = importlib.util.spec_from_file_location("_bench_quant_moe", BENCH)
    bq = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bq)
    gen = torch.Generator(device="cuda").manual_seed(M)
    (gate_up, down), shared = bq.awq_bank(bq.E, bq.H, bq.I, "cuda", gen)
    ids, w = MOE.moe_route(torch.randn(M, bq.E, device="cuda", generator=gen), bq.TOPK,
                           shared_logits=torch.randn(M, device="cuda", generator=gen))
    for dt in (torch.float16, torch.bfloat16):
        x = torch.randn(M, bq.H, device="cuda", dtype=dt, generator=gen)
        cfg = QMOE.moe_wordcol_config(M, dt)
        want = QMOE.quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared, config=cfg | dict(FIXUP=False))
        _same_every_call(lambda: QMOE.quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared,
                                                      config=cfg | dict(FIXUP=True)), want, 20)

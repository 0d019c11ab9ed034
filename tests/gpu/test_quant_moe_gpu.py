"""On a GPU: the packed-expert MoE (kernels/quant/moe.py) at the real shapes (AWQ group 32, 512 experts of
2560 x 640 + the shared expert, top-10 + 1) against its torch reference in bf16 and fp16 (the default: the
group-factored path of moe_decode.py on sm80+), with the sm_70 launch config and the tile path in fp16, and captured in a CUDA graph that replays on new tokens and routing (no host sync inside)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_quant_moe.py"


def _bench():
    spec = importlib.util.spec_from_file_location("_bench_quant_moe", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("M", [1, 8, 40])
def test_awq_moe_real_shapes(M):
    from revolta.kernels import moe as MOE
    from revolta.kernels.quant import moe as QMOE

    bq = _bench()
    rel_err = bq.moe_hc().rel_err
    gen = torch.Generator(device="cuda").manual_seed(M)
    (gate_up, down), shared = bq.awq_bank(bq.E, bq.H, bq.I, "cuda", gen)
    logits = torch.randn(M, bq.E, device="cuda", generator=gen)
    ids, w = MOE.moe_route(logits, bq.TOPK, shared_logits=torch.randn(M, device="cuda", generator=gen))
    for dt in (torch.bfloat16, torch.float16):
        x = torch.randn(M, bq.H, device="cuda", dtype=dt, generator=gen)
        ref = QMOE.quant_fused_moe_ref(x, gate_up, down, ids, w, shared_expert=shared)
        assert rel_err(QMOE.quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared), ref) < 1e-2
    cfg70 = QMOE.quant_grouped_config(M, bq.TOPK + 1, bq.E + 1, arch=70)
    assert rel_err(QMOE.quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared, config=cfg70), ref) < 2e-3
    tile = QMOE.quant_grouped_config(M, bq.TOPK + 1, bq.E + 1, arch=90, nibble=False)  # the sm80+ default before
    assert rel_err(QMOE.quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared, config=tile), ref) < 2e-3
    assert bq.graph_check(gate_up, down, shared, M, torch.bfloat16, bq.H, bq.E, gen) < 1e-2

"""On a GPU: the packed-expert MoE (kernels/quant/moe.py) at the real shapes (AWQ group 32, 512 experts of
2560 x 640 + the shared expert, top-10 + 1) against its torch reference in bf16 and fp16 (the default: the
group-factored path of moe_decode.py on sm80+), with the sm_70 launch config, the tile path and (one token) the
fp16-pair walk in fp16, and captured in a CUDA graph that replays on new tokens and routing (no host sync inside)."""

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
    if M == 1:  # one token on the word-column walk's fp16 pairs (HALF2; x is fp16 here): fp16 partial sums
        h2 = QMOE.MOE_WORDCOL | dict(HALF2=True)
        assert rel_err(QMOE.quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared, config=h2), ref) < 2e-3
    else:  # several tokens on the word-column walk, a program row per (token, slot) pair: fp32 and fp16 pairs
        for name in ("wcp-r8-sk16-4", "wcp-h2-r32-sk8-2"):
            cfg = QMOE.quant_grouped_config(M, bq.TOPK + 1, bq.E + 1, arch=90) | bq.VARIANTS[name][1]
            got = QMOE.quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared, config=cfg)
            assert rel_err(got, ref) < 2e-3, name
    cfg70 = QMOE.quant_grouped_config(M, bq.TOPK + 1, bq.E + 1, arch=70)
    assert rel_err(QMOE.quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared, config=cfg70), ref) < 2e-3
    nib = QMOE.quant_grouped_config(M, bq.TOPK + 1, bq.E + 1, arch=90, nibble=True)  # the default above 40 tokens
    assert rel_err(QMOE.quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared, config=nib), ref) < 2e-3
    tile = QMOE.quant_grouped_config(M, bq.TOPK + 1, bq.E + 1, arch=90, nibble=False)  # the sm80+ default before
    assert rel_err(QMOE.quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared, config=tile), ref) < 2e-3
    assert bq.graph_check(gate_up, down, shared, M, torch.bfloat16, bq.H, bq.E, gen) < 1e-2


@pytest.mark.parametrize("M", [1, 8, 40])
def test_nvfp4_moe_default_path_matches_the_reference(M):
    """NVFP4 experts through quant_fused_moe's default config (on sm_90 the nibble path's 16-row tiles once gave
    relative errors ~3 here, so NVFP4 takes the tile path) and through a nibble config (64-row tiles)."""
    from revolta.kernels import moe as MOE
    from revolta.kernels.quant import moe as QMOE
    from revolta.quant.config import WeightScheme
    from revolta.quant.formats import weight_format

    bq = _bench()
    rel_err = bq.moe_hc().rel_err
    fmt = weight_format(WeightScheme("modelopt-nvfp4", 4, 16, True))
    gen = torch.Generator(device="cuda").manual_seed(M)
    E = 64

    def packed(n_out, n_in, lead=(), shards=1):
        t = {n: torch.empty((*lead, *s.shape), dtype=s.dtype, device="cuda")
             for n, s in fmt.specs(n_out, n_in, shards).items()}
        fmt.random_(t, n_in ** -0.5, gen)
        return fmt.kernel_weights(t)

    gate_up, down = packed(2 * bq.I, bq.H, (E,), 2), packed(bq.H, bq.I, (E,))
    ids, w = MOE.moe_route(torch.randn(M, E, device="cuda", generator=gen), 8)
    arch = torch.cuda.get_device_capability()
    nib = QMOE.quant_grouped_config(M, 8, E, arch=arch[0] * 10 + arch[1], nibble=True, layout="nvfp4")
    for dt in (torch.bfloat16, torch.float16):
        x = torch.randn(M, bq.H, device="cuda", dtype=dt, generator=gen)
        ref = QMOE.quant_fused_moe_ref(x, gate_up, down, ids, w)
        assert rel_err(QMOE.quant_fused_moe(x, gate_up, down, ids, w), ref) < 1e-2, dt
        assert rel_err(QMOE.quant_fused_moe(x, gate_up, down, ids, w, config=nib), ref) < 1e-2, dt


def _token_caller(bq, gate_up, down, shared, M, dt, gen):
    """(x, router logits, call): call(config) routes the logits (top-10 + the shared expert) and runs the packed MoE
    on x with that config; refill x and the logits in place for new tokens and routing."""
    from revolta.kernels import moe as MOE
    from revolta.kernels.quant import moe as QMOE

    x = torch.randn(M, bq.H, device="cuda", dtype=dt, generator=gen)
    logits = torch.randn(M, bq.E, device="cuda", generator=gen)
    shared_logits = torch.randn(M, device="cuda", generator=gen)

    def call(c):
        ids, w = MOE.moe_route(logits, bq.TOPK, shared_logits=shared_logits)
        return QMOE.quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared, config=c)

    return x, logits, call


def _assert_bitwise(call, new, base, x, logits, gen, times, tag, check=lambda: None):
    """call(new) equals call(base) bitwise on `times` new token sets and routings, eager, then replayed from a CUDA
    graph of call(new); check() after each phase."""
    for i in range(times):
        x.normal_(generator=gen)
        logits.normal_(generator=gen)
        assert torch.equal(call(new), call(base)), (*tag, i)
    check()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = call(new)
    for i in range(times):
        x.normal_(generator=gen)
        logits.normal_(generator=gen)
        g.replay()
        assert torch.equal(y, call(base)), (*tag, "graph", i)
    check()


@pytest.mark.parametrize("M", [1, 8, 40])
def test_awq_moe_fixup_is_bitwise_the_reduce_launches(M):
    """The word-column MoE's reduces inside its kernels (FIXUP: act formed by each gate_up tile's last K slice, the
    slots summed by each (token, down tile)'s last program; release / acquire counters, programs finishing in any
    order) against the split-act and slot-sum launches: bitwise equal over 20 new token sets and routings, eager and
    replayed from a CUDA graph, in fp16 and bf16, and the weights' counters back at 0."""
    import dataclasses

    from revolta.kernels.quant import moe as QMOE

    bq = _bench()
    gen = torch.Generator(device="cuda").manual_seed(M + 7)
    (gate_up, down), shared = bq.awq_bank(bq.E, bq.H, bq.I, "cuda", gen)
    gate_up = dataclasses.replace(gate_up, counters=torch.zeros(4096, dtype=torch.int32, device="cuda"))

    def counters_at_zero():
        assert not gate_up.counters.any()

    for dt in (torch.float16, torch.bfloat16):
        cfg = QMOE.quant_grouped_config(M, bq.TOPK + 1, bq.E + 1, arch=90, layout="awq", dtype=dt)
        assert cfg["WORDCOL"]
        x, logits, call = _token_caller(bq, gate_up, down, shared, M, dt, gen)
        _assert_bitwise(call, cfg | dict(FIXUP=True), cfg | dict(FIXUP=False), x, logits, gen, 20, (dt,),
                        counters_at_zero)


@pytest.mark.parametrize("M", [1, 8, 40])
def test_awq_moe_joint_walk_and_pdl_chain_are_bitwise_the_default(M):
    """The word-column MoE with gate and up in one walk (JOINT), its launches chained by programmatic dependent launch
    (PDL: each grid may start before the one it reads has finished and waits inside, on sm_90) and 64-feature
    split-act / slot-sum programs, with and without the reduces inside the kernels: bitwise the same config without
    them over 10 new token sets and routings, eager and replayed from a CUDA graph, fp16 and bf16."""
    from revolta.kernels.quant import moe as QMOE

    bq = _bench()
    gen = torch.Generator(device="cuda").manual_seed(M + 11)
    (gate_up, down), shared = bq.awq_bank(bq.E, bq.H, bq.I, "cuda", gen)
    for dt in (torch.float16, torch.bfloat16):
        cfg = QMOE.quant_grouped_config(M, bq.TOPK + 1, bq.E + 1, arch=90, layout="awq", dtype=dt)
        assert cfg["WORDCOL"] and cfg["HALF2"]
        x, logits, call = _token_caller(bq, gate_up, down, shared, M, dt, gen)
        for fixup in (False, True):
            base = {k: v for k, v in cfg.items() if k not in ("JOINT", "PDL", "ACT_BLOCK", "SUM_BLOCK")}
            base["FIXUP"] = fixup
            new = base | dict(JOINT=True, PDL=True, ACT_BLOCK=64, SUM_BLOCK=64)
            _assert_bitwise(call, new, base, x, logits, gen, 10, (dt, fixup))

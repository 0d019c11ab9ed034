"""On a GPU: every hot-path kernel against its torch reference at the real model's shapes.

The CPU tests (tests/kernels) check the same kernels under TRITON_INTERPRET=1 on small shapes;
here the compiled kernels run with the real head counts and widths (GDN H=16 / HV=48 / K=V=128,
QSA 24 q heads / 2 KV heads / D=256 with the 4 x 128 indexer, MoE 512 experts of 2560 x 640, HC
2560 x 4 streams with rank 320), also with the sm_70 launch configurations in fp16. The GDN and
QSA checks are the benchmark scripts' own correctness stages (benchmarks/bench_gdn.py,
bench_qsa.py), so a benchmark row is never timed on a kernel this test would fail.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def test_gdn_kernels_real_shapes():
    """Chunked prefill (varlen, slot pool), decode, verify, commit and replay (bitwise), bf16 and
    fp16, plus the sm_70 launch configs in fp16."""
    gdn = _bench("bench_gdn")
    gdn.correctness()
    gdn.v100_configs()
    assert not gdn.RESULTS["errors"], gdn.RESULTS["errors"]
    failed = [c for c in gdn.RESULTS["checks"] if not c["ok"]]
    assert gdn.RESULTS["checks"] and not failed, failed


def test_qsa_select_and_sparse_decode_real_shapes():
    """Indexer top-budget selection and sparse paged decode over 3,000-token contexts, fp16 and
    fp8-e4m3 KV, 1 and 5 query rows per request."""
    qsa = _bench("bench_qsa")
    out = qsa.check_correctness("cuda")
    assert out and all(r["ok"] for r in out), out


@pytest.mark.parametrize("M", [1, 8, 300])
def test_moe_real_shapes(M):
    """Routing (top-10 of 512 + the shared expert) and the fused grouped expert MLP, bf16, and the
    sm_70 configs in fp16."""
    from revolta.kernels import moe as MOE
    H, I, E, TOPK = 2560, 640, 512, 10
    gen = torch.Generator(device="cuda").manual_seed(M)
    w1 = torch.randn(E + 1, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=gen) * H ** -0.5
    w2 = torch.randn(E + 1, H, I, device="cuda", dtype=torch.bfloat16, generator=gen) * I ** -0.5
    x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(M, E, device="cuda", generator=gen)
    shared = torch.randn(M, device="cuda", generator=gen)
    ids, w = MOE.moe_route(logits, TOPK, shared_logits=shared)
    ids_ref, w_ref = MOE.moe_route_ref(logits, TOPK, shared_logits=shared)
    assert torch.equal(ids, ids_ref)
    assert (w - w_ref).abs().max().item() < 1e-6
    ref = MOE.fused_moe_ref(x, w1, w2, ids, w)
    assert rel_err(MOE.fused_moe(x, w1, w2, ids, w, path="triton"), ref) < 1e-2
    x16, w1h, w2h = x.half(), w1.half(), w2.half()
    ref16 = MOE.fused_moe_ref(x16, w1h, w2h, ids, w)
    cfg70 = MOE.moe_config(M, TOPK + 1, E + 1, arch=70)
    assert rel_err(MOE.fused_moe(x16, w1h, w2h, ids, w, path="triton", config=cfg70), ref16) < 2e-3


@pytest.mark.parametrize("dot", [False, True], ids=["rows", "dot"])
def test_hc_read_rows_in_a_graph_real_shapes(dot):
    """The small-M HC read (rows kernels, or their tl.dot passes of kernels/hc_dot.py; on sm90 the mix and
    up launches wait on the previous grid through programmatic dependent launch) captured in a CUDA graph
    and replayed on new inputs: a missing wait reads the previous replay's partial sums (bench_moe_hc.py
    reports whether a row alone is bitwise the same row among 8)."""
    from revolta.kernels import hc as HC
    D, NH, R, M = 2560, 4, 320, 8
    cfg = HC.hc_config(M, D, R, NH, arch=HC._arch(torch.empty(0, device="cuda")), dot=dot)
    assert cfg["KIND"] == "rows" and cfg["DOWN"] == cfg["UP"] == ("dot" if dot else "rows")
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(*s, device="cuda", generator=g, dtype=torch.bfloat16) * s[-1] ** -0.5
          for s in ((NH * D,), (R, NH * D), (NH * D, R), (NH, NH * D))]
    x = torch.randn(M, NH * D, device="cuda", generator=g, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        HC.hc_read(x, *ws, NH, 1e-6, config=cfg)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        u, inj = HC.hc_read(x, *ws, NH, 1e-6, config=cfg)
    for _ in range(3):
        x.copy_(torch.randn(M, NH * D, device="cuda", generator=g, dtype=torch.bfloat16) * 3)
        graph.replay()
        u_ref, inj_ref = HC.hc_read_ref(x, *ws, NH, 1e-6)
        assert rel_err(u, u_ref) < 1e-2 and rel_err(inj, inj_ref) < 1e-2


@pytest.mark.parametrize("M", [1, 5, 16, 64, 1000])
def test_hyperconnection_and_norms_real_shapes(M):
    """HC read (bf16, and the sm_70 config in fp16), HC write bitwise, the (1+w) RMSNorm over 2560
    and the gated RMSNorm over 48 heads x 128."""
    from revolta.kernels import hc as HC
    from revolta.kernels import norm as NORM
    from revolta.layers.hyperconnection import HyperConnection
    D, NH, R = 2560, 4, 320
    torch.manual_seed(M)
    m = HyperConnection(D, NH, R, 1e-6).cuda().to(torch.bfloat16)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    ws = (m.hc_norm.weight.detach(), m.input_mix_weight_down.weight.detach(), m.input_mix_weight_up.weight.detach(),
          m.block_inject_weight.weight.detach())
    x = torch.randn(M, NH * D, device="cuda", dtype=torch.bfloat16) * 2
    u, inj = HC.hc_read(x, *ws, NH, 1e-6, path="triton")
    u_ref, inj_ref = HC.hc_read_ref(x, *ws, NH, 1e-6)
    assert rel_err(u, u_ref) < 1e-2 and rel_err(inj, inj_ref) < 1e-2
    xh, wh = x.half(), [w.half() for w in ws]
    u70, _ = HC.hc_read(xh, *wh, NH, 1e-6, path="triton", config=HC.hc_config(M, D, R, NH, arch=70))
    assert rel_err(u70, HC.hc_read_ref(xh, *wh, NH, 1e-6)[0]) < 2e-3
    out = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(HC.hc_combine(x, inj, out), HC.hc_combine_ref(x, inj, out))  # compiled without FMA fusion
    h = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
    w_norm = torch.randn(D, device="cuda", dtype=torch.bfloat16) * 0.1
    assert rel_err(NORM.zc_rms_norm(h, w_norm, 1e-6), NORM.zc_rms_norm_ref(h, w_norm, 1e-6)) < 1e-2
    o, z = (torch.randn(M * 48, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    w_gate = torch.randn(128, device="cuda", dtype=torch.float16) * 0.1
    got = NORM.gated_rms_norm(o, w_gate, z, 1e-6)
    assert not got.isnan().any()
    assert rel_err(got, NORM.gated_rms_norm_ref(o, w_gate, z, 1e-6)) < 2e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("M", [1, 5, 8])
def test_decode_fusions_real_shapes(M, dtype):
    """Issue 19's decode fusions: the HC write inside the next read's down pass, captured in a CUDA graph and
    replayed on new inputs (programmatic dependent launch on sm90: the up pass must read the written residual),
    bitwise the two launches; QSA's norm + RoPE and the GDN gates against their references."""
    from revolta.kernels import hc as HC
    from revolta.kernels.gdn.gates import gdn_gates, gdn_gates_ref
    from revolta.kernels.norm_rope import zc_norm_rope, zc_norm_rope_ref
    D, NH, R = 2560, 4, 320
    g = torch.Generator(device="cuda").manual_seed(M)

    def randn(*s, scale=1.0):
        return torch.randn(*s, device="cuda", generator=g).mul(scale).to(dtype)

    ws = [randn(*s, scale=s[-1] ** -0.5) for s in ((NH * D,), (R, NH * D), (NH * D, R), (NH, NH * D))]
    x, inject, u = randn(M, NH * D, scale=2), randn(M, NH).abs(), randn(M, D)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        HC.hc_combine_read(x, inject, u, *ws, NH, 1e-6)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, out, inj = HC.hc_combine_read(x, inject, u, *ws, NH, 1e-6)
    for _ in range(3):
        for t, s in ((x, 2.0), (u, 1.0)):
            t.copy_(randn(*t.shape, scale=s))
        graph.replay()
        y_ref = HC.hc_combine_once_ref(x, inject, u)  # rounded once, whether or not the compiler contracts an FMA
        out_ref, inj_ref = HC.hc_read(y_ref, *ws, NH, 1e-6)
        assert torch.equal(y, y_ref)
        assert torch.equal(out, out_ref) and torch.equal(inj, inj_ref)
    cos, sin = torch.rand(M, 64, device="cuda", generator=g), torch.rand(M, 64, device="cuda", generator=g)
    for H, Dh in ((24, 256), (2, 256), (4, 128)):
        qg, w = randn(M, H, 2 * Dh, scale=3), randn(Dh, scale=0.2)
        got, ref = zc_norm_rope(qg[..., :Dh], w, 1e-6, cos, sin), zc_norm_rope_ref(qg[..., :Dh], w, 1e-6, cos, sin)
        assert rel_err(got, ref) < 1e-2
    a, b = randn(M, 48, scale=4), randn(M, 48, scale=4)
    A_log, dt_bias = torch.rand(48, device="cuda", generator=g) * 2.7, torch.rand(48, device="cuda", generator=g) - 4
    for got, ref in zip(gdn_gates(a, b, A_log, dt_bias), gdn_gates_ref(a, b, A_log, dt_bias)):
        torch.testing.assert_close(got, ref, atol=0, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gdn_pipelined_prefill_is_bitwise_one_piece(dtype):
    """One sequence at the real GDN shape as 2 and 4 pipelined pieces on their three streams (the walk of piece i
    beside piece i+1's intra and i-1's output stage), eagerly and replayed from a CUDA graph on new inputs: outputs
    and the final state equal the one-piece call bitwise (a missing event between the streams shows up here)."""
    import dataclasses

    from revolta.kernels.gdn.chunk import chunk_config, gdn_chunk_prefill
    H, HV, K, V, T = 16, 48, 128, 128, 4096 + 37
    gen = torch.Generator(device="cuda").manual_seed(5)

    def inputs():
        q, k = (torch.randn(T, H, K, device="cuda", generator=gen).to(dtype) for _ in range(2))
        v = torch.randn(T, HV, V, device="cuda", generator=gen).to(dtype)
        g = -torch.rand(T, HV, device="cuda", generator=gen) * 0.7
        beta = torch.rand(T, HV, device="cuda", generator=gen)
        return q, k, v, g, beta

    pool0 = torch.randn(4, HV, K, V, device="cuda", generator=gen) * 0.5
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    slots = torch.tensor([2], dtype=torch.int32, device="cuda")
    init = torch.tensor([True], device="cuda")
    x = inputs()
    pool = pool0.clone()
    one_piece = dataclasses.replace(chunk_config(K, V, 90), pipeline_pieces=0)
    o_ref = gdn_chunk_prefill(*x, cu, pool, slots, init, config=one_piece)
    for pieces in (2, 4):
        config = dataclasses.replace(chunk_config(K, V, 90), pipeline_pieces=pieces, pipeline_min_chunks=2)
        pool_p = pool0.clone()
        o = gdn_chunk_prefill(*x, cu, pool_p, slots, init, config=config)
        torch.cuda.synchronize()
        assert torch.equal(o, o_ref) and torch.equal(pool_p, pool), f"{pieces} pieces, eager"
        static = [t.clone() for t in x]
        pool_g = pool0.clone()
        gdn_chunk_prefill(*static, cu, pool_g, slots, init, config=config)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_g = gdn_chunk_prefill(*static, cu, pool_g, slots, init, config=config)
        y = inputs()
        for t, new in zip(static, y):
            t.copy_(new)
        pool_g.copy_(pool0)
        graph.replay()
        pool_y = pool0.clone()
        o_y = gdn_chunk_prefill(*y, cu, pool_y, slots, init, config=one_piece)
        torch.cuda.synchronize()
        assert torch.equal(o_g, o_y) and torch.equal(pool_g, pool_y), f"{pieces} pieces, graph replay"


def test_gdn_pipelined_mixed_batch_is_bitwise_one_piece():
    """A long prompt (8,229 tokens) between decode rows with the host's cu_seqlens, as the engine's mixed steps pass
    them: the default pipelines it (2 pieces, the decode rows in the first and last) on its streams; outputs and
    every slot equal the one-piece call bitwise, bf16."""
    import dataclasses

    from revolta.kernels.gdn.chunk import chunk_config, gdn_chunk_prefill
    H, HV, K, V, lens = 16, 48, 128, 128, [1, 1, 8192 + 37, 1]
    T, gen = sum(lens), torch.Generator(device="cuda").manual_seed(6)
    q, k = (torch.randn(T, H, K, device="cuda", generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(T, HV, V, device="cuda", generator=gen).bfloat16()
    g = -torch.rand(T, HV, device="cuda", generator=gen) * 0.7
    beta = torch.rand(T, HV, device="cuda", generator=gen)
    host = [0, 1, 2, T - 1, T]
    cu = torch.tensor(host, dtype=torch.int32, device="cuda")
    slots = torch.tensor([3, 0, 5, 2], dtype=torch.int32, device="cuda")
    init = torch.tensor([True, False, True, True], device="cuda")
    pool0 = torch.randn(6, HV, K, V, device="cuda", generator=gen) * 0.5
    default = chunk_config(K, V, 90)
    assert default.pipeline_plan(host, HV, 132) is not None
    pool_a, pool_b = pool0.clone(), pool0.clone()
    o_a = gdn_chunk_prefill(q, k, v, g, beta, cu, pool_a, slots, init,
                            config=dataclasses.replace(default, pipeline_pieces=0))
    o_b = gdn_chunk_prefill(q, k, v, g, beta, cu, pool_b, slots, init, config=default, host_cu_seqlens=host)
    torch.cuda.synchronize()
    assert torch.equal(o_a, o_b) and torch.equal(pool_a, pool_b)

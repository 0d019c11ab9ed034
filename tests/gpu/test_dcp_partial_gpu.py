"""On one GPU (no NCCL): DCP's Triton partial attention at the real shapes (issue 23).

The real model at TP4 + DCP2 (or TP8 + DCP4): a DCP group's ranks gather their queries, 2 x 6 (4 x 3) = 12 heads
on one KV head, D = 256, c = 4, budget 512 groups, 64-token blocks held as 64 / dcp-token pages per rank. Here one
process plays every rank of the group: the full cache is striped (token t on rank t % dcp), each rank's
`attend_rows_partial` is checked against the torch reference on the same selection, and the ranks' partials merged
(`merge_partials`) and gated equal the single-process `attend_rows` over the whole cache. Rows: decode rows of a
first token (ranks > 0 hold nothing), a 2-token sequence, short, medium and long (sparse) contexts, and a 5-row
verify chunk. fp16 / bf16 / E4M3 / int8 K/V. Then the decode path as DCPAttention runs it (`qsa_partial`: rows,
selection, attention; every rank; merge) captured in a CUDA graph and replayed on new queries.
Run: `pytest -m gpu tests/gpu/test_dcp_partial_gpu.py -v` (seconds).
"""

from __future__ import annotations

import pytest
import torch

from revolta.kernels.qsa import store_kv_ref
from revolta.kernels.qsa.common import dequant_cache_ref, varlen_rows
from revolta.kernels.qsa.dcp import attend_partial_rows_ref, attend_rows_partial, merge_partials, qsa_partial
from revolta.kernels.qsa.prefill import select_step_rows
from revolta.kernels.qsa.sparse_attn import attend_rows

pytestmark = pytest.mark.gpu
HQ, KVH, D, HI, DI, C, BUDGET, PAGE = 12, 1, 256, 4, 128, 4, 512, 64
LENGTHS, QLENS = [1, 2, 333, 5000, 40_000], [1, 1, 1, 1, 5]
SCALE = D**-0.5
DEV = "cuda"


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def world(kv_dtype, dtype, seed=0):
    dev = torch.device(DEV)
    g = torch.Generator(device=dev).manual_seed(seed)
    need = [-(-n // PAGE) for n in LENGTHS]
    nb = sum(need) + 1
    perm = torch.randperm(nb - 1, device=dev, generator=g) + 1
    table = torch.zeros(len(LENGTHS), max(need), dtype=torch.int32, device=dev)
    used = 0
    for b, k in enumerate(need):
        table[b, :k] = perm[used:used + k].int()
        used += k
    k = torch.randn(nb * PAGE, KVH, D, device=dev, generator=g).to(dtype)
    v = torch.randn(nb * PAGE, KVH, D, device=dev, generator=g).to(dtype)
    cdt = {"auto": dtype, "fp8_e4m3": torch.uint8, "int8": torch.int8}[kv_dtype]
    kc = torch.zeros(nb, PAGE, KVH, D, dtype=cdt, device=dev)
    vc = torch.zeros_like(kc)
    ks = vs = None
    if kv_dtype == "fp8_e4m3":
        ks, vs = k.float().abs().max().reshape(1) / 448, v.float().abs().max().reshape(1) / 448
    elif kv_dtype == "int8":
        ks, vs = torch.zeros(nb, PAGE, KVH, device=dev), torch.zeros(nb, PAGE, KVH, device=dev)
    store_kv_ref(k, v, kc, vc, torch.arange(nb * PAGE, device=dev), kv_dtype, ks, vs)
    T = sum(QLENS)
    icache = torch.randn(nb, PAGE // C, DI, device=dev, generator=g).to(dtype)
    q = torch.randn(T, HQ, D, device=dev, generator=g).to(dtype)
    gate = torch.randn(T, HQ, D, device=dev, generator=g).to(dtype)
    iq = torch.randn(T, HI, DI, device=dev, generator=g).to(dtype)
    cu = torch.tensor([0] + QLENS, device=dev).cumsum(0).int()
    seq = torch.tensor(LENGTHS, dtype=torch.int32, device=dev)
    return dict(kc=kc, vc=vc, ks=ks, vs=vs, table=table, icache=icache, q=q, gate=gate, iq=iq, cu=cu, seq=seq,
                kv_dtype=kv_dtype)


def stripe(w, dcp, rank):
    """A rank's pages (and int8 per-token scales; E4M3's per-tensor scale is shared)."""
    one = (lambda x: x if x is None or x.dim() == 1 else x[:, rank::dcp].contiguous())
    return tuple(one(w[n]) for n in ("kc", "vc", "ks", "vs"))


@pytest.mark.parametrize("dcp", [2, 4])
@pytest.mark.parametrize("kv_dtype,dtype", [("auto", torch.float16), ("auto", torch.bfloat16),
                                            ("fp8_e4m3", torch.float16), ("int8", torch.bfloat16)])
def test_partials_match_ref_and_merge_to_attend_rows(kv_dtype, dtype, dcp):
    w = world(kv_dtype, dtype)
    row_req, row_pos = varlen_rows(w["cu"], w["seq"], w["q"].shape[0])
    sel = select_step_rows(w["iq"], w["icache"], w["table"], w["seq"], row_req, row_pos, BUDGET, C)
    assert int((sel >= 0).sum(1).max()) == BUDGET  # the long context is past the sparse onset
    outs, lses = [], []
    for r in range(dcp):
        kr, vr, ksr, vsr = stripe(w, dcp, r)
        out, lse = attend_rows_partial(w["q"], kr, vr, w["table"], w["seq"], sel, row_req, row_pos, SCALE, kv_dtype,
                                       ksr, vsr, C, 1, True, dcp, r)
        kf, vf = dequant_cache_ref(kr, kv_dtype, ksr), dequant_cache_ref(vr, kv_dtype, vsr)
        for b in range(len(LENGTHS)):
            rows = row_req == b
            ro, rl = attend_partial_rows_ref(w["q"][rows], kf, vf, w["table"][b], sel[rows], row_pos[rows], SCALE, C,
                                             dcp, r)
            assert torch.equal(torch.isinf(lse[rows]), torch.isinf(rl)), (r, b)
            fin = torch.isfinite(rl)
            assert ((lse[rows][fin] - rl[fin]).abs() < 2e-2).all(), (r, b)
            assert rel_err(out[rows], ro) < 2e-2, (r, b, rel_err(out[rows], ro))
        assert torch.isinf(lse[row_pos < r]).all() and (out[row_pos < r] == 0).all()  # rows without this rank's tokens
        outs.append(out)
        lses.append(lse)
    merged = merge_partials(torch.stack(outs), torch.stack(lses)) * torch.sigmoid(w["gate"].float())
    whole = attend_rows(w["q"], w["gate"], w["kc"], w["vc"], w["table"], w["seq"], sel, row_req, row_pos, SCALE,
                        kv_dtype, w["ks"], w["vs"], C, 1, True)
    err = rel_err(merged, whole)
    print(f"dcp {dcp} {kv_dtype} {dtype}: merged partials vs attend_rows rel err {err:.2e}")
    assert err < (1e-2 if dtype == torch.float16 else 2e-2)


@pytest.mark.parametrize("dcp", [2, 4])
def test_decode_path_in_a_cuda_graph(dcp):
    """Every rank's qsa_partial (rows, selection, attention) and the merge, captured once and replayed on new queries:
    no host sync in the path (capture would fail), and the replay equals the eager computation."""
    w = world("fp8_e4m3", torch.float16, seed=1)
    ranks = [stripe(w, dcp, r) for r in range(dcp)]
    q_in, iq_in = w["q"].clone(), w["iq"].clone()

    def step():
        parts = [qsa_partial(q_in, kr, vr, w["table"], w["cu"], w["seq"], SCALE, BUDGET, iq_in, w["icache"], dcp, r,
                             "fp8_e4m3", ksr, vsr, C) for r, (kr, vr, ksr, vsr) in enumerate(ranks)]
        return merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compile + warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for seed in (2, 3):
        g = torch.Generator(device="cuda").manual_seed(seed)
        q_in.copy_(torch.randn(q_in.shape, device="cuda", generator=g).half())
        iq_in.copy_(torch.randn(iq_in.shape, device="cuda", generator=g).half())
        graph.replay()
        want = step()
        torch.cuda.synchronize()
        assert torch.equal(static_out, want), (static_out - want).abs().max()
        whole = attend_rows(q_in, torch.full_like(q_in, 30.0), w["kc"], w["vc"], w["table"], w["seq"],
                            select_step_rows(iq_in, w["icache"], w["table"], w["seq"],
                                             *varlen_rows(w["cu"], w["seq"], q_in.shape[0]), BUDGET, C),
                            *varlen_rows(w["cu"], w["seq"], q_in.shape[0]), SCALE, "fp8_e4m3", w["ks"], w["vs"], C, 1,
                            True)  # gate 30: sigmoid = 1 in fp16, the un-gated single-process output
        assert rel_err(static_out, whole) < 1e-2

"""MoE kernels (revolta.kernels.moe) vs their torch references, the references vs the layer, sm70/sm90 builds."""

import pytest
import torch

from revolta.kernels import moe as K
from revolta.kernels import moe_grouped as G
from revolta.kernels.ops import kernel_ops
from revolta.layers.moe import MoE

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=4e-3, rtol=4e-3)}
H, I, E, TOP_K = 64, 32, 8, 2


pytestmark = pytest.mark.usefixtures("poison")  # tests/kernels/conftest.py


def _weights(dtype, num_experts=E, seed=0):
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(num_experts, 2 * I, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(num_experts, H, I, generator=g) / I**0.5).to(dtype)
    return w1, w2


def _route(M, seed=1, skew=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(M, E, generator=g)
    if skew:  # most tokens pick experts 0 and 1: many rows per expert
        logits[:, :2] += 4
    return K.moe_route_ref(logits, TOP_K)


@pytest.mark.parametrize("M", [1, 5, 63])
@pytest.mark.parametrize("shared", [False, True])
def test_route(M, shared):
    g = torch.Generator().manual_seed(M)
    logits = torch.randn(M, E, generator=g)
    shared_logits = torch.randn(M, generator=g) if shared else None
    ids, w = K.moe_route(logits, TOP_K, shared_logits=shared_logits)
    ids_ref, w_ref = K.moe_route_ref(logits, TOP_K, shared_logits=shared_logits)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-6)
    # fp16 logits, strided rows (a view into a wider matmul output)
    wide = torch.randn(M, E + 3, generator=g).half()
    ids, w = K.moe_route(wide[:, :E], TOP_K)
    ids_ref, w_ref = K.moe_route_ref(wide[:, :E], TOP_K)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-6)


def test_route_ref_matches_layer():
    torch.manual_seed(0)
    moe = MoE(H, E, TOP_K, I, I)
    x = torch.randn(7, H)
    ids, w = moe.route(x)
    ids_ref, w_ref = K.moe_route_ref(moe.gate(x), TOP_K)
    assert torch.equal(ids.int(), ids_ref) and torch.equal(w, w_ref)


@pytest.mark.parametrize("M", [1, 5, 63])
@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align(M, block_m):
    ids, _ = _route(M, skew=M == 63)
    s, e, n = K.moe_align(ids, E, block_m)
    s_ref, e_ref, n_ref = K.moe_align_ref(ids, E, block_m)
    assert torch.equal(n, n_ref)
    total = int(n_ref)
    assert s.shape == s_ref.shape and e.shape == e_ref.shape
    assert torch.equal(e, e_ref)  # -1 past the end as well
    # slots inside one expert group may come in any order; padding entries are M·k
    assert total % block_m == 0 and int((e_ref >= 0).sum()) == total // block_m
    for ex in range(E):
        rows = (e_ref == ex).nonzero().flatten()
        if len(rows):
            got = torch.cat([s[r * block_m:(r + 1) * block_m] for r in rows.tolist()])
            ref = torch.cat([s_ref[r * block_m:(r + 1) * block_m] for r in rows.tolist()])
            assert sorted(got.tolist()) == sorted(ref.tolist()), ex


def _shared(dtype, seed=3):
    """The shared expert's own tensors: gate [I, H], up [I, H], down [H, I]."""
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(I, H, generator=g) / H**0.5).to(dtype), (torch.randn(I, H, generator=g) / H**0.5).to(dtype),
            (torch.randn(H, I, generator=g) / I**0.5).to(dtype))


def _route_shared(M, num_experts, top_k, seed=1, skew=False):
    """top-k of num_experts plus the shared slot (id num_experts); skew: experts 0..2 get most rows."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(M, num_experts, generator=g)
    if skew:
        logits[:, :3] += 4
    return K.moe_route_ref(logits, top_k, shared_logits=torch.randn(M, generator=g))


PAIRS_CONFIGS = {  # the pairs kernels: GEMV-like (no tl.dot) and tl.dot tiles, small tiles for the test shapes
    "bm1": dict(GROUPED=False, BLOCK_M=1, BLOCK_N_UP=16, BLOCK_K_UP=32, BLOCK_N_DOWN=32, BLOCK_K_DOWN=16, USE_DOT=False, num_warps=4, num_stages=2),
    "bm4": dict(GROUPED=False, BLOCK_M=4, BLOCK_N_UP=16, BLOCK_K_UP=32, BLOCK_N_DOWN=32, BLOCK_K_DOWN=16, USE_DOT=False, num_warps=4, num_stages=2),
    "dot16": dict(GROUPED=False, BLOCK_M=16, BLOCK_N_UP=16, BLOCK_K_UP=32, BLOCK_N_DOWN=32, BLOCK_K_DOWN=16, USE_DOT=True, num_warps=4, num_stages=2),
}


@pytest.mark.parametrize("cfg,M,dtype", [
    ("bm1", 5, torch.float32), ("bm1", 5, torch.float16), ("bm4", 5, torch.float32), ("bm4", 63, torch.float16),
    ("dot16", 5, torch.float16), ("dot16", 63, torch.float32), ("dot16", 63, torch.float16)], ids=str)
def test_fused_moe_pairs(M, dtype, cfg):
    """The prefill kernels (and sm70's GEMV tiles below 12 rows per expert); M = 63 skews the routing."""
    w1, w2 = _weights(dtype)
    ids, w = _route(M, skew=M == 63)
    x = torch.randn(M, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = K.fused_moe(x, w1, w2, ids, w, path="triton", config=PAIRS_CONFIGS[cfg])
    ref = K.fused_moe_ref(x, w1, w2, ids, w)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_fused_moe_pairs_shared_expert():
    w1, w2 = _weights(torch.float16)
    shared = _shared(torch.float16)
    ids, w = _route_shared(21, E, TOP_K)
    x = torch.randn(21, H).half()
    ref = K.fused_moe_ref(x, w1, w2, ids, w, shared_expert=shared)
    for cfg in ("bm4", "dot16"):
        out = K.fused_moe(x, w1, w2, ids, w, path="triton_pairs", config=PAIRS_CONFIGS[cfg], shared_expert=shared)
        torch.testing.assert_close(out, ref, **TOL[torch.float16])


@pytest.mark.parametrize("M", [1, 3, 8, 40])
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (16, 4)])
def test_group(M, num_experts, top_k):
    """moe_group == its reference exactly (shared slot, experts repeated across rows, skewed routing)."""
    ids, _ = _route_shared(M, num_experts, top_k, seed=M, skew=M == 40)
    num_slots = min(M * (top_k + 1), num_experts + 1)
    got = G.moe_group(ids, num_slots)
    ref = G.moe_group_ref(ids, num_slots)
    for name, a, b in zip(("order", "slot_expert", "slot_start", "slot_end"), got, ref):
        assert torch.equal(a, b), (name, a, b)
    # what the reference promises: slot s holds the s-th distinct expert and exactly its pairs, ascending
    order, slot_expert, start, end = (t.tolist() for t in ref)
    flat = ids.flatten().tolist()
    experts = sorted(set(flat))
    assert slot_expert == experts + [-1] * (num_slots - len(experts)) and sorted(order) == list(range(len(flat)))
    for s, e in enumerate(experts):
        assert order[start[s]:end[s]] == [p for p, pe in enumerate(flat) if pe == e], (s, e)


GROUPED_CONFIGS = {  # tl.dot (sm80+), the one-row GEMV and broadcast FMA (sm70), small tiles for the test shapes
    "dot16": dict(GROUPED=True, BLOCK_M=16, BLOCK_N_UP=16, BLOCK_K_UP=32, BLOCK_N_DOWN=32, BLOCK_K_DOWN=16, USE_DOT=True, num_warps=4, num_stages=2),
    "gemv": dict(GROUPED=True, BLOCK_M=1, BLOCK_N_UP=16, BLOCK_K_UP=32, BLOCK_N_DOWN=16, BLOCK_K_DOWN=32, USE_DOT=False, num_warps=4, num_stages=2),
    "fma4": dict(GROUPED=True, BLOCK_M=4, BLOCK_N_UP=16, BLOCK_K_UP=32, BLOCK_N_DOWN=32, BLOCK_K_DOWN=16, USE_DOT=False, num_warps=4, num_stages=2),
}


@pytest.mark.parametrize("M,dtype,cfg,shared", [
    (1, torch.float32, "dot16", True), (1, torch.float16, "gemv", True), (3, torch.float16, "dot16", False),
    (3, torch.float32, "gemv", True), (8, torch.float16, "fma4", True), (8, torch.float32, "dot16", True),
    (40, torch.float16, "dot16", True), (40, torch.float32, "dot16", False)], ids=str)
def test_fused_moe_grouped(M, dtype, cfg, shared):
    """16 experts, top-4 (+ shared): rows share experts; at M = 8 and 40 experts 0..2 take most rows,
    so an expert's rows span several BLOCK_M chunks; H and I smaller than one K or N tile in places."""
    num_experts, top_k = 16, 4
    w1, w2 = _weights(dtype, num_experts)
    se = _shared(dtype) if shared else None
    if shared:
        ids, w = _route_shared(M, num_experts, top_k, seed=M, skew=M >= 8)
    else:
        g = torch.Generator().manual_seed(M)
        ids, w = K.moe_route_ref(torch.randn(M, num_experts, generator=g), top_k)
    x = torch.randn(M, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = K.fused_moe(x, w1, w2, ids, w, path="triton_grouped", config=GROUPED_CONFIGS[cfg], shared_expert=se)
    ref = K.fused_moe_ref(x, w1, w2, ids, w, shared_expert=se)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_fused_moe_auto_paths_and_torch_path():
    """path="auto" on CPU: the grouped kernels up to GROUPED_MAX_PAIRS pairs, the pairs kernels beyond;
    the torch path (per-expert loop) with and without the shared expert."""
    dtype = torch.float16
    w1, w2 = _weights(dtype)
    shared = _shared(dtype)
    assert K.moe_config(1, TOP_K + 1, E + 1)["GROUPED"] and not K.moe_config(K.GROUPED_MAX_PAIRS, 2, E)["GROUPED"]
    for M in (1, 5):
        ids, w = _route_shared(M, E, TOP_K, seed=M)
        x = torch.randn(M, H).to(dtype)
        ref = K.fused_moe_ref(x, w1, w2, ids, w, shared_expert=shared)
        torch.testing.assert_close(K.fused_moe(x, w1, w2, ids, w, shared_expert=shared), ref, **TOL[dtype])
        got = K.fused_moe_torch(x, w1, w2, ids, w, use_grouped_mm=False, shared_expert=shared)
        torch.testing.assert_close(got, ref, **TOL[dtype])
        ids, w = _route(M)
        torch.testing.assert_close(K.fused_moe_torch(x, w1, w2, ids, w, use_grouped_mm=False),
                                   K.fused_moe_ref(x, w1, w2, ids, w), **TOL[dtype])


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm missing")
def test_fused_moe_torch_grouped_mm_shared_expert():
    """torch._grouped_mm leaves the rows past the last group (the shared expert's pairs) unspecified;
    the shared expert's dense result replaces them."""
    bf16 = torch.bfloat16
    w1, w2 = _weights(bf16)
    shared = _shared(bf16)
    ids, w = _route_shared(9, E, TOP_K)
    x = torch.randn(9, H).to(bf16)
    got = K.fused_moe_torch(x, w1, w2, ids, w, use_grouped_mm=True, shared_expert=shared)
    torch.testing.assert_close(got, K.fused_moe_ref(x, w1, w2, ids, w, shared_expert=shared), atol=2e-2, rtol=2e-2)


def test_fused_moe_ref_matches_experts_and_moe_with_shared_expert():
    torch.manual_seed(0)
    moe = MoE(H, E, TOP_K, I, I)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    x = torch.randn(5, H)
    ids, w = moe.route(x)
    with torch.no_grad():
        torch.testing.assert_close(K.fused_moe_ref(x, moe.experts.gate_up_proj, moe.experts.down_proj, ids, w),
                                   moe.experts(x, ids, w), atol=0, rtol=0)
        # shared expert as expert number E with weight σ(w_sg·x): its own tensors, or stacked after the routed ones
        se = moe.shared_expert
        shared = (se.gate_proj.weight, se.up_proj.weight, se.down_proj.weight)
        w1 = torch.cat([moe.experts.gate_up_proj, torch.cat([se.gate_proj.weight, se.up_proj.weight])[None]])
        w2 = torch.cat([moe.experts.down_proj, se.down_proj.weight[None]])
        ids_s, w_s = K.moe_route(moe.gate(x), TOP_K, shared_logits=moe.shared_expert_gate(x)[:, 0])
        ref = moe(x)
        gu, dn = moe.experts.gate_up_proj, moe.experts.down_proj
        torch.testing.assert_close(K.fused_moe_ref(x, gu, dn, ids_s, w_s, shared_expert=shared), ref, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(K.fused_moe_ref(x, w1, w2, ids_s, w_s), ref, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(K.fused_moe(x, w1, w2, ids_s, w_s), ref, atol=1e-5, rtol=1e-5)
        # the layer on the Triton op table: routing, shared expert and experts in the fused launches
        unmerged = moe(x, ops=kernel_ops("triton"))
        torch.testing.assert_close(unmerged, ref, atol=1e-5, rtol=1e-5)
        # the router and the shared-expert gate as one GEMM: strided logit views into the routing kernel
        moe.merge_projections()
        assert moe.merged_router is not None and moe.gate.weight.data_ptr() == moe.merged_router.weight.data_ptr()
        torch.testing.assert_close(moe(x, ops=kernel_ops("triton")), unmerged, atol=1e-6, rtol=1e-6)

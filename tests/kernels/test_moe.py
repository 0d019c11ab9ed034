"""MoE kernels (revolta.kernels.moe) vs their torch references, the references vs the layer, sm70/sm90 builds."""

import pytest
import torch

from revolta.kernels import moe as K
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


CONFIGS = {  # the GEMV-like (no tl.dot) and tl.dot variants, small tiles for the test shapes
    "bm1": dict(BLOCK_M=1, BLOCK_N_UP=16, BLOCK_K_UP=32, BLOCK_N_DOWN=32, BLOCK_K_DOWN=16, USE_DOT=False, num_warps=4, num_stages=2),
    "bm4": dict(BLOCK_M=4, BLOCK_N_UP=16, BLOCK_K_UP=32, BLOCK_N_DOWN=32, BLOCK_K_DOWN=16, USE_DOT=False, num_warps=4, num_stages=2),
    "dot16": dict(BLOCK_M=16, BLOCK_N_UP=16, BLOCK_K_UP=32, BLOCK_N_DOWN=32, BLOCK_K_DOWN=16, USE_DOT=True, num_warps=4, num_stages=2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("M", [1, 5, 63])
@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_fused_moe(M, dtype, cfg):
    w1, w2 = _weights(dtype)
    ids, w = _route(M, skew=M == 63)
    x = torch.randn(M, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = K.fused_moe(x, w1, w2, ids, w, path="triton", config=CONFIGS[cfg])
    ref = K.fused_moe_ref(x, w1, w2, ids, w)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fused_moe_default_config_and_torch_path(dtype):
    w1, w2 = _weights(dtype)
    for M in (1, 5, 63):
        ids, w = _route(M)
        x = torch.randn(M, H).to(dtype)
        ref = K.fused_moe_ref(x, w1, w2, ids, w)
        torch.testing.assert_close(K.fused_moe(x, w1, w2, ids, w), ref, **TOL[dtype])
        torch.testing.assert_close(K.fused_moe_torch(x, w1, w2, ids, w, use_grouped_mm=False), ref, **TOL[dtype])


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
        # shared expert as expert number E with weight σ(w_sg·x): the whole block in one fused launch
        se = moe.shared_expert
        w1 = torch.cat([moe.experts.gate_up_proj, torch.cat([se.gate_proj.weight, se.up_proj.weight])[None]])
        w2 = torch.cat([moe.experts.down_proj, se.down_proj.weight[None]])
        ids_s, w_s = K.moe_route(moe.gate(x), TOP_K, shared_logits=moe.shared_expert_gate(x)[:, 0])
        ref = moe(x)
        torch.testing.assert_close(K.fused_moe_ref(x, w1, w2, ids_s, w_s), ref, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(K.fused_moe(x, w1, w2, ids_s, w_s), ref, atol=1e-5, rtol=1e-5)

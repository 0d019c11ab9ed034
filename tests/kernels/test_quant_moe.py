"""The packed-expert MoE kernels (kernels/quant/moe.py) against their torch reference under the interpreter, for
AWQ int4 (group 32, zero points), compressed-tensors int4 (symmetric, asymmetric, per channel) and NVFP4
(ModelOpt and compressed-tensors global scales): H 64, I 32, 8 experts, top-2 (+ the shared expert as expert 8),
M = 1, 3, 8 (40 with skewed routing, so an expert's rows span several BLOCK_M chunks), in the tl.dot tiles
(sm80+) and the FMA tiles (sm70; at M <= 3, where they are cheap under the interpreter); the large-M path; the reference against `QuantExperts`; and the MoE layer on
the Triton op table against its torch path."""

import pytest
import torch

from revolta.kernels import moe as K
from revolta.kernels.ops import kernel_ops
from revolta.kernels.quant.moe import PackedWeights, dequantize_ref, quant_fused_moe, quant_fused_moe_ref
from revolta.layers.linear import QuantLinear
from revolta.layers.moe import MoE
from revolta.layers.quant_moe import QuantExperts
from revolta.quant.config import WeightScheme
from revolta.quant.formats import weight_format

pytestmark = pytest.mark.usefixtures("poison")  # tests/kernels/conftest.py: unwritten outputs are NaN

H, I, E, TOP_K = 64, 32, 8, 2
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=1e-2, rtol=1e-2)}
SCHEMES = {  # name -> (format, group, symmetric)
    "awq": ("awq", 32, False), "ct_sym": ("ct-int4", 32, True), "ct_asym": ("ct-int4", 32, False),
    "ct_channel": ("ct-int4", -1, True), "nvfp4": ("modelopt-nvfp4", 16, True), "ct_nvfp4": ("ct-nvfp4", 16, True)}
CONFIGS = {  # small tiles for the test shapes: tl.dot (sm80+), one-row GEMV and broadcast FMA (sm70)
    "dot16": dict(BLOCK_M=16, BLOCK_N_UP=16, BLOCK_K_UP=64, BLOCK_N_DOWN=32, BLOCK_K_DOWN=32, USE_DOT=True,
                  num_warps=4, num_stages=2),
    "gemv": dict(BLOCK_M=1, BLOCK_N_UP=16, BLOCK_K_UP=128, BLOCK_N_DOWN=16, BLOCK_K_DOWN=32, USE_DOT=False,
                 num_warps=4, num_stages=2),
    "fma4": dict(BLOCK_M=4, BLOCK_N_UP=8, BLOCK_K_UP=32, BLOCK_N_DOWN=32, BLOCK_K_DOWN=16, USE_DOT=False,
                 num_warps=4, num_stages=2),
}


def _fmt(name):
    f, g, sym = SCHEMES[name]
    return weight_format(WeightScheme(f, 4, g, sym))


def _moe(name, seed=0, shared_packed=True):
    """An MoE layer (8 experts, top-2) whose routed experts and (unless shared_packed=False) shared expert are
    packed in `name`, filled with random packed values (router and gates: random fp32)."""
    torch.manual_seed(seed)
    moe = MoE(H, E, TOP_K, I, I)
    fmt = _fmt(name)
    moe.experts = QuantExperts(E, H, I, fmt)
    if shared_packed:
        se = moe.shared_expert
        se.gate_proj, se.up_proj, se.down_proj = (QuantLinear(H, I, False, fmt), QuantLinear(H, I, False, fmt),
                                                  QuantLinear(I, H, False, fmt))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        for mod, holders in [(moe.experts, [(moe.experts.gate_up_proj, H), (moe.experts.down_proj, I)])] + (
                [(m, [(m, m.in_features)]) for m in (se.gate_proj, se.up_proj, se.down_proj)] if shared_packed else []):
            for holder, fan_in in holders:
                t = holder.packed()
                fmt.random_(t, fan_in ** -0.5, gen)
                if hasattr(fmt, "global_scale"):  # NVFP4: one global scale per expert and projection, all different
                    t[fmt.global_scale].mul_(torch.rand(t[fmt.global_scale].shape, generator=gen) + 0.5)
    return moe.eval()


def _route(moe, x, skew=False):
    logits = moe.gate(x).float()
    if skew:  # most rows pick experts 0 and 1
        logits[:, :2] += 4
    return K.moe_route_ref(logits, TOP_K, shared_logits=moe.shared_expert_gate(x)[:, 0])


def _case(name, M, dtype):
    """A packed MoE of format `name`, M rows in `dtype` routed over it (skewed at M = 40), its kernel weights, shared
    expert and the reference output: (x, gate_up, down, ids, w, shared, ref)."""
    moe = _moe(name, seed=M)
    x = torch.randn(M, H, generator=torch.Generator().manual_seed(2))
    ids, w = _route(moe, x, skew=M == 40)
    x = x.to(dtype)
    gate_up, down = moe.experts.kernel_weights()
    shared = moe.experts.kernel_shared(moe.shared_expert)
    assert shared is not None
    return x, gate_up, down, ids, w, shared, quant_fused_moe_ref(x, gate_up, down, ids, w, shared_expert=shared)


@pytest.mark.parametrize("name,M,cfg,dtype", [
    ("awq", 1, "dot16", torch.float16), ("awq", 1, "gemv", torch.float32), ("awq", 3, "dot16", torch.float32),
    ("awq", 3, "fma4", torch.float16), ("awq", 8, "dot16", torch.float16), ("awq", 40, "dot16", torch.float16),
    ("ct_sym", 1, "gemv", torch.float16), ("ct_sym", 8, "dot16", torch.float32),
    ("ct_asym", 3, "fma4", torch.float16), ("ct_asym", 8, "dot16", torch.float16),
    ("ct_channel", 3, "dot16", torch.float16), ("ct_channel", 3, "gemv", torch.float32),
    ("nvfp4", 1, "dot16", torch.float16), ("nvfp4", 3, "gemv", torch.float16), ("nvfp4", 3, "fma4", torch.float32),
    ("ct_nvfp4", 1, "gemv", torch.float16), ("ct_nvfp4", 8, "dot16", torch.float32)], ids=str)
def test_quant_fused_moe_matches_reference(name, M, cfg, dtype):
    x, gate_up, down, ids, w, shared, ref = _case(name, M, dtype)
    out = quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared, config=CONFIGS[cfg])
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOL[dtype])
    if cfg != "dot16":
        return
    # without the shared expert: only the routed slots
    out = quant_fused_moe(x, gate_up, down, ids[:, :TOP_K].contiguous(), w[:, :TOP_K].contiguous(),
                          config=CONFIGS[cfg])
    torch.testing.assert_close(out, quant_fused_moe_ref(x, gate_up, down, ids[:, :TOP_K], w[:, :TOP_K]), **TOL[dtype])


def test_default_configs_and_large_m_path():
    """No config: the grouped kernels up to GROUPED_MAX_PAIRS pairs (sm80+ tiles on CPU), and past them the
    per-expert path (Triton dequantize + torch matmul)."""
    moe = _moe("awq", seed=5)
    gate_up, down = moe.experts.kernel_weights()
    shared = moe.experts.kernel_shared(moe.shared_expert)
    for M in (5, K.GROUPED_MAX_PAIRS // (TOP_K + 1) + 1):
        x = torch.randn(M, H, generator=torch.Generator().manual_seed(M))
        ids, w = _route(moe, x)
        torch.testing.assert_close(quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared),
                                   quant_fused_moe_ref(x, gate_up, down, ids, w, shared_expert=shared), **TOL[x.dtype])


def test_reference_equals_quant_experts_and_dequantized_16bit_reference():
    """quant_fused_moe_ref == QuantExperts.forward (routed) and == moe.fused_moe_ref over the dequantized weights."""
    moe = _moe("ct_asym", seed=1)
    x = torch.randn(6, H)
    ids, w = moe.route(x)
    gate_up, down = moe.experts.kernel_weights()
    with torch.no_grad():
        want = moe.experts(x, ids, w)
        torch.testing.assert_close(quant_fused_moe_ref(x, gate_up, down, ids, w), want, atol=1e-6, rtol=1e-6)
        w1 = torch.stack([dequantize_ref(gate_up.expert(e), torch.float32) for e in range(E)])
        w2 = torch.stack([dequantize_ref(down.expert(e), torch.float32) for e in range(E)])
        assert w1.shape == (E, 2 * I, H) and w2.shape == (E, H, I)
        torch.testing.assert_close(K.fused_moe_ref(x, w1, w2, ids, w), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name,shared_packed", [("awq", True), ("nvfp4", True), ("awq", False)])
def test_moe_layer_on_triton_ops_matches_torch_path(name, shared_packed):
    """MoE.forward with kernel_ops("triton") (routing + quant_fused_moe, the packed shared expert riding as
    expert E; a 16-bit one running alone) against the torch path (QuantExperts.forward + the shared SwiGLU)."""
    moe = _moe(name, seed=3, shared_packed=shared_packed)
    assert (moe.experts.kernel_shared(moe.shared_expert) is not None) == shared_packed
    for M in (1, 7):
        x = torch.randn(M, H, generator=torch.Generator().manual_seed(M))
        with torch.no_grad():
            torch.testing.assert_close(moe(x, ops=kernel_ops("triton")), moe(x), atol=2e-5, rtol=2e-5)


def test_shared_expert_stored_otherwise_is_refused_by_the_kernel():
    moe = _moe("awq")
    gate_up, down = moe.experts.kernel_weights()
    sg, su, sd = moe.experts.kernel_shared(moe.shared_expert)
    x = torch.randn(2, H)
    ids, w = _route(moe, x)
    bad = PackedWeights("awq", sd.tensors, sd.group)  # [H, I] where [I, H] belongs
    with pytest.raises(AssertionError, match="shared_expert must be"):
        quant_fused_moe(x, gate_up, down, ids, w, shared_expert=(bad, su, sd))

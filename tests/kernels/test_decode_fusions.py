"""The decode-path fusions of issue 19 (kernels/norm_rope.py, kernels/gdn/gates.py) against their torch
references, under the interpreter at small shapes, fp16 / bf16 / fp32."""

import pytest
import torch

from revolta.kernels.gdn.gates import gdn_gates, gdn_gates_ref
from revolta.kernels.norm_rope import zc_norm_rope, zc_norm_rope_ref
from revolta.kernels.rope import mrope_cos_sin_ref

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# the fused kernel rounds the norm like the reference; its sum of squares may differ by an ulp of the rounded
# norm, which RoPE carries: one ulp of the output dtype
TOL = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
       torch.float32: dict(atol=2e-6, rtol=2e-6)}

pytestmark = pytest.mark.usefixtures("poison")  # tests/kernels/conftest.py: unwritten outputs are NaN


def _tables(T, R):
    pos = torch.stack([torch.arange(T) * 3 + 11, torch.arange(T) + 7, torch.arange(T) % 5])
    inv_freq = 1.0 / (1000.0 ** (torch.arange(R // 2).float() / (R // 2)))
    return mrope_cos_sin_ref(pos, inv_freq, torch.arange(R // 2) % 3, 1.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,H,D,R", [(1, 3, 32, 8), (5, 4, 48, 24), (3, 2, 16, 16)])
def test_zc_norm_rope(dtype, T, H, D, R):
    g = torch.Generator().manual_seed(T * 100 + D)
    cos, sin = _tables(T, R)
    w = (0.2 * torch.randn(D, generator=g)).to(dtype)
    # a strided view: the query half of an interleaved [query | gate] projection
    qg = (3 * torch.randn(T, H, 2 * D, generator=g)).to(dtype)
    q = qg[:, :, :D]
    out = zc_norm_rope(q, w, 1e-6, cos, sin)
    ref = zc_norm_rope_ref(q, w, 1e-6, cos, sin)
    assert out.shape == (T, H, D) and out.is_contiguous() and out.dtype == dtype
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,HV", [(1, 4), (7, 6), (3, 32)])
def test_gdn_gates(dtype, T, HV):
    g = torch.Generator().manual_seed(T + HV)
    ab = (4 * torch.randn(T, 2 * HV, generator=g)).to(dtype)
    a, b = ab[:, :HV], ab[:, HV:]  # row-strided views
    a[0, 0] = 30.0 if dtype != torch.float16 else 25.0  # above softplus's threshold: the identity
    A_log = torch.empty(HV).uniform_(0.0, 2.7, generator=g)
    dt_bias = torch.empty(HV).uniform_(-4.0, 0.0, generator=g)
    dt_bias[-1] = -40.0  # exp(x) far below 1: log1p must not cancel to zero
    gate, beta = gdn_gates(a, b, A_log, dt_bias)
    ref_g, ref_beta = gdn_gates_ref(a, b, A_log, dt_bias)
    assert gate.dtype == beta.dtype == torch.float32
    torch.testing.assert_close(beta, ref_beta, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(gate, ref_g, atol=0, rtol=1e-5)


def _hc_weights(dtype, with_inject, d, r, h=4):
    from revolta.layers.hyperconnection import HyperConnection

    torch.manual_seed(3)
    mod = HyperConnection(d, h, r, 1e-6, with_inject=with_inject)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    mod = mod.to(dtype)
    inj = mod.block_inject_weight.weight.detach() if with_inject else None
    return (mod.hc_norm.weight.detach(), mod.input_mix_weight_down.weight.detach(),
            mod.input_mix_weight_up.weight.detach(), inj)


HC_SHAPE = (4, 40, 24)  # h, d, r: d = 40 splits 5 ways per branch, as the real d = 2560 does


def _combine_inputs(dtype, M):
    """(x [M, h·d], inject [M, h], u [M, d]) of a block write, seeded by M."""
    h, d, _ = HC_SHAPE
    g = torch.Generator().manual_seed(M)
    x = (2 * torch.randn(M, h * d, generator=g)).to(dtype)
    inject = (2 * torch.rand(M, h, generator=g)).to(dtype)
    return x, inject, torch.randn(M, d, generator=g).to(dtype)


def _assert_stored_y(y, ref_y, once):
    """y equals its reference bitwise, except a bf16 y rounded once inside a kernel: the interpreter truncates
    fp32 -> bf16 (one bf16 ulp); the GPU test checks it bitwise."""
    if once and y.dtype == torch.bfloat16:
        torch.testing.assert_close(y, ref_y, atol=0, rtol=2 ** -7)
    else:
        assert torch.equal(y, ref_y)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,with_inject", [(1, True), (5, False), (8, True), (9, True)])
def test_hc_combine_read_bitwise_equals_combine_then_read(dtype, M, with_inject):
    """The write inside the read's down pass (M <= 8, 16-bit) stores x + inj·u rounded once (hc_combine_once_ref)
    and reads it exactly as `hc_read` would; fp32 and M = 9 take the two calls (hc_combine, the layer's
    rounding); x itself is left as it was. d = 40 splits 5 ways per branch, as the real d = 2560 does."""
    from revolta.kernels import hc as K

    h, d, r = HC_SHAPE
    x, inject, u = _combine_inputs(dtype, M)
    weights = _hc_weights(dtype, with_inject, d, r, h)
    x0 = x.clone()
    y, out, inj = K.hc_combine_read(x, inject, u, *weights, h, 1e-6)
    fused = dtype != torch.float32 and M <= 8
    ref_y = K.hc_combine_once_ref(x, inject, u) if fused else K.hc_combine(x, inject, u)
    ref_out, ref_inj = K.hc_read(y, *weights, h, 1e-6)  # the read of the stored y, bitwise
    assert torch.equal(x, x0)
    _assert_stored_y(y, ref_y, once=fused)
    if not fused and dtype != torch.bfloat16:  # the interpreter rounds bf16 its own way; the GPU test compares bf16
        assert torch.equal(y, K.hc_combine_ref(x, inject, u))
    assert torch.equal(out, ref_out)
    assert (inj is None) == (not with_inject) and (inj is None or torch.equal(inj, ref_inj))
    if dtype == torch.bfloat16 and M > 8:  # the tiled read's tl.dot multiplies bf16 storage as integers in the
        return  # interpreter (kernels/hc.py); tests/kernels/test_hc.py checks it in fp16 / fp32
    # and the composed reference, at the read's tolerance
    tol = {torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float32: 2e-5}[dtype]
    _, t_out, _ = K.hc_combine_read_ref(x, inject, u, *weights, h, 1e-6)
    torch.testing.assert_close(out, t_out, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("M", [4, 13])
def test_hc_combine_read_on_the_dot_down_pass(dtype, M):
    """The write inside the tl.dot down pass (kernels/hc_dot.py, the sm90 default at 4-16 rows; one partial
    16-row tile at M = 13): y is x + inj·u rounded once, stored by row tile 0 of every split, and the read is
    bitwise `hc_read(y)` with the same dot config."""
    from revolta.kernels import hc as K

    h, d, r = HC_SHAPE
    x, inject, u = _combine_inputs(dtype, M)
    weights = _hc_weights(dtype, True, d, r, h)
    cfg = K.hc_config(M, d, r, h, arch=90)
    assert (cfg["DOWN"], cfg["UP"]) == ("dot", "dot"), cfg
    y, out, inj = K.hc_combine_read(x, inject, u, *weights, h, 1e-6, config=cfg)
    ref_y = K.hc_combine_once_ref(x, inject, u)
    _assert_stored_y(y, ref_y, once=True)
    ref_out, ref_inj = K.hc_read(y, *weights, h, 1e-6, config=cfg)
    assert torch.equal(out, ref_out) and torch.equal(inj, ref_inj)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_recurrent_decode_with_raw_gates_bitwise_equals_the_gate_kernel(dtype):
    """Decode with the gates computed inside the recurrent kernel gives the bits of the gate kernel's g, beta
    fed to it (the same jit function), outputs and state; the reference with raw gates equals the reference."""
    from revolta.kernels.gdn.recurrent import gdn_recurrent_update
    from revolta.kernels.gdn.ref import gdn_recurrent_update_ref

    g = torch.Generator().manual_seed(7)
    B, H, HV, K, V = 3, 2, 4, 16, 16
    q, k = (torch.randn(B, H, K, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(B, HV, V, generator=g).to(dtype)
    ab = (3 * torch.randn(B, 2 * HV, generator=g)).to(dtype)
    a, b = ab[:, :HV], ab[:, HV:]
    A_log = torch.empty(HV).uniform_(0.0, 2.7, generator=g)
    dt_bias = torch.empty(HV).uniform_(-4.0, 0.0, generator=g)
    pool = torch.randn(4, HV, K, V, generator=g)
    slots = torch.tensor([2, 0, 3], dtype=torch.int32)
    gate, beta = gdn_gates(a, b, A_log, dt_bias)
    pool_sep, pool_raw = pool.clone(), pool.clone()
    o_sep = gdn_recurrent_update(q, k, v, gate, beta, pool_sep, slots)
    o_raw = gdn_recurrent_update(q, k, v, a, b, pool_raw, slots, gates=(A_log, dt_bias))
    assert torch.equal(o_raw, o_sep) and torch.equal(pool_raw, pool_sep)
    pool_ref, pool_ref_raw = pool.clone(), pool.clone()
    ref_g, ref_beta = gdn_gates_ref(a, b, A_log, dt_bias)
    o_ref = gdn_recurrent_update_ref(q, k, v, ref_g, ref_beta, pool_ref, slots)
    o_ref_raw = gdn_recurrent_update_ref(q, k, v, a, b, pool_ref_raw, slots, gates=(A_log, dt_bias))
    assert torch.equal(o_ref_raw, o_ref) and torch.equal(pool_ref_raw, pool_ref)
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(o_raw, o_ref, atol=tol, rtol=tol)

"""HyperConnection kernels (revolta.kernels.hc) vs their references and HyperConnection.read/combine."""

import pytest
import torch

from revolta.kernels import hc as K
from revolta.layers.hyperconnection import HyperConnection

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}
h, d, r = 4, 32, 16


pytestmark = pytest.mark.usefixtures("poison")  # tests/kernels/conftest.py


def _module(dtype, with_inject=True, seed=0):
    torch.manual_seed(seed)
    mod = HyperConnection(d, h, r, 1e-6, with_inject=with_inject)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return mod.to(dtype)


def _weights(mod):
    inj = mod.block_inject_weight.weight.detach() if mod.block_inject_weight is not None else None
    return (mod.hc_norm.weight.detach(), mod.input_mix_weight_down.weight.detach(),
            mod.input_mix_weight_up.weight.detach(), inj)


CONFIGS = {
    "auto": None,  # hc_config(M): GEMV-like for M <= 8, tl.dot above
    "dot16": dict(BLOCK_M=16, BLOCK_R=16, BLOCK_K=16, SPLITS_PER_BRANCH=2, BLOCK_C=16, BLOCK_K_UP=16, USE_DOT=True,
                  num_warps=4),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("M", [1, 5, 63])
@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_hc_read(M, dtype, cfg):
    mod = _module(dtype)
    x = (torch.randn(M, h * d) * 2).to(dtype)
    norm_w, w_dn, w_up, w_inj = _weights(mod)
    out, inj = K.hc_read(x, norm_w, w_dn, w_up, w_inj, h, 1e-6, path="triton", config=CONFIGS[cfg])
    ref_out, ref_inj = K.hc_read_ref(x, norm_w, w_dn, w_up, w_inj, h, 1e-6)
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    torch.testing.assert_close(inj, ref_inj, **TOL[dtype])


def test_hc_read_without_inject_and_ref_matches_layer():
    for with_inject in (True, False):
        mod = _module(torch.float32, with_inject)
        x = torch.randn(5, h * d)
        with torch.no_grad():
            u, w = mod.read(x)
            ref_u, ref_w = K.hc_read_ref(x, *_weights(mod), h, 1e-6)
        torch.testing.assert_close(ref_u, u, atol=0, rtol=0)
        assert (w is None) == (ref_w is None) == (not with_inject)
        if with_inject:
            torch.testing.assert_close(ref_w, w, atol=0, rtol=0)
        out, inj = K.hc_read(x, *_weights(mod), h, 1e-6, path="triton")
        torch.testing.assert_close(out, u, **TOL[torch.float32])
        assert (inj is None) == (not with_inject)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("M", [1, 5, 63])
def test_hc_combine_bitwise(M, dtype):
    mod = _module(dtype)
    x = torch.randn(M, h * d).to(dtype)
    inj = (2 * torch.rand(M, h)).to(dtype)
    u = torch.randn(M, d).to(dtype)
    ref = mod.combine(x, inj, u)
    assert torch.equal(K.hc_combine_ref(x, inj, u), ref)
    assert torch.equal(K.hc_combine(x, inj, u), ref)
    y = x.clone()
    K.hc_combine(y, inj, u, inplace=True)
    assert torch.equal(y, ref)

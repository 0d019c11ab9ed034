"""Norm kernels (revolta.kernels.norm) vs their references and the layer modules."""

import pytest
import torch

from revolta.kernels import norm as K
from revolta.layers.norm import GatedRMSNorm, ZCRMSNorm

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-3, rtol=1e-3)}


pytestmark = pytest.mark.usefixtures("poison")  # tests/kernels/conftest.py


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("M", [1, 5, 63])
@pytest.mark.parametrize("group", [None, 32, 24])
def test_zc_rms_norm(M, dtype, group):
    N = 96 if group == 24 else 128
    g = torch.Generator().manual_seed(M)
    x = (torch.randn(M, N, generator=g) * 3).to(dtype)
    w = (torch.randn(N, generator=g) * 0.1).to(dtype)
    out = K.zc_rms_norm(x, w, 1e-6, group)
    torch.testing.assert_close(out, K.zc_rms_norm_ref(x, w, 1e-6, group), **TOL[dtype])
    # strided rows and an in-place call
    wide = torch.randn(M, N + 16, generator=g).to(dtype)
    view = wide[:, 8:8 + N]
    ref = K.zc_rms_norm_ref(view, w, 1e-6, group)
    torch.testing.assert_close(K.zc_rms_norm(view, w, 1e-6, group), ref, **TOL[dtype])
    y = x.clone()
    K.zc_rms_norm(y, w, 1e-6, group, out=y)
    torch.testing.assert_close(y, K.zc_rms_norm_ref(x, w, 1e-6, group), **TOL[dtype])


def test_zc_rms_norm_ref_matches_layer_and_3d():
    mod = ZCRMSNorm(64, 1e-6, group_size=16)
    with torch.no_grad():
        mod.weight.normal_()
    x = torch.randn(3, 5, 64)
    torch.testing.assert_close(K.zc_rms_norm_ref(x, mod.weight, 1e-6, 16), mod(x), atol=0, rtol=0)
    torch.testing.assert_close(K.zc_rms_norm(x, mod.weight.detach(), 1e-6, 16), mod(x).detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("M", [1, 5, 63])
@pytest.mark.parametrize("activation", ["sigmoid", "silu"])
def test_gated_rms_norm(M, dtype, activation):
    D = 32
    g = torch.Generator().manual_seed(M)
    o = torch.randn(M, 3, D, generator=g).to(dtype)
    z = torch.randn(M, 3, D, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)
    out = K.gated_rms_norm(o, w, z, 1e-6, activation)
    torch.testing.assert_close(out, K.gated_rms_norm_ref(o, w, z, 1e-6, activation), **TOL[dtype])
    # z as head columns of a wider projection output (GDN's merged input projection): read in place, same bits
    wide = torch.randn(M, 3 * D + 40, generator=g).to(dtype)
    wide[:, 24:24 + 3 * D] = z.flatten(1)
    strided = wide[:, 24:24 + 3 * D].unflatten(-1, (3, D))
    assert torch.equal(K.gated_rms_norm(o, w, strided, 1e-6, activation), out)


def test_gated_rms_norm_ref_matches_layer():
    mod = GatedRMSNorm(32, 1e-6, "sigmoid")
    with torch.no_grad():
        mod.weight.normal_()
    o, z = torch.randn(7, 32), torch.randn(7, 32)
    torch.testing.assert_close(K.gated_rms_norm_ref(o, mod.weight, z, 1e-6, "sigmoid"), mod(o, z), atol=0, rtol=0)

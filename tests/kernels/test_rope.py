"""RoPE kernels (revolta.kernels.rope) vs their references and RotaryEmbedding."""

import pytest
import torch

from revolta.config import RopeConfig
from revolta.kernels import rope as K
from revolta.layers.rope import RotaryEmbedding

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-3, rtol=1e-3)}


pytestmark = pytest.mark.usefixtures("poison")  # tests/kernels/conftest.py


def _tables(T, R, yarn=False):
    cfg = RopeConfig(mrope_section=(R // 6 + (R // 2) % 3, R // 6, R // 6)) if not yarn else RopeConfig(
        mrope_section=(R // 6 + (R // 2) % 3, R // 6, R // 6), rope_type="yarn", factor=2.0,
        original_max_position_embeddings=64)
    emb = RotaryEmbedding(cfg, R)
    pos = torch.stack([torch.arange(T) * 3, torch.arange(T) + 7, torch.arange(T) % 5])  # distinct rows
    return emb, pos


@pytest.mark.parametrize("T", [1, 5, 63])
@pytest.mark.parametrize("yarn", [False, True])
def test_mrope_cos_sin(T, yarn):
    emb, pos = _tables(T, 24, yarn)
    cos, sin = K.mrope_cos_sin(pos, emb.inv_freq, emb.rows, emb.scale)
    ref_cos, ref_sin = emb(pos)
    torch.testing.assert_close(K.mrope_cos_sin_ref(pos, emb.inv_freq, emb.rows, emb.scale), (ref_cos, ref_sin),
                               atol=0, rtol=0)
    torch.testing.assert_close(cos, ref_cos, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(sin, ref_sin, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("T", [1, 5, 63])
@pytest.mark.parametrize("D,R", [(32, 8), (48, 24), (16, 16)])
def test_apply_rope(T, dtype, D, R):
    emb, pos = _tables(T, R)
    cos, sin = emb(pos)
    x = torch.randn(T, 3, D).to(dtype)
    ref = K.apply_rope_ref(x, cos, sin)
    torch.testing.assert_close(K.apply_rope(x, cos, sin), ref, **TOL[dtype])
    # strided view (query half of an interleaved [query | gate] projection), in place
    qg = torch.randn(T, 3, 2 * D).to(dtype)
    q = qg[:, :, :D]
    ref_q = K.apply_rope_ref(q, cos, sin)
    gate = qg[:, :, D:].clone()
    K.apply_rope(q, cos, sin, inplace=True)
    torch.testing.assert_close(qg[:, :, :D], ref_q, **TOL[dtype])
    assert torch.equal(qg[:, :, D:], gate)

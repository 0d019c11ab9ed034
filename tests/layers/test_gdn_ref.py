"""Chunked vs recurrent gated delta rule, conv state carry (spec §3.2, §3.5)."""

import pytest
import torch

from revolta.kernels.conv1d import causal_conv1d_ref
from revolta.kernels.gdn import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref
from revolta.layers.gdn import l2_normalize


def inputs(T, HV=3, K=8, V=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(T, HV, K, generator=g)) * K**-0.5
    k = l2_normalize(torch.randn(T, HV, K, generator=g))
    v = torch.randn(T, HV, V, generator=g)
    gate = -torch.rand(T, HV, generator=g) * 2  # log decay <= 0
    beta = torch.rand(T, HV, generator=g)
    s0 = torch.randn(HV, K, V, generator=g)
    return q, k, v, gate, beta, s0


@pytest.mark.parametrize("T", [1, 2, 63, 64, 65, 130])
@pytest.mark.parametrize("chunk", [16, 64])
def test_chunk_equals_recurrent_from_a_nonzero_state(T, chunk):
    q, k, v, g, b, s0 = inputs(T, seed=T)
    o_r, s_r = recurrent_gated_delta_rule_ref(q, k, v, g, b, s0)
    o_c, s_c = chunk_gated_delta_rule_ref(q, k, v, g, b, s0, chunk_size=chunk)
    torch.testing.assert_close(o_c, o_r, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s_c, s_r, rtol=1e-4, atol=1e-4)


def test_state_carry_equals_one_pass():
    q, k, v, g, b, s0 = inputs(50, seed=1)
    o_all, s_all = chunk_gated_delta_rule_ref(q, k, v, g, b, s0)
    o1, s1 = chunk_gated_delta_rule_ref(q[:17], k[:17], v[:17], g[:17], b[:17], s0)
    o2, s2 = recurrent_gated_delta_rule_ref(q[17:], k[17:], v[17:], g[17:], b[17:], s1)
    torch.testing.assert_close(torch.cat([o1, o2]), o_all, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s2, s_all, rtol=1e-4, atol=1e-4)


def test_recurrence_definition_by_hand():
    """One step from S: decay first, then the delta update, then the read (spec §3.5)."""
    q, k, v, g, b, s0 = inputs(1, HV=1, K=2, V=2, seed=2)
    s = s0[0] * g[0, 0].exp()
    delta = b[0, 0] * (v[0, 0] - s.t() @ k[0, 0])
    s = s + torch.outer(k[0, 0], delta)
    o, s_new = recurrent_gated_delta_rule_ref(q, k, v, g, b, s0)
    torch.testing.assert_close(s_new[0], s)
    torch.testing.assert_close(o[0, 0], s.t() @ q[0, 0])


@pytest.mark.parametrize("dilation", [1, 3])
def test_conv_state_carry(dilation):
    x = torch.randn(23, 6)
    w = torch.randn(6, 4)
    y_all, st_all = causal_conv1d_ref(x, w, None, dilation)
    y1, st = causal_conv1d_ref(x[:5], w, None, dilation)
    y2, st = causal_conv1d_ref(x[5:6], w, st, dilation)
    y3, st = causal_conv1d_ref(x[6:], w, st, dilation)
    torch.testing.assert_close(torch.cat([y1, y2, y3]), y_all)
    torch.testing.assert_close(st, st_all)
    assert st.shape == (dilation * 3, 6)
    # last tap multiplies the current input; tap 0 the input 3*dilation back
    t = 20
    ref = sum(w[:, j] * x[t - dilation * (3 - j)] for j in range(4))
    torch.testing.assert_close(y_all[t], ref)

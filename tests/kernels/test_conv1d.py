"""Slot-pool causal conv1d kernels vs their torch references (interpreter on CPU)."""

import pytest
import torch

from revolta.kernels.conv1d import (causal_conv1d_commit, causal_conv1d_commit_ref, causal_conv1d_update,
                                    causal_conv1d_update_ref, causal_conv1d_varlen, causal_conv1d_varlen_ref)

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}
NUM_SLOTS = 6


def _pool(S, C, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(NUM_SLOTS, S, C, generator=g).to(dtype)


def _cu(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dilation", [1, 3])
@pytest.mark.parametrize("lens", [[1, 63, 2], [5], [0, 7, 40]], ids=str)
def test_varlen(dtype, dilation, lens):
    C, W = 40, 4  # C not a power of two: masked channel tail
    S = dilation * (W - 1)
    g = torch.Generator().manual_seed(len(lens) + dilation)
    T = sum(lens)
    x = torch.randn(T, C + 8, generator=g).to(dtype)[:, 4 : 4 + C]  # strided view, like a q|k|v slice
    w = torch.randn(C, W, generator=g).to(dtype)
    slots = torch.tensor([3, 1, 5][: len(lens)], dtype=torch.int32)
    has_init = torch.tensor([True, False, True][: len(lens)])
    cu = _cu(lens)
    pool, pool_ref = _pool(S, C, dtype, 1), _pool(S, C, dtype, 1)
    y = causal_conv1d_varlen(x, w, pool, slots, cu, has_init, "silu", dilation)
    y_ref = causal_conv1d_varlen_ref(x, w, pool_ref, slots, cu, has_init, "silu", dilation)
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    torch.testing.assert_close(pool, pool_ref, rtol=0, atol=0)  # state rows are copies, bit exact
    untouched = [s for s in range(NUM_SLOTS) if s not in slots.tolist()]
    torch.testing.assert_close(pool[untouched], _pool(S, C, dtype, 1)[untouched], rtol=0, atol=0)

    # verify mode: the pool is only read
    pool2 = _pool(S, C, dtype, 1)
    y2 = causal_conv1d_varlen(x, w, pool2, slots, cu, has_init, None, dilation, write_state=False)
    torch.testing.assert_close(pool2, _pool(S, C, dtype, 1), rtol=0, atol=0)
    y2_ref = causal_conv1d_varlen_ref(x, w, _pool(S, C, dtype, 1), slots, cu, has_init, None, dilation, False)
    torch.testing.assert_close(y2, y2_ref, **TOL[dtype])
    # ... into given storage (strided rows, NaN-poisoned), keeping a copy of the inputs in the same launch
    for fn, want in ((causal_conv1d_varlen, y2), (causal_conv1d_varlen_ref, y2_ref)):
        out, kept = (torch.full((T, C + 3), float("nan"), dtype=dtype)[:, 1:1 + C] for _ in range(2))
        got = fn(x, w, pool2, slots, cu, has_init, None, dilation, write_state=False, out=out, x_copy=kept)
        assert got.data_ptr() == out.data_ptr() and torch.equal(out, want) and torch.equal(kept, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("dilation", [1, 3])
def test_update_equals_varlen_steps(dtype, dilation):
    C, W, B, steps = 24, 4, 3, 4
    S = dilation * (W - 1)
    g = torch.Generator().manual_seed(dilation)
    w = torch.randn(C, W, generator=g).to(dtype)
    slots = torch.tensor([4, 0, 2], dtype=torch.int32)
    pool, pool_ref = _pool(S, C, dtype, 2), _pool(S, C, dtype, 2)
    xs = torch.randn(steps, B, C, generator=g).to(dtype)
    for t in range(steps):
        y = causal_conv1d_update(xs[t], w, pool, slots, "silu", dilation)
        y_ref = causal_conv1d_update_ref(xs[t], w, pool_ref, slots, "silu", dilation)
        torch.testing.assert_close(y, y_ref, **TOL[dtype])
        torch.testing.assert_close(pool, pool_ref, rtol=0, atol=0)
    # decode steps == one varlen pass over the same tokens from the same windows
    pool_v = _pool(S, C, dtype, 2)
    x_flat = xs.transpose(0, 1).reshape(B * steps, C)
    cu = torch.arange(B + 1, dtype=torch.int32) * steps
    y_v = causal_conv1d_varlen(x_flat, w, pool_v, slots, cu, torch.ones(B, dtype=torch.bool), "silu", dilation)
    torch.testing.assert_close(pool_v, pool, rtol=0, atol=0)
    torch.testing.assert_close(y_v.view(B, steps, C)[:, -1], y, **TOL[dtype])


@pytest.mark.parametrize("dilation", [1, 3])
def test_commit_after_verify(dilation):
    """verify (no state write) + commit of n accepted == a varlen pass over the first n tokens."""
    C, W, B, T = 16, 4, 3, 5
    S = dilation * (W - 1)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(B * T, C, generator=g).half()
    w = torch.randn(C, W, generator=g).half()
    slots = torch.tensor([1, 2, 3], dtype=torch.int32)
    cu = torch.arange(B + 1, dtype=torch.int32) * T
    for n in range(T + 1):
        num_acc = torch.tensor([n, T - n, min(n, 2)], dtype=torch.int32)
        pool, pool_ref, pool_seq = (_pool(S, C, torch.float16, 3) for _ in range(3))
        causal_conv1d_varlen(x, w, pool, slots, cu, torch.ones(B, dtype=torch.bool), "silu", dilation,
                             write_state=False)
        causal_conv1d_commit(x, pool, slots, cu, num_acc)
        causal_conv1d_commit_ref(x, pool_ref, slots, cu, num_acc)
        torch.testing.assert_close(pool, pool_ref, rtol=0, atol=0)
        for b in range(B):  # the same window as decoding the accepted tokens one by one
            for t in range(int(num_acc[b])):
                causal_conv1d_update(x[b * T + t][None], w, pool_seq, slots[b : b + 1], "silu", dilation)
        torch.testing.assert_close(pool, pool_seq, rtol=0, atol=0)


def test_wrapper_rejects_bad_inputs():
    x = torch.randn(4, 8)
    w = torch.randn(8, 4)
    pool = torch.zeros(2, 3, 8)
    with pytest.raises(AssertionError, match="slots must be int32"):
        causal_conv1d_update(x, w, pool, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(AssertionError, match="conv_state must be"):
        causal_conv1d_update(x, w, torch.zeros(2, 9, 8), torch.zeros(4, dtype=torch.int32))
    with pytest.raises(AssertionError, match="x_copy must be"):
        causal_conv1d_varlen(x, w, pool, torch.zeros(1, dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32),
                             torch.ones(1, dtype=torch.bool), x_copy=torch.empty(4, 8, dtype=torch.float16))
    with pytest.raises(AssertionError, match="cu_seqlens"):
        causal_conv1d_varlen(x, w, pool, torch.zeros(1, dtype=torch.int32), torch.tensor([0, 4]),
                             torch.ones(1, dtype=torch.bool))

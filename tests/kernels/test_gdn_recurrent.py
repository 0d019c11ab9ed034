"""GDN decode / verify / commit / replay kernels vs their torch references (interpreter on CPU)."""

import pytest
import torch

from revolta.kernels.gdn.recurrent import (gdn_commit, gdn_recurrent_update, gdn_replay_commit, gdn_verify,
                                           recurrent_config)
from revolta.kernels.gdn.ref import (gdn_commit_ref, gdn_recurrent_update_ref, gdn_replay_commit_ref,
                                     gdn_verify_ref)

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}
STATE_TOL = dict(rtol=1e-4, atol=1e-4)  # the state is fp32 whatever the activation dtype
NUM_SLOTS = 7


def make(B, T, H=2, HV=4, K=16, V=32, dtype=torch.float32, seed=0, num_slots=NUM_SLOTS):
    """Inputs [B, T, ...] (T=None: decode shapes [B, ...]) and a random fp32 pool."""
    gen = torch.Generator().manual_seed(seed)
    lead = (B,) if T is None else (B, T)
    q = torch.randn(*lead, H, K, generator=gen).to(dtype)
    k = torch.randn(*lead, H, K, generator=gen).to(dtype)
    v = torch.randn(*lead, HV, V, generator=gen).to(dtype)
    g = -torch.rand(*lead, HV, generator=gen) * 1.5
    beta = torch.rand(*lead, HV, generator=gen)
    pool = torch.randn(num_slots, HV, K, V, generator=gen) * 0.5
    return q, k, v, g, beta, pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [dict(H=2, HV=4, K=16, V=32), dict(H=1, HV=3, K=32, V=16), dict(H=2, HV=2, K=24, V=20)],
                         ids=["gva2", "gva3", "pad"])
def test_decode(dtype, shape):
    B = 3
    q, k, v, g, beta, pool = make(B, None, dtype=dtype, **shape)
    slots = torch.tensor([5, 2, 0], dtype=torch.int32)
    pool_ref = pool.clone()
    o = gdn_recurrent_update(q, k, v, g, beta, pool, slots)
    o_ref = gdn_recurrent_update_ref(q, k, v, g, beta, pool_ref, slots)
    assert not o.isnan().any()
    torch.testing.assert_close(o, o_ref, **TOL[dtype])
    torch.testing.assert_close(pool, pool_ref, **STATE_TOL)
    untouched = [1, 3, 4, 6]
    assert torch.equal(pool[untouched], make(B, None, dtype=dtype, **shape)[-1][untouched])


def test_decode_without_l2norm_and_strided_views():
    """q, k, v as column slices of one fused [B, (2H·K + HV·V)] buffer (what the conv produces)."""
    B, H, HV, K, V = 2, 2, 4, 16, 16
    gen = torch.Generator().manual_seed(3)
    mixed = torch.randn(B, 2 * H * K + HV * V, generator=gen)
    q, k, v = (t.unflatten(-1, (-1, d)) for t, d in zip(mixed.split([H * K, H * K, HV * V], -1), (K, K, V)))
    g = -torch.rand(B, HV, generator=gen)
    beta = torch.rand(B, HV, generator=gen)
    pool = torch.randn(3, HV, K, V, generator=gen)
    pool_ref = pool.clone()
    slots = torch.tensor([2, 1], dtype=torch.int32)
    o = gdn_recurrent_update(q, k, v, g, beta, pool, slots, scale=0.3, use_qk_l2norm=False)
    o_ref = gdn_recurrent_update_ref(q, k, v, g, beta, pool_ref, slots, scale=0.3, use_qk_l2norm=False)
    torch.testing.assert_close(o, o_ref, **TOL[torch.float32])
    torch.testing.assert_close(pool, pool_ref, **STATE_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("mode", ["buffer", "slots"])
def test_verify_then_commit_equals_sequential_decode(dtype, mode):
    B, T = 2, 5
    q, k, v, g, beta, pool0 = make(B, T, dtype=dtype, seed=1, num_slots=12)
    slots = torch.tensor([3, 1], dtype=torch.int32)
    draft = torch.tensor([[2, 4, 5, 6, 7], [8, 9, 10, 11, 0]], dtype=torch.int32) if mode == "slots" else None
    T_use = T
    q, k, v, g, beta = (t[:, :T_use].contiguous() for t in (q, k, v, g, beta))

    # sequential decode from the same state: the states to compare against, per position
    seq_states, seq_out = [], []
    pool_seq = pool0.clone()
    for t in range(T_use):
        seq_out.append(gdn_recurrent_update(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], pool_seq, slots))
        seq_states.append(pool_seq[slots.long()].clone())

    for n in range(T_use + 1):
        pool = pool0.clone()
        buf = torch.full((B, T_use, *pool.shape[1:]), float("nan")) if mode == "buffer" else draft
        o = gdn_verify(q, k, v, g, beta, pool, slots, draft_states=buf)
        committed = pool[slots.long()].clone()
        assert torch.equal(committed, pool0[slots.long()]), "verify must not touch the committed state"
        o_ref = gdn_verify_ref(q, k, v, g, beta, pool0.clone(), slots)
        torch.testing.assert_close(o, o_ref, **TOL[dtype])
        torch.testing.assert_close(o, torch.stack(seq_out, 1), **TOL[dtype])
        num_acc = torch.tensor([n, T_use - n], dtype=torch.int32)
        pool_ref = pool.clone()
        gdn_commit(buf, pool, slots, num_acc)
        gdn_commit_ref(buf, pool_ref, slots, num_acc)
        assert torch.equal(pool, pool_ref)
        for b in range(B):
            want = pool0[slots[b]] if num_acc[b] == 0 else seq_states[num_acc[b] - 1][b]
            torch.testing.assert_close(pool[slots[b]], want, **STATE_TOL)
        written = slots.tolist() + (draft.flatten().tolist() if mode == "slots" else [])
        others = [s for s in range(pool.shape[0]) if s not in written]
        assert torch.equal(pool[others], pool0[others])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("T", [2, 5])
def test_replay_commit_bitwise_equals_kept_state(dtype, T):
    B = 3
    q, k, v, g, beta, pool0 = make(B, T, dtype=dtype, seed=2)
    slots = torch.tensor([1, 4, 6], dtype=torch.int32)
    buf = torch.empty(B, T, *pool0.shape[1:])
    gdn_verify(q, k, v, g, beta, pool0.clone(), slots, draft_states=buf)
    for n in range(T + 1):
        num_acc = torch.tensor([n, T - n, min(n, 1)], dtype=torch.int32)
        pool, pool_ref = pool0.clone(), pool0.clone()
        gdn_replay_commit(q, k, v, g, beta, pool, slots, num_acc)
        gdn_replay_commit_ref(q, k, v, g, beta, pool_ref, slots, num_acc)
        torch.testing.assert_close(pool, pool_ref, **STATE_TOL)
        kept = pool0.clone()
        gdn_commit(buf, kept, slots, num_acc)
        assert torch.equal(pool, kept), f"replay of {num_acc.tolist()} differs from the kept state"


def test_config_is_shape_only():
    assert recurrent_config(48, 128, 128) == recurrent_config(48, 128, 128)
    bv, warps = recurrent_config(1 * 48, 128, 128)
    assert 128 * bv // (32 * warps) <= 32  # state slice <= 32 fp32 registers per thread


def test_wrapper_messages():
    q, k, v, g, beta, pool = make(2, None)
    slots = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(AssertionError, match="g, beta must be fp32"):
        gdn_recurrent_update(q, k, v, g.half(), beta, pool, slots)
    with pytest.raises(AssertionError, match="slots must be int32"):
        gdn_recurrent_update(q, k, v, g, beta, pool, slots.long())
    with pytest.raises(AssertionError, match="ssm_state must be"):
        gdn_recurrent_update(q, k, v, g, beta, pool.half(), slots)
    with pytest.raises(AssertionError, match="draft_states must be"):
        qv, kv, vv, gv, bv, _ = make(2, 3)
        gdn_verify(qv, kv, vv, gv, bv, pool, slots, draft_states=torch.zeros(2, 3, 4))

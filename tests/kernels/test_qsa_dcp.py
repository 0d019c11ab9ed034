"""DCP attention pieces (kernels/qsa/dcp.py), single process: the K/V of a paged cache striped over dcp ranks
(token t on rank t % dcp), each rank's partial attention over its stripe, and the log-sum-exp merge equal the
single-process sparse attention over the whole cache (dense rows, sparse rows past the onset, prefix + chunk,
a one-token request whose other ranks hold nothing). Then the Triton partial attention (interpreter, small shapes)
against those references, per rank, for the KV formats, with and without flash-decoding splits."""

import pytest
import torch

from revolta.kernels.ops import kernel_ops
from revolta.kernels.qsa import qsa_prefill_ref, store_kv_ref
from revolta.kernels.qsa.common import dequant_cache_ref
from revolta.kernels.qsa.dcp import (attend_partial_rows_ref, attend_rows_partial, local_slot_mapping, merge_partials,
                                     qsa_partial_ref)
from revolta.kernels.qsa.sparse_attn import attend_rows
from test_qsa_helpers import C, D, DI, HI, HQ, KVH, SCALE, assert_close, block_table_for, nan_poison  # noqa: F401

NB = 48


def _stripe(cache: torch.Tensor, dcp: int, rank: int) -> torch.Tensor:
    """[NB, bs, ...] -> rank's pages [NB, bs / dcp, ...]: offsets rank, rank + dcp, ..."""
    return cache[:, rank::dcp].contiguous()


@pytest.mark.parametrize("dcp", [2, 4])
@pytest.mark.parametrize("block_size,lengths,qlens,budget", [
    (8, [70, 1, 30], [70, 1, 6], 3),  # a whole prompt past the onset, a first token, a chunk after a prefix
    (16, [97, 41], [1, 1], 4),  # decode rows
])
def test_striped_partials_merge_to_full_attention(dcp, block_size, lengths, qlens, budget):
    g = torch.Generator().manual_seed(dcp + block_size)
    table = block_table_for(lengths, block_size, NB, g)
    T = sum(qlens)
    kc, vc = torch.randn(NB, block_size, KVH, D, generator=g), torch.randn(NB, block_size, KVH, D, generator=g)
    icache = torch.randn(NB, block_size // C, DI, generator=g)
    q, gate, iq = torch.randn(T, HQ, D, generator=g), torch.randn(T, HQ, D, generator=g), torch.randn(T, HI, DI, generator=g)
    cu = torch.tensor([0] + qlens).cumsum(0).int()
    seq = torch.tensor(lengths, dtype=torch.int32)
    want = qsa_prefill_ref(q, gate, kc, vc, table, cu, seq, SCALE, budget, index_q=iq, index_cache=icache, ratio=C)

    parts = [qsa_partial_ref(q, _stripe(kc, dcp, r), _stripe(vc, dcp, r), table, cu, seq, SCALE, budget, iq, icache,
                             dcp, r, ratio=C) for r in range(dcp)]
    out = torch.stack([p[0] for p in parts])  # [dcp, T, HQ, D]
    lse = torch.stack([p[1] for p in parts])  # [dcp, T, HQ]
    got = merge_partials(out, lse) * torch.sigmoid(gate)
    assert (got - want).abs().max() < 1e-5, (got - want).abs().max()
    # the first token of a sequence is on rank 0 only: the others report an empty set
    if 1 in lengths:
        row = int(cu[lengths.index(1)])
        assert torch.isinf(lse[1:, row]).all() and (out[1:, row] == 0).all()
    # each rank saw a strict part of the tokens (a rank holding all of them would have the merged lse)
    full_lse = lse.logsumexp(0)
    assert (lse[0] < full_lse - 1e-3).any()


def test_local_slot_mapping_stores_each_token_on_one_rank():
    bs, dcp = 8, 2
    slots = torch.tensor([3 * bs + 0, 3 * bs + 1, 3 * bs + 7, 5 * bs + 2, -1])
    k = torch.randn(5, KVH, D)
    full = torch.zeros(NB, bs, KVH, D)
    store_kv_ref(k, k, full, full.clone(), slots, "auto")
    for r in range(dcp):
        local = local_slot_mapping(slots, bs, dcp, r)
        assert local.tolist() == ([3 * 4 + 0, -1, -1, 5 * 4 + 1, -1] if r == 0 else [-1, 3 * 4 + 0, 3 * 4 + 3, -1, -1])
        part = torch.zeros(NB, bs // dcp, KVH, D)
        store_kv_ref(k, k, part, part.clone(), local, "auto")
        assert torch.equal(part, _stripe(full, dcp, r))


def test_merge_is_softmax_over_the_union():
    g = torch.Generator().manual_seed(1)
    logits, v = torch.randn(3, 10, generator=g) * 5, torch.randn(10, 4, generator=g)
    owner = torch.tensor([0, 1, 0, 0, 1, 1, 0, 1, 0, 0])  # rank 2 holds nothing
    outs, lses = [], []
    for r in range(3):
        lg = logits.masked_fill(owner[None] != r, float("-inf"))
        lse = lg.logsumexp(-1)
        p = torch.exp(lg - lse.masked_fill(lse == float("-inf"), 0)[:, None])
        outs.append(p @ v)
        lses.append(lse)
    got = merge_partials(torch.stack(outs), torch.stack(lses))
    want = torch.softmax(logits, -1) @ v
    assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()


# --- the Triton partial attention (attend_rows_partial / qsa_partial) against the references above ---

PLENS = [1, 2, 11, 37, 70]  # a first token (rank 0 only), a 2-token sequence (dcp 4: ranks 2, 3 hold nothing), ...
TOL_OUT = {torch.float16: 4e-3}  # probabilities meet V in the compute dtype in the kernel


def _rows_of(lengths, g):
    """Explicit rows: every request's last token, plus a few earlier ones of the longer requests (prefill-like)."""
    req, pos = [], []
    for b, L in enumerate(lengths):
        extra = sorted(torch.randperm(L - 1, generator=g)[:2].tolist()) if L > 4 else []
        for t in extra + [L - 1]:
            req.append(b)
            pos.append(t)
    return torch.tensor(req, dtype=torch.int32), torch.tensor(pos, dtype=torch.int32)


def _striped_world(kv_dtype, dtype, block_size, budget, seed):
    """A full paged cache in `kv_dtype` (+ scales), random explicit rows and valid selections."""
    g = torch.Generator().manual_seed(seed)
    table = block_table_for(PLENS, block_size, NB, g)
    k = torch.randn(NB * block_size, KVH, D, generator=g).to(dtype)
    v = torch.randn(NB * block_size, KVH, D, generator=g).to(dtype)
    cdt = {"auto": dtype, "fp8_e4m3": torch.uint8, "int8": torch.int8}[kv_dtype]
    kc, vc = torch.zeros(NB, block_size, KVH, D, dtype=cdt), torch.zeros(NB, block_size, KVH, D, dtype=cdt)
    ks = vs = None
    if kv_dtype == "fp8_e4m3":
        ks, vs = k.float().abs().max().reshape(1) / 448, v.float().abs().max().reshape(1) / 448
    elif kv_dtype == "int8":
        ks, vs = torch.zeros(NB, block_size, KVH), torch.zeros(NB, block_size, KVH)
    store_kv_ref(k, v, kc, vc, torch.arange(NB * block_size), kv_dtype, ks, vs)
    row_req, row_pos = _rows_of(PLENS, g)
    R = row_req.shape[0]
    sel = torch.full((R, budget), -1, dtype=torch.int32)
    for i, t in enumerate(row_pos.tolist()):
        n = (t + 1) // C
        if n:
            sel[i, :min(n, budget)] = torch.randperm(n, generator=g)[:budget].sort().values.int()
    q, gate = torch.randn(R, HQ, D, generator=g).to(dtype), torch.randn(R, HQ, D, generator=g).to(dtype)
    return kc, vc, ks, vs, table, torch.tensor(PLENS, dtype=torch.int32), sel, row_req, row_pos, q, gate


def _rank_view(x, kv_dtype, dcp, rank):
    """A rank's pages of a cache or of its int8 per-token scales (fp8's per-tensor scale is shared)."""
    if x is None or (kv_dtype == "fp8_e4m3" and x.dim() == 1):
        return x
    return _stripe(x, dcp, rank)


# fp16 only: Triton 3.9's interpreter computes tl.dot of bf16 operands wrongly (also for the unchanged
# single-process attend_rows); bf16 runs compiled in tests/gpu/test_dcp_partial_gpu.py.
@pytest.mark.parametrize("kv_dtype,dtype,dcp,splits", [
    ("auto", torch.float16, 2, 1), ("auto", torch.float16, 2, 3), ("fp8_e4m3", torch.float16, 2, 3),
    ("int8", torch.float16, 2, 1), ("int8", torch.float16, 4, 3), ("fp8_e4m3", torch.float16, 4, 1),
    ("auto", torch.float16, 4, None),
])
def test_triton_partial_rows_match_ref(kv_dtype, dtype, dcp, splits, nan_poison):
    block_size, budget = 8, 3
    kc, vc, ks, vs, table, seq, sel, row_req, row_pos, q, gate = _striped_world(kv_dtype, dtype, block_size, budget,
                                                                                 dcp * 10 + (splits or 0))
    outs, lses = [], []
    for r in range(dcp):
        kr, vr, ksr, vsr = (_rank_view(x, kv_dtype, dcp, r) for x in (kc, vc, ks, vs))
        out, lse = attend_rows_partial(q, kr, vr, table, seq, sel, row_req, row_pos, SCALE, kv_dtype, ksr, vsr, C, 1,
                                       True, dcp, r, num_splits=splits)
        kf, vf = dequant_cache_ref(kr, kv_dtype, ksr), dequant_cache_ref(vr, kv_dtype, vsr)
        for b in range(len(PLENS)):
            rows = row_req == b
            ro, rl = attend_partial_rows_ref(q[rows], kf, vf, table[b], sel[rows], row_pos[rows], SCALE, C, dcp, r)
            assert torch.equal(torch.isinf(lse[rows]), torch.isinf(rl)), f"rank {r} request {b}: empty sets differ"
            fin = torch.isfinite(rl)
            assert_close(f"lse rank {r} req {b}", rl[fin], lse[rows][fin], 2e-3)
            assert_close(f"out rank {r} req {b}", ro, out[rows], TOL_OUT[dtype])
        # rows whose token list has none of this rank's tokens: -inf and a zero output (t < r: t = 0, 1)
        empty = row_pos < r
        assert empty.any() or r == 0
        assert torch.isinf(lse[empty]).all() and (out[empty] == 0).all()
        outs.append(out)
        lses.append(lse)
    # the merge of the ranks' partials is the single-process kernel's attention over the whole cache
    merged = (merge_partials(torch.stack(outs), torch.stack(lses)) * torch.sigmoid(gate.float())).to(dtype)
    whole = attend_rows(q, gate, kc, vc, table, seq, sel, row_req, row_pos, SCALE, kv_dtype, ks, vs, C, 1, True,
                        num_splits=splits)
    assert_close("merged partials vs attend_rows", whole, merged, 2 * TOL_OUT[dtype])


def test_triton_qsa_partial_matches_ref():
    """The op the Triton backend runs (rows from cu_seqlens, selection by qsa_select_rows) vs qsa_partial_ref."""
    dcp, block_size, budget, lengths, qlens = 2, 8, 3, [37, 1, 30], [3, 1, 4]
    g = torch.Generator().manual_seed(7)
    table = block_table_for(lengths, block_size, NB, g)
    T = sum(qlens)
    kc = torch.randn(NB, block_size, KVH, D, generator=g).half()
    vc = torch.randn(NB, block_size, KVH, D, generator=g).half()
    icache = torch.randn(NB, block_size // C, DI, generator=g).half()
    q, iq = torch.randn(T, HQ, D, generator=g).half(), torch.randn(T, HI, DI, generator=g).half()
    cu = torch.tensor([0] + qlens).cumsum(0).int()
    seq = torch.tensor(lengths, dtype=torch.int32)
    tri, ref = kernel_ops("triton").qsa_partial, kernel_ops("torch").qsa_partial
    for r in range(dcp):
        args = (q, _stripe(kc, dcp, r), _stripe(vc, dcp, r), table, cu, seq, SCALE, budget, iq, icache, dcp, r)
        (o, lse), (ro, rl) = tri(*args, ratio=C), ref(*args, ratio=C)
        assert torch.equal(torch.isinf(lse), torch.isinf(rl))
        assert_close(f"qsa_partial rank {r} lse", rl[torch.isfinite(rl)], lse[torch.isfinite(rl)], 2e-3)
        assert_close(f"qsa_partial rank {r} out", ro, o, 4e-3)


def test_triton_partial_rejects_a_stripe_that_splits_groups_unevenly():
    q = torch.randn(1, HQ, D).half()
    cache = torch.zeros(4, 1, KVH, D).half()
    with pytest.raises(ValueError, match="dividing the group size.*decode_context_parallel_size that divides .*kernels='torch'"):
        attend_rows_partial(q, cache, cache, torch.ones(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                            torch.zeros(1, 2, dtype=torch.int32), None, None, SCALE, "auto", None, None, C, 1, False,
                            8, 0)

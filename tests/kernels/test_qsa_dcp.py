"""DCP attention pieces (kernels/qsa/dcp.py), single process: the K/V of a paged cache striped over dcp ranks
(token t on rank t % dcp), each rank's partial attention over its stripe, and the log-sum-exp merge equal the
single-process sparse attention over the whole cache (dense rows, sparse rows past the onset, prefix + chunk,
a one-token request whose other ranks hold nothing)."""

import pytest
import torch

from revolta.kernels.qsa import qsa_prefill_ref, store_kv_ref
from revolta.kernels.qsa.dcp import local_slot_mapping, merge_partials, qsa_partial_ref
from test_qsa_helpers import C, D, DI, HI, HQ, KVH, SCALE, block_table_for

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

"""The vectorised CPU prefill path (`qsa_prefill_ref`: `select_request_rows_ref` + `attend_request_rows_ref`)
against the per-row references it replaced (`qsa_select_rows_ref` + `attend_rows_ref`, one Python step per
token): the same selections, ties included, and the same attention output."""

import pytest
import torch

from revolta.kernels.qsa import qsa_prefill_ref, qsa_select_rows_ref
from revolta.kernels.qsa.common import varlen_rows
from revolta.kernels.qsa.sparse_attn import attend_rows_ref
from test_qsa_helpers import C, D, DI, HI, HQ, KVH, SCALE, block_table_for

NB = 96


def _step(block_size: int, lengths: list[int], qlens: list[int], seed: int, exact: bool):
    """A varlen prefill step: the last qlens[b] tokens of request b are its rows. With `exact`, every value is a
    multiple of 1/4 in [-1, 1], so fp32 scores have no rounding at all (the two paths must agree bit for bit)
    and equal scores, the tie cases, are common."""
    g = torch.Generator().manual_seed(seed)

    def values(*shape):
        x = torch.randn(*shape, generator=g)
        return ((x * 2).round().clamp(-4, 4) / 4).half() if exact else x.half()

    table = block_table_for(lengths, block_size, NB, g)
    T = sum(qlens)
    kc, vc = values(NB, block_size, KVH, D), values(NB, block_size, KVH, D)
    icache = values(NB, block_size // C, DI)
    q, gate, iq = values(T, HQ, D), values(T, HQ, D), values(T, HI, DI)
    cu = torch.tensor([0] + qlens).cumsum(0).int()
    seq = torch.tensor(lengths, dtype=torch.int32)
    return q, gate, kc, vc, table, cu, seq, iq, icache


CASES = [  # block_size, context lengths, rows in this step, budget
    (8, [130, 63, 12], [130, 20, 12], 3),  # whole prompt, a chunk, a short request under the onset
    (16, [300, 5, 97], [64, 5, 1], 8),  # a late chunk, a tiny prompt, one row
    (16, [257, 140], [257, 33], 16),
]


@pytest.mark.parametrize("exact", [True, False], ids=["exact-ties", "gaussian"])
@pytest.mark.parametrize("block_size,lengths,qlens,budget", CASES)
def test_vectorised_prefill_matches_per_row(block_size, lengths, qlens, budget, exact):
    q, gate, kc, vc, table, cu, seq, iq, icache = _step(block_size, lengths, qlens, budget + block_size, exact)
    row_req, row_pos = varlen_rows(cu, seq, q.shape[0])
    want_sel = qsa_select_rows_ref(iq, icache, table, seq, row_req, row_pos, budget)
    want = attend_rows_ref(q, gate, kc, vc, table, want_sel, row_req, row_pos, SCALE, "auto", None, None, C, budget)
    args = (q, gate, kc, vc, table, cu, seq, SCALE, budget)
    got = qsa_prefill_ref(*args, index_q=iq, index_cache=icache)
    # the same selections, given explicitly, give the same output (so any difference below is selection)
    got_given = qsa_prefill_ref(*args, selected=want_sel)
    assert torch.allclose(got.float(), want.float(), atol=2e-3, rtol=0), (got.float() - want.float()).abs().max()
    assert torch.allclose(got_given.float(), want.float(), atol=2e-3, rtol=0)
    if exact:  # no rounding in the scores: the vectorised top-k must pick exactly the per-row ids
        from revolta.kernels.qsa.select import request_group_keys, select_request_rows_ref

        for b in range(len(lengths)):
            rows = slice(int(cu[b]), int(cu[b + 1]))
            keys = request_group_keys(icache, table, b, lengths[b] // C)
            assert torch.equal(select_request_rows_ref(iq[rows], keys, row_pos[rows], budget), want_sel[rows])


def test_selection_ties_all_zero_scores():
    """Every score +0 (each index query's dots are negative): the lowest ids win, as in the per-row sort."""
    from revolta.kernels.qsa.select import select_request_rows_ref

    keys = torch.zeros(40, DI)
    keys[:, 0] = 1.0
    iq = torch.zeros(6, HI, DI)
    iq[..., 0] = -1.0
    pos = torch.tensor([3, 20, 60, 100, 158, 159])
    got = select_request_rows_ref(iq, keys, pos, 8)
    n = (pos + 1) // C
    for r in range(6):
        want = list(range(min(int(n[r]), 8))) + [-1] * (8 - min(int(n[r]), 8))
        assert got[r].tolist() == want

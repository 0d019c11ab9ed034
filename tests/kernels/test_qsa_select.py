"""qsa_select_decode / qsa_select_rows: scores + radix top-k vs the refs and the layer's select_blocks, ties."""

import pytest
import torch

from revolta.kernels.qsa import qsa_select_decode, qsa_select_decode_ref, qsa_select_rows, qsa_select_rows_ref
from revolta.kernels.qsa.common import uniform_rows
from revolta.kernels.qsa.select import index_scores_ref
from revolta.layers.qsa import select_blocks
from test_qsa_helpers import C, DI, HI, block_table_for, nan_poison  # noqa: F401

CONTEXTS = [1, 5, 11, 12, 63, 130]


def _world(block_size, seed, lengths=CONTEXTS, rows=1):
    g = torch.Generator().manual_seed(seed)
    nb = 64
    table = block_table_for(lengths, block_size, nb, g)
    cache = torch.randn(nb, block_size // C, DI, generator=g).half()
    iq = torch.randn(len(lengths), rows, HI, DI, generator=g).half()
    return cache, table, torch.tensor(lengths, dtype=torch.int32), iq


def _same_up_to_near_ties(got, want, scores):
    """Identical, or differing only where the scores agree to fp32 rounding (summation order)."""
    if torch.equal(got, want):
        return True
    a, b = set(got.tolist()) - {-1}, set(want.tolist()) - {-1}
    diff = [scores[j] for j in a ^ b]
    return len(a) == len(b) and max(diff) - min(diff) <= 1e-5 * max(1.0, max(diff))


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("budget", [2, 3])
def test_select_decode_matches_ref_and_layer(block_size, budget, nan_poison):
    cache, table, seq, iq = _world(block_size, budget * block_size)
    got = qsa_select_decode(iq[:, 0], cache, table, seq, budget)
    want = qsa_select_decode_ref(iq[:, 0], cache, table, seq, budget)
    for b, L in enumerate(CONTEXTS):
        n = L // C
        scores = index_scores_ref(iq[b, 0], cache, table, b, n)
        assert _same_up_to_near_ties(got[b], want[b], scores), (L, got[b], want[b])
        # ascending ids, -1 padding after min(n, budget) valid ids
        k = min(n, budget)
        assert (got[b, k:] == -1).all() and (got[b, :k] >= 0).all() and (got[b, :k].diff() > 0).all()
        if n > 0:
            mask = select_blocks(scores[None], torch.tensor([n]), budget)[0]
            assert torch.equal(mask.nonzero()[:, 0].int(), want[b, :k])


@pytest.mark.parametrize("kind", ["zeros", "equal", "partial"])
def test_select_ties_follow_spec_policy(kind, nan_poison):
    """Exact ties at the budget boundary: descending score, then ascending group id."""
    lengths = [63, 130, 12]
    cache, table, seq, iq = _world(8, 7, lengths)
    q = iq[:, 0].clone()
    if kind == "zeros":  # every q.k < 0 -> every score is exactly +0
        q[:] = 0
        q[..., 0] = -1
        cache[..., 0] = cache[..., 0].abs() + 0.5
    elif kind == "equal":  # identical keys everywhere -> identical positive scores
        cache[:] = cache[3, 0]
    else:  # a few winners, the rest exact zeros: the boundary falls inside the zeros
        q[:] = 0
        q[..., 1] = 1
        cache[..., 1] = -1
        for b, L in enumerate(lengths):
            for j in (2, (L // C) - 1):
                page, slot = table[b, j * C // 8], (j * C % 8) // C
                cache[page, slot, 1] = float(j + 1)
    budget = 3
    got = qsa_select_decode(q, cache, table, seq, budget)
    for b, L in enumerate(lengths):
        n = L // C
        if kind == "partial":
            # two positive winners, then the lowest-index exact-zero tie (n <= budget: everything)
            expect = [0, 1, 2] if n <= budget else [0, 2, n - 1]
        else:
            expect = [0, 1, 2]
        assert got[b].tolist() == expect[:budget], (kind, L, got[b])
    assert torch.equal(got, qsa_select_decode_ref(q, cache, table, seq, budget))


def test_select_verify_rows_and_explicit_rows(nan_poison):
    lengths = [11, 63, 130]
    Q = 3
    cache, table, seq, iq = _world(16, 11, lengths, rows=Q)
    got = qsa_select_decode(iq, cache, table, seq, 2)
    assert got.shape == (3, Q, 2)
    want = qsa_select_decode_ref(iq, cache, table, seq, 2)
    assert torch.equal(got, want)
    row_req, row_pos = uniform_rows(seq, Q)
    rows = qsa_select_rows(iq.reshape(-1, HI, DI), cache, table, seq, row_req.int(), row_pos.int(), 2)
    assert torch.equal(rows, got.reshape(-1, 2))
    assert torch.equal(rows, qsa_select_rows_ref(iq.reshape(-1, HI, DI), cache, table, seq, row_req, row_pos, 2))


def test_verify_rows_score_and_select_as_their_decode_rows(nan_poison):
    """Q = 10 verify rows (programs of 8 rows and of 2) read each key tile once for their request; every row's
    scores and selection are bitwise those of a decode at its own position, and nothing is written past a row's
    complete groups although the block table (max_model_len) is far wider than the contexts."""
    lengths, Q, budget = [11, 63, 130], 10, 2
    cache, table, seq, iq = _world(16, 13, lengths, rows=Q)
    table = torch.cat([table, torch.zeros(len(lengths), 40, dtype=torch.int32)], 1)
    groups = table.shape[1] * cache.shape[1]
    scores = torch.empty(len(lengths), Q, groups)
    got = qsa_select_decode(iq, cache, table, seq, budget, workspace=scores.view(-1, groups))
    for i in range(Q):
        row_scores = torch.empty(len(lengths), groups)
        one = qsa_select_decode(iq[:, i].contiguous(), cache, table, seq - (Q - 1 - i), budget, workspace=row_scores)
        assert torch.equal(got[:, i], one), i
        assert torch.equal(scores[:, i].nan_to_num(-1.0), row_scores.nan_to_num(-1.0)), i
        n = (seq - (Q - 1 - i)) // C
        for b in range(len(lengths)):
            want = torch.zeros(groups, dtype=torch.bool)
            want[:n[b]] = bool(n[b] > budget)  # rows that take every group are not scored
            assert torch.equal(~scores[b, i].isnan(), want), (i, b)

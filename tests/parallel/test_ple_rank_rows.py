"""RankRowsTable (parallel/ple.py) when tp leaves a rank no rows of the PLE table (5 rows over 4 ranks: 2, 2, 1, 0):
the ranks' parts still add up to the full lookup. Single process: the all-reduce is stood in for by the sum of the
ranks' parts, well under a second."""

from __future__ import annotations

import torch

from revolta.parallel.layers import vocab_range
from revolta.parallel.ple import RankRowsTable


class _Part:
    """A context whose all-reduce hands back this rank's part (the test adds the parts up)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_rank_parts_add_up_to_the_lookup_when_a_rank_owns_no_row():
    R, d, tp = 5, 3, 4
    table = torch.randn(R, d)
    rows = torch.tensor([[0, 4], [2, 3], [1, 4]])  # [T, H]
    parts = []
    for rank in range(tp):
        start, end, _ = vocab_range(R, rank, tp)
        t = RankRowsTable(table[start:end].clone(), None, torch.device("cpu"), 0, start, end, _Part())
        parts.append(t.start(rows, torch.float32, "torch")())
    assert vocab_range(R, tp - 1, tp)[:2] == (5, 5)  # the last rank owns nothing
    assert torch.equal(parts[-1], torch.zeros(3, 2 * d))
    assert torch.equal(sum(parts), table[rows].reshape(3, 2 * d))

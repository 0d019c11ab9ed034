"""The PLE n-gram table off the device at tp > 1: each rank owns one range of the table's rows (docs/parallel.md).

Rank r owns rows [r·⌈R/tp⌉, …) (the vocabulary's rule, `vocab_range`, without padding rows), and a lookup is a
masked gather plus one all-reduce: each rank fills the rows it owns, zeroes the others (FP8 x scale of a zeroed
row is 0), and the all-reduce adds the ranks' parts. Each row has exactly one owner, so the sum is the row itself,
bit for bit (x + 0 + ... + 0 == x). Where a rank keeps its rows follows the single-process placement:
- "device" (`RankRowsTable` on the rank's device): the rank's rows only, as a vocabulary-parallel embedding
  holds its rows, so each GPU carries 1/tp of the table (what the capacity dry run plans with);
- "host" (`RankRowsTable`): page-aligned host memory, pinned in place on a GPU run (ordinary memory on CPU);
  the gather reads local rows (other ids read local row 0 and are zeroed after dequantising). Only the rank's
  rows are read from the checkpoint (`PLELoader.load` with `RankRows`), so a node's host memory holds the table
  once, not once per rank.
- "disk" (`RankStagedRows`): the rows stay in the checkpoint's files; each rank starts its own PLE worker
  process (ple/disk.py, when its ModelRunner is built), which maps only the rank's row range of the shards
  and writes zero bytes for the rows other ranks own. A worker that dies or stalls fails its rank's step
  (PLEWorkerError); the rank reports it to rank 0 (engine/tp_executor.py) and the engine stops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..ple.shards import TableLayout
from ..ple.table import Finish, PLETable, StagedRows, TableRows
from .context import ParallelContext
from .layers import vocab_range


class RankRowsTable(PLETable):
    """A PLETable of rows [start, end) of the full table; `start` gives every rank the full rows (all-reduce)."""

    def __init__(self, weight: Tensor, scale: Tensor | None, device: torch.device, staged_min_tokens: int,
                 start: int, end: int, ctx: ParallelContext, placement: str = "host"):
        super().__init__(weight, scale, placement, device, staged_min_tokens)
        self.start_row, self.end_row, self.ctx = start, end, ctx

    @property
    def row_range(self) -> tuple[int, int]:
        return self.start_row, self.end_row

    def start(self, rows: Tensor, dtype: torch.dtype, backend: str) -> Finish:
        """rows [T, H] global row ids -> a function returning [T, H * d] in `dtype`, the same on every rank."""
        if self.end_row == self.start_row:  # a rank past the table's end (5 rows over 4 ranks: 2, 2, 1, 0) owns none
            part = torch.zeros(rows.shape[0], rows.shape[1] * self.weight.shape[1], dtype=dtype, device=rows.device)
            return lambda: self.ctx.all_reduce(part)
        mine = (rows >= self.start_row) & (rows < self.end_row)  # [T, H]
        finish = super().start((rows - self.start_row).masked_fill(~mine, 0), dtype, backend)
        T, H = rows.shape

        def done() -> Tensor:
            part = finish().view(T, H, -1).masked_fill(~mine[..., None], 0.0)
            return self.ctx.all_reduce(part).view(T, -1)
        return done


class RankStagedRows(StagedRows):
    """StagedRows whose worker reads rows [start, end) only (the rest are zero): the all-reduce gives every rank
    the full rows."""

    def __init__(self, layout: TableLayout, scale: Tensor | None, heads: int, device: torch.device, start: int,
                 end: int, ctx: ParallelContext):
        super().__init__(layout, scale, heads, device, (start, end))
        self.ctx = ctx

    def start(self, T: int, dtype: torch.dtype) -> Finish:
        """-> a function returning the step's [T, H * d] rows in `dtype`, the same on every rank."""
        finish = super().start(T, dtype)  # this rank's rows, zeros where another rank owns the row
        return lambda: self.ctx.all_reduce(finish())


class RankRows(TableRows):
    """What `PLELoader.load(device, RankRows(ctx))` reads on rank ctx.rank: its row range of every table, held by
    `RankRowsTable` (device or host rows) or `RankStagedRows` (disk: the rank's PLE worker reads the range)."""

    def __init__(self, ctx: ParallelContext):
        self.ctx = ctx

    def range(self, rows: int) -> tuple[int, int]:
        start, end, _ = vocab_range(rows, self.ctx.rank, self.ctx.size)
        return start, end

    def table(self, weight: Tensor, scale: Tensor | None, placement: str, device: torch.device,
              staged_min_tokens: int, rows: tuple[int, int]) -> PLETable:
        return RankRowsTable(weight, scale, device, staged_min_tokens, *rows, self.ctx, placement)

    def staged(self, layout: TableLayout, scale: Tensor | None, heads: int, device: torch.device,
               rows: tuple[int, int]) -> StagedRows:
        return RankStagedRows(layout, scale, heads, device, *rows, self.ctx)

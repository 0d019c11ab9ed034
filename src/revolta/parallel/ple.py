"""The PLE n-gram table off the device at tp > 1: each rank holds one range of the table's rows (docs/parallel.md).

Rank r owns rows [r·⌈R/tp⌉, …) (the vocabulary's rule, `vocab_range`, without padding rows) and keeps them
where the single-process "host" placement keeps the whole table: page-aligned host memory, pinned in place on
a GPU run (ordinary memory on CPU). A lookup gathers the rows this rank owns (others read local row 0 and are
zeroed after dequantising: FP8 x scale of a zeroed row is 0), and one all-reduce adds the ranks' parts: each
row has exactly one owner, so the sum is the row itself, bit for bit (x + 0 + ... + 0 == x).

Only the rank's rows are read from the checkpoint (`read_table` with a row range), so the host memory of a
node holds the table once, not once per rank.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from ..ple.load import PLELoader, host_tensor, logger, read_scale, read_table
from ..ple.table import STORAGE_DTYPES, Finish, PLETable
from .context import ParallelContext
from .layers import vocab_range


class RankRowsTable(PLETable):
    """A PLETable of rows [start, end) of the full table; `start` gives every rank the full rows (all-reduce)."""

    def __init__(self, weight: Tensor, scale: Tensor | None, device: torch.device, staged_min_tokens: int,
                 start: int, end: int, ctx: ParallelContext):
        super().__init__(weight, scale, "host", device, staged_min_tokens)
        self.start_row, self.end_row, self.ctx = start, end, ctx

    def start(self, rows: Tensor, dtype: torch.dtype, backend: str) -> Finish:
        """rows [T, H] global row ids -> a function returning [T, H * d] in `dtype`, the same on every rank."""
        mine = (rows >= self.start_row) & (rows < self.end_row)  # [T, H]
        finish = super().start((rows - self.start_row).masked_fill(~mine, 0), dtype, backend)
        T, H = rows.shape

        def done() -> Tensor:
            part = finish().view(T, H, -1).masked_fill(~mine[..., None], 0.0)
            return self.ctx.all_reduce(part).view(T, -1)
        return done


def load_rank_tables(loader: PLELoader, ctx: ParallelContext, device: str | torch.device = "cpu") -> None:
    """Read this rank's rows of every planned table into host memory and attach them (see the module docstring)."""
    device = torch.device(device)
    for p in loader.plans if not loader.as_weight else ():
        t0 = time.perf_counter()
        lay = p.layout
        start, end, _ = vocab_range(lay.rows, ctx.rank, ctx.size)
        raw = host_tensor((end - start) * lay.row_bytes)
        read_table(lay, raw, (start, end))
        weight = raw.view(STORAGE_DTYPES[lay.dtype]).view(end - start, lay.width)
        scale = None if p.scale is None else read_scale(p.scale, device)
        p.module.attach_table(RankRowsTable(weight, scale, device, loader.options.staged_min_tokens, start, end, ctx))
        logger.info("PLE table of layer %d, rank %d: rows [%d, %d) of %d in host memory (%.1f s)", p.layer_idx,
                    ctx.rank, start, end, lay.rows, time.perf_counter() - t0)

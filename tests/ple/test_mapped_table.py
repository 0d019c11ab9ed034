"""MappedTable, the disk worker's row reader, on a table in 5 shards over 2 files at unaligned offsets: the whole
table and a tensor-parallel rank's row range (`TableLayout.restrict`, cut inside shards) gather the right bytes,
with the thread pool and page release on; the range maps only its shards' pages."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from revolta.ple.shards import PARALLEL_MIN_ROWS, MappedTable, TableLayout, TableShard

ROW_BYTES = 24  # 12 BF16 values


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """(layout, the table's bytes [rows, ROW_BYTES]): shards of 3000, 2500 | 1700, 4000, 1800 rows in two files."""
    rng = np.random.default_rng(0)
    sizes = [[3000, 2500], [1700, 4000, 1800]]
    truth = rng.integers(0, 256, size=(sum(map(sum, sizes)), ROW_BYTES), dtype=np.uint8)
    shards, row, tmp = [], 0, tmp_path_factory.mktemp("mapped")
    for f, rows_of in enumerate(sizes):
        path, offset, blob = tmp / f"part{f}.bin", 1000 + 37 * f, bytearray(b"h" * (1000 + 37 * f))
        for n in rows_of:
            shards.append(TableShard(str(path), f"shard_{len(shards)}", row, n, offset))
            blob += truth[row:row + n].tobytes()
            row, offset = row + n, offset + n * ROW_BYTES
        path.write_bytes(bytes(blob))
    return TableLayout("t", "BF16", row, ROW_BYTES // 2, tuple(shards)), truth


@pytest.mark.parametrize("threads, release", [(1, False), (4, True)])
def test_whole_table_and_a_rank_range_gather_the_right_rows(table, threads, release):
    layout, truth = table
    rng = np.random.default_rng(1)
    ids = rng.integers(0, layout.rows, size=2 * PARALLEL_MIN_ROWS)  # enough unique rows for the pool
    out = np.empty((ids.size, ROW_BYTES), dtype=np.uint8)
    MappedTable(layout, threads, release).gather(ids, out)
    np.testing.assert_array_equal(out, truth[ids])

    lo, hi = 4000, 8500  # from inside shard 1 to inside shard 3
    part = layout.restrict(lo, hi)
    assert [(s.name, s.row_start, s.rows) for s in part.shards] == [("shard_1", 0, 1500), ("shard_2", 1500, 1700),
                                                                    ("shard_3", 3200, 1300)]
    ranged = MappedTable(part, threads, release, prefault=True)
    assert ranged.mapped_bytes <= (hi - lo) * ROW_BYTES + 3 * mmap.ALLOCATIONGRANULARITY  # its rows' pages only
    local = rng.integers(0, hi - lo, size=PARALLEL_MIN_ROWS + 100)
    out = np.empty((local.size, ROW_BYTES), dtype=np.uint8)
    ranged.gather(local, out)
    np.testing.assert_array_equal(out, truth[lo + local])
    with pytest.raises(ValueError, match=r"rows \[0, 99999\) are not inside"):
        layout.restrict(0, 99_999)

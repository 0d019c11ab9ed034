"""MappedTable, the disk worker's row reader, on a table in 5 shards over 2 files at unaligned offsets: the whole
table and a tensor-parallel rank's row range (`TableLayout.restrict`, cut inside shards) gather the right bytes,
with the thread pool and page release on; the range maps only its shards' pages."""

from __future__ import annotations

import mmap
import os

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


def _present_pages(table: MappedTable) -> tuple[int, int]:
    """(pages of the table's mappings present in this process's page tables, pages in them): /proc/self/pagemap,
    bit 63 of each page's entry."""
    present = total = 0
    try:
        pm = open("/proc/self/pagemap", "rb")
    except OSError as e:  # a hardened container may refuse it
        pytest.skip(f"/proc/self/pagemap cannot be read here: {e}")
    with pm:
        for m in table._maps:
            if m is None:
                continue
            base, pages = np.frombuffer(m[0], dtype=np.uint8).ctypes.data, -(-len(m[0]) // mmap.PAGESIZE)
            pm.seek(base // mmap.PAGESIZE * 8)
            entries = np.frombuffer(pm.read(8 * pages), dtype=np.uint64)
            present, total = present + int((entries >> np.uint64(63)).sum()), total + pages
    return present, total


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="needs Linux's /proc/self/pagemap")
def test_prefault_maps_every_page_before_the_first_gather(table):
    """With prefault (and no page release) a background thread maps the shards, so a gather of rows never read takes
    no page fault; without it a fresh mapping has none of its pages mapped."""
    layout, truth = table
    cold = MappedTable(layout, 1)
    assert cold.populated.is_set() and _present_pages(cold)[0] == 0
    warm = MappedTable(layout, 1, prefault=True)
    assert warm.populated.wait(30), "the populate thread did not finish in 30 s"
    kernel = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    if kernel < (5, 14):  # MADV_POPULATE_READ came in Linux 5.14: older kernels get the readahead alone
        pytest.skip(f"Linux {os.uname().release} has no MADV_POPULATE_READ (5.14+): {warm.populate_error}")
    assert warm.populate_error is None
    present, total = _present_pages(warm)
    assert present == total > 0
    ids = np.arange(0, layout.rows, 97)
    out = np.empty((ids.size, ROW_BYTES), dtype=np.uint8)
    warm.gather(ids, out)
    np.testing.assert_array_equal(out, truth[ids])
    released = MappedTable(layout, 1, release_pages=True, prefault=True)  # pages dropped after each gather anyway
    assert released.populated.is_set() and _present_pages(released)[0] == 0

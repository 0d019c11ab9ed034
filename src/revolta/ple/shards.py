"""Byte layout of the PLE table in safetensors shards, and row gathers from memory-mapped shards (torch-free).

A safetensors file is an 8-byte little-endian header length, a JSON header (dtype, shape and
[begin, end) data offsets per tensor) and the raw little-endian data. A table shard [rows, d] is
therefore `rows * d * itemsize` contiguous bytes at a known file offset, so the loader can read it
straight into the table's memory and the worker can map it without copying.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

ITEMSIZE = {"F8_E4M3": 1, "F16": 2, "BF16": 2, "F32": 4}  # the table dtypes
PAGE = mmap.PAGESIZE
PARALLEL_MIN_ROWS = 4096  # fewer unique rows are gathered on the calling thread (a pool costs more)
MADV_POPULATE_READ = 22  # Linux >= 5.14 (not in Python's mmap module before 3.13)


@dataclass(frozen=True)
class TensorBytes:
    dtype: str  # safetensors name: F8_E4M3, BF16, ...
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


def read_header(path: str | os.PathLike) -> dict[str, TensorBytes]:
    """Every tensor of one safetensors file by name (reads the header only)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    base = 8 + size
    return {name: TensorBytes(v["dtype"], tuple(v["shape"]), base + v["data_offsets"][0],
                              v["data_offsets"][1] - v["data_offsets"][0])
            for name, v in header.items() if name != "__metadata__"}


@dataclass(frozen=True)
class TableShard:
    """Rows [row_start, row_start + rows) of a table, stored row-major at byte `offset` of `file`."""

    file: str
    name: str
    row_start: int
    rows: int
    offset: int


@dataclass(frozen=True)
class TableLayout:
    """One PLE layer's table on disk: `rows` x `width` values of safetensors dtype `dtype` in `shards`."""

    name: str  # the model's name of the table, e.g. model.language_model.layers.1.ple.ple_embedding.ngram_embedding
    dtype: str
    rows: int
    width: int
    shards: tuple[TableShard, ...]

    @property
    def row_bytes(self) -> int:
        return self.width * ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def restrict(self, start: int, end: int) -> TableLayout:
        """Rows [start, end) of this table as a table of its own (row 0 = row `start`): the shards that hold
        them, cut to those rows (a tensor-parallel rank's PLE worker maps only these)."""
        if not 0 <= start <= end <= self.rows:
            raise ValueError(f"rows [{start}, {end}) are not inside the {self.rows} rows of {self.name}")
        shards = []
        for s in self.shards:
            lo, hi = max(start, s.row_start), min(end, s.row_start + s.rows)
            if lo < hi:
                shards.append(TableShard(s.file, s.name, lo - start, hi - lo,
                                         s.offset + (lo - s.row_start) * self.row_bytes))
        return TableLayout(self.name, self.dtype, end - start, self.width, tuple(shards))


def _page_range(start: int, end: int) -> tuple[int, int]:
    lo = start // PAGE * PAGE
    return lo, end - lo


class MappedTable:
    """A table read through read-only mappings of its shard files: no copy beyond the page cache.

    gather(rows, out): out[i] = the bytes of row rows[i]. Each shard reads its sorted unique rows
    (one pass over the file in order), on `threads` threads when there are many; with
    `release_pages` the mapped pages a gather touched are dropped afterwards (MADV_DONTNEED on the
    file-backed mapping: the process's RSS shrinks, the page cache keeps them).

    `prefault`: the kernel reads the shards ahead (MADV_WILLNEED) and, unless pages are released, a background
    thread maps every page (MADV_POPULATE_READ, a shard at a time, the GIL released), so that a gather of rows this
    process has not read yet takes no page fault per row. Why: on an H100 host a 30K-token step of new rows took
    1.98 s with the table in the page cache against 0.34 s for rows already mapped (benchmarks/RESULTS.md P1), the
    difference being ~400 K minor faults. `populated` is set when the thread is done; `populate_error` says why it
    stopped early (e.g. a kernel before 5.14: the readahead alone).
    """

    def __init__(self, layout: TableLayout, threads: int = 1, release_pages: bool = False, prefault: bool = False):
        self.layout, self.release_pages = layout, release_pages
        rb = layout.row_bytes
        # one mapping per shard, of its rows only (from the page holding its first byte): a tensor-parallel
        # rank's worker maps its own row range, not the whole files
        self._maps: list[tuple[mmap.mmap, int] | None] = []  # (mapping, file offset of its first byte)
        self._views = []
        for s in layout.shards:
            if s.rows == 0:
                self._maps.append(None)
                self._views.append(np.empty((0, rb), dtype=np.uint8))
                continue
            lo = s.offset // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
            with open(s.file, "rb") as f:
                mm = mmap.mmap(f.fileno(), s.offset + s.rows * rb - lo, access=mmap.ACCESS_READ, offset=lo)
            mm.madvise(mmap.MADV_RANDOM)  # single rows: read-ahead would only waste I/O
            if prefault:
                mm.madvise(mmap.MADV_WILLNEED)
            self._maps.append((mm, lo))
            self._views.append(np.frombuffer(mm, dtype=np.uint8, count=s.rows * rb, offset=s.offset - lo)
                               .reshape(s.rows, rb))
        self._starts = np.array([s.row_start for s in layout.shards] + [layout.rows], dtype=np.int64)
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="ple-gather") if threads > 1 else None
        self.populated, self.populate_error = threading.Event(), None
        if prefault and not release_pages:
            threading.Thread(target=self._populate, name="ple-populate", daemon=True).start()
        else:
            self.populated.set()

    def _populate(self) -> None:
        """Map every page of the shard mappings (see the class docstring); libc's madvise through ctypes, which
        releases the GIL while the kernel reads and maps."""
        try:
            madvise = ctypes.CDLL(None, use_errno=True).madvise
            madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            for m in self._maps:
                if m is None:
                    continue
                base = np.frombuffer(m[0], dtype=np.uint8).ctypes.data  # the mapping's first byte (page aligned)
                if madvise(base, len(m[0]), MADV_POPULATE_READ) != 0:
                    self.populate_error = f"madvise(MADV_POPULATE_READ): {os.strerror(ctypes.get_errno())}"
                    return
        finally:
            self.populated.set()

    @property
    def mapped_bytes(self) -> int:
        return sum(len(m[0]) for m in self._maps if m is not None)

    def gather(self, rows: np.ndarray, out: np.ndarray) -> None:
        """rows [N] int64 table rows -> out [N, row_bytes] uint8."""
        uniq, inverse = np.unique(rows, return_inverse=True)  # sorted: each shard reads in file order
        bounds = np.searchsorted(uniq, self._starts)  # uniq[bounds[s]:bounds[s+1]] lie in shard s
        rows_of = np.empty((uniq.shape[0], self.layout.row_bytes), dtype=np.uint8)
        work = [s for s in range(len(self._views)) if bounds[s + 1] > bounds[s]]

        def one(s: int) -> None:
            a, b = bounds[s], bounds[s + 1]
            np.take(self._views[s], uniq[a:b] - self._starts[s], axis=0, out=rows_of[a:b])
            if self.release_pages:
                self._release(s, int(uniq[a] - self._starts[s]), int(uniq[b - 1] - self._starts[s]) + 1)

        if self._pool is not None and uniq.shape[0] >= PARALLEL_MIN_ROWS and len(work) > 1:
            list(self._pool.map(one, work))
        else:
            for s in work:
                one(s)
        np.take(rows_of, inverse.reshape(-1), axis=0, out=out)

    def _release(self, s: int, lo: int, hi: int) -> None:
        (mm, base), shard, rb = self._maps[s], self.layout.shards[s], self.layout.row_bytes
        start = shard.offset - base  # the shard's first byte within its mapping
        mm.madvise(mmap.MADV_DONTNEED, *_page_range(start + lo * rb, start + hi * rb))

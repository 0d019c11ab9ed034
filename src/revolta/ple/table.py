"""The tables a PLE layer looks its n-gram rows up in when the table is not a plain weight (spec/engine.md §6).

- `PLETable`: the whole table in one tensor, in the checkpoint's storage dtype (FP8 E4M3 with its
  global scale, or 16/32-bit): on the device ("device" placement of an FP8 checkpoint) or in pinned
  host memory ("host"). On a GPU with the Triton kernels the gather reads host rows through the
  mapped view (kernels/ple_gather.py), inside CUDA graphs too, on a side stream that overlaps the
  layers before the PLE layer; steps of at least `staged_min_tokens` tokens may instead gather on the
  host into a pinned staging buffer and copy once. On a CPU run the host table is ordinary memory.
- `StagedRows`: the "disk" placement. The worker process gathers a step's rows before the step runs
  (disk.DiskRowFeeder) into a device buffer; the layer reads its first T rows. Nothing waits on the
  device: a CUDA graph replays only after its rows are in the buffer.

Both dequantise the same way (kernels/ple_gather.dequantize_rows), so every placement gives the
same bits as the device weight.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from ..kernels.ple_gather import dequantize_rows, ple_gather, ple_gather_ref
from .shards import TableLayout

Finish = Callable[[], Tensor]  # waits for a started lookup and returns its rows [T, H * d]
STORAGE_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F16": torch.float16, "BF16": torch.bfloat16,
                  "F32": torch.float32}


def _done(out: Tensor) -> Finish:
    return lambda: out


def pin_host_memory(t: Tensor) -> Callable[[], None]:
    """Page-lock `t`'s memory in place (cudaHostRegister: mapped and portable under unified addressing,
    exactly its bytes, unlike the caching pinned allocator, which rounds sizes up to a power of two).
    Returns the function that unregisters it."""
    cudart = torch.cuda.cudart()
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.2f} GiB failed ({err}); the PLE table needs that "
                           "much lockable host memory (check `ulimit -l` and the container's memory limit), or use "
                           "ple_placement='disk'")
    return lambda: cudart.cudaHostUnregister(ptr)


class PLETable:
    """A whole table [rows, d] in its storage dtype, with its scale (fp32, 0-dim, on `device`) or None."""

    def __init__(self, weight: Tensor, scale: Tensor | None, placement: str, device: torch.device,
                 staged_min_tokens: int = 0):
        self.weight, self.scale, self.placement = weight, scale, placement
        self.device = torch.device(device)
        self.staged_min_tokens = staged_min_tokens
        self._side: torch.cuda.Stream | None = None
        self._staging: Tensor | None = None
        self._staging_done: torch.cuda.Event | None = None
        if placement == "host" and self.device.type == "cuda" and not weight.is_pinned():
            weakref.finalize(self, pin_host_memory(weight))

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    @property
    def row_range(self) -> tuple[int, int]:
        """The table rows [lo, hi) this object holds (all of them here; one rank's in parallel/ple.RankRowsTable)."""
        return 0, self.weight.shape[0]

    def start(self, rows: Tensor, dtype: torch.dtype, backend: str) -> Finish:
        """rows [T, H] on the compute device -> a function returning [T, H * d] in `dtype`."""
        T, H = rows.shape
        out = torch.empty(T, H * self.weight.shape[1], dtype=dtype, device=rows.device)
        if backend != "triton":
            return _done(ple_gather_ref(self.weight, rows, self.scale, out))
        if self.placement != "host" or not rows.is_cuda:
            return _done(ple_gather(self.weight, rows, self.scale, out))
        capturing = torch.cuda.is_current_stream_capturing()
        if 0 < self.staged_min_tokens <= T and not capturing:
            return _done(self._staged(rows, out))
        # a host table read over PCIe on a side stream: the layers before the PLE layer run meanwhile
        main = torch.cuda.current_stream(rows.device)
        if self._side is None:
            self._side = torch.cuda.Stream(rows.device)
        side = self._side
        side.wait_stream(main)  # rows and out were made on the main stream
        with torch.cuda.stream(side):
            ple_gather(self.weight, rows, self.scale, out)

        def finish(rows: Tensor = rows) -> Tensor:  # rows stay allocated until the side stream is joined
            main.wait_stream(side)
            return out
        return finish

    def _staged(self, rows: Tensor, out: Tensor) -> Tensor:
        """Gather on the host into a pinned staging buffer, one copy to the device, dequantise there."""
        ids = rows.reshape(-1).cpu()
        n, table = ids.numel(), self.weight.view(torch.uint8).view(self.weight.shape[0], -1)
        if self._staging_done is not None:
            self._staging_done.synchronize()  # the previous copy out of the buffer has finished
        if self._staging is None or self._staging.shape[0] < n:
            self._staging = torch.empty(n, table.shape[1], dtype=torch.uint8, pin_memory=True)
        torch.index_select(table, 0, ids, out=self._staging[:n])
        raw = self._staging[:n].to(out.device, non_blocking=True).view(self.weight.dtype)
        self._staging_done = torch.cuda.Event()
        self._staging_done.record()
        return out.copy_(dequantize_rows(raw, self.scale, out.dtype).view(out.shape))


class StagedRows:
    """The disk placement's rows of the current step: [capacity, H * d] storage-dtype buffer on the device,
    filled by disk.DiskRowFeeder before every forward or graph replay (allocated when the feeder starts).
    row_range: the rows [lo, hi) the worker reads (the whole table by default; a tensor-parallel rank's share,
    the other rows zero, in parallel/ple.RankStagedRows)."""

    def __init__(self, layout: TableLayout, scale: Tensor | None, heads: int, device: torch.device,
                 row_range: tuple[int, int] | None = None):
        self.layout, self.scale, self.heads, self.device = layout, scale, heads, torch.device(device)
        self.row_range = (0, layout.rows) if row_range is None else row_range
        self.dtype = STORAGE_DTYPES[layout.dtype]
        self.buffer: Tensor | None = None

    nbytes = 0  # nothing of the table is held in this process

    def allocate(self, capacity: int) -> Tensor:
        self.buffer = torch.empty(capacity, self.heads * self.layout.width, dtype=self.dtype, device=self.device)
        return self.buffer

    def start(self, T: int, dtype: torch.dtype) -> Finish:
        if self.buffer is None:
            raise RuntimeError("with ple_placement='disk' the PLE rows come from the PLE worker, which the engine's "
                               "ModelRunner starts; run the model through revolta.LLM or Engine")
        if T > self.buffer.shape[0]:
            raise RuntimeError(f"a forward of {T} tokens needs more PLE rows than the {self.buffer.shape[0]} the "
                               "worker's buffers hold; raise max_num_batched_tokens when the engine is built")
        return _done(dequantize_rows(self.buffer[:T], self.scale, dtype))


class TableRows:
    """Which rows of each table this process reads, and the objects that hold them: the whole table here
    (PLETable, StagedRows); a tensor-parallel rank's row range and its all-reducing tables in parallel/ple.RankRows.
    `PLELoader.load` asks it, so one loading path serves both."""

    def range(self, rows: int) -> tuple[int, int]:
        """The rows [lo, hi) of a table of `rows` rows to read."""
        return 0, rows

    def table(self, weight: Tensor, scale: Tensor | None, placement: str, device: torch.device,
              staged_min_tokens: int, rows: tuple[int, int]) -> PLETable:
        """The table over `weight` [hi - lo, d], the rows `rows` read onto the device or into host memory."""
        return PLETable(weight, scale, placement, device, staged_min_tokens)

    def staged(self, layout: TableLayout, scale: Tensor | None, heads: int, device: torch.device,
               rows: tuple[int, int]) -> StagedRows:
        """The disk placement's rows, `rows` of the table read by the PLE worker."""
        return StagedRows(layout, scale, heads, device, rows)

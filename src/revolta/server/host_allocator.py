"""Make freed media buffers leave the process: fix glibc's mmap threshold in `revolta serve`.

glibc serves a request of at least M_MMAP_THRESHOLD bytes with its own mapping and unmaps it on free. Left alone it
raises that threshold (up to 32 MiB on 64-bit) each time such a mapping is freed, and from then on a decoded image's
~18 MB buffers come from the heap of whichever worker thread decoded it, and stay there once freed. The media
budget (media_budget.py) bounds the bytes decoding at once, but each of the executor's threads keeps its own freed
copy: six threads decoding 3000 x 2000 px images in turn left ~170 MiB resident in a bare process, and a burst of
64 image requests grew the server's peak RSS by 148 MiB against a 64 MiB budget on the 2-core CI machine. Setting
the threshold explicitly turns the dynamic raise off (mallopt(3)), so blocks that large are unmapped when freed.

Process-wide, so only the `revolta serve` entry point calls it; `revolta.LLM` used as a library leaves the
allocator alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util

MMAP_THRESHOLD = 1 << 20  # bytes: blocks this large get their own mapping (a page-table cost only above 1 MiB)
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc malloc.h)


def return_large_frees_to_os(threshold: int = MMAP_THRESHOLD) -> str:
    """Fix the allocator's mmap threshold at `threshold` bytes; returns what was done, for the startup summary."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:  # not glibc (musl, macOS): their allocators do not keep a raised threshold
        return "allocator unchanged (no mallopt)"
    if mallopt(_M_MMAP_THRESHOLD, threshold) != 1:
        return "allocator unchanged (mallopt refused the mmap threshold)"
    return f"blocks >= {threshold >> 20} MiB unmapped when freed (mmap threshold fixed)"

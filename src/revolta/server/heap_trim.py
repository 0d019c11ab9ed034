"""Give the heap back after a large media decode: glibc's malloc_trim(0) on the decoding thread.

glibc raises its mmap threshold (up to 32 MiB on 64-bit) each time a large mapped block is freed; from then on a
decoded image's ~18 MB buffers come from the heap arena of whichever worker thread decoded it, and stay resident
once freed. The media budget (media_budget.py) bounds the bytes decoding at once, but each of the executor's threads
kept its own freed copy: six threads decoding 3000 x 2000 px images in turn left 139 MiB resident in a bare
interpreter, and a burst of 64 image requests grew the server's peak RSS by 148 MiB against a 64 MiB budget on the
2-core CI machine. malloc_trim(0) returns every arena's free pages (2 MiB left in the same bare test; one call took
up to 50 ms there, on the worker thread, the GIL released), so the renderer calls it after decoding media priced at
TRIM_MIN_BYTES or more.

Not the alternative, a fixed mmap threshold (mallopt): that also unmaps every large block the CPU model frees, and an
8K-token prefill of the embedded default on the CPU took 25-45% longer with it (2.2 s -> 2.8-3.5 s, thresholds 1-8 MiB).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

TRIM_MIN_BYTES = 16 << 20  # media priced at least this (peak decode bytes) trim after decoding; smaller ones leave
# little behind for what the walk over every arena costs


def heap_trimmer() -> Callable[[], int] | None:
    """A function that hands the C heap's free pages back to the OS (glibc's malloc_trim(0)), or None where the C
    library has no malloc_trim (musl, macOS: their allocators do not keep a raised mmap threshold)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return functools.partial(trim, 0)

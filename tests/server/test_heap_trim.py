"""server/heap_trim.py: after a large media decode the freed buffers leave the RSS, on whichever thread decoded.

A fresh interpreter decodes a 3000 x 2000 px PNG (and a float copy of it) twelve times over a six-thread pool, as
the server's executor does, and reports how much its RSS grew. Without the trim glibc keeps a freed copy in each
thread's arena (~140 MiB here); with `heap_trimmer()` called after each decode, as PromptRenderer does, the growth
stays under one image's float copy.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

WORKLOAD = """
import concurrent.futures, io, sys
import numpy as np
from PIL import Image
from revolta.server.heap_trim import heap_trimmer
trim = heap_trimmer() if sys.argv[1] == "trim" else None
assert sys.argv[1] != "trim" or trim is not None, "no malloc_trim in this C library"
def rss():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) * 1024
buf = io.BytesIO()
Image.new("RGB", (3000, 2000), (1, 90, 160)).save(buf, format="PNG")
data = buf.getvalue()
def decode(_):
    image = Image.open(io.BytesIO(data)).convert("RGB")  # 18 MB
    pixels = np.asarray(image).astype(np.float32)  # 72 MB
    size = image.resize((256, 170)).size
    del image, pixels
    if trim is not None:
        trim()
    return size
start = rss()
with concurrent.futures.ThreadPoolExecutor(6) as pool:
    list(pool.map(decode, range(12)))
    print(rss() - start)
"""

MiB = 2**20


def rss_growth(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", WORKLOAD, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status; malloc_trim is glibc's")
def test_freed_decode_buffers_leave_the_rss():
    kept = rss_growth("keep")
    if kept < 64 * MiB:
        pytest.skip(f"this allocator keeps no freed copies per thread ({kept / MiB:.0f} MiB): nothing to trim")
    trimmed = rss_growth("trim")
    assert trimmed < 40 * MiB, f"RSS grew {trimmed / MiB:.0f} MiB with the trim ({kept / MiB:.0f} MiB without)"

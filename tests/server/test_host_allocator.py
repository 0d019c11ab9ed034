"""server/host_allocator.py: with the mmap threshold fixed, media buffers freed on worker threads leave the RSS.

A fresh interpreter decodes a 3000 x 2000 px PNG (and a float copy of it) twelve times over a six-thread pool, as
the server's executor does, and reports how much its RSS grew. Without the fix glibc keeps a freed copy per thread
(~170 MiB here); with it the growth stays under one image's float copy.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

WORKLOAD = """
import concurrent.futures, io, sys
import numpy as np
from PIL import Image
if sys.argv[1] == "fixed":
    from revolta.server.host_allocator import return_large_frees_to_os
    assert "unmapped" in return_large_frees_to_os(), "mallopt refused"
def rss():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) * 1024
buf = io.BytesIO()
Image.new("RGB", (3000, 2000), (1, 90, 160)).save(buf, format="PNG")
data = buf.getvalue()
def decode(_):
    image = Image.open(io.BytesIO(data)).convert("RGB")  # 18 MB
    pixels = np.asarray(image).astype(np.float32)  # 72 MB
    return image.resize((256, 170)).size, pixels.shape
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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status; mallopt is glibc's")
def test_freed_media_buffers_leave_the_rss():
    default = rss_growth("default")
    if default < 64 * MiB:
        pytest.skip(f"this allocator keeps no freed copies per thread ({default / MiB:.0f} MiB): nothing to fix")
    fixed = rss_growth("fixed")
    assert fixed < 40 * MiB, f"RSS grew {fixed / MiB:.0f} MiB with the threshold fixed ({default / MiB:.0f} without)"

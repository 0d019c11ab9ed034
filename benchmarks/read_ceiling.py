"""The fastest one kernel can read a packed linear's bytes: a ceiling for the one-row GEMV measured in the same run.

"% of copy" divides the GEMV's bandwidth on its packed bytes by a 1 GiB copy's: a rate that a 2-16 MB read inside
one short kernel cannot reach (ramp-up, the last wave's tail, the launch gap between graph nodes). `read_us` times
a kernel that only reads the same bytes (an OR over int32 words, one word out a program), graph-replayed back to back
over the same rotating copies as the GEMV: the GEMV's time over it says how far the kernel is from what reading its
bytes costs at that size, beside "% of copy".
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

READ_BLOCK = 4096  # int32 words a program reads (16 KB), 8 warps: each thread keeps 16 loads in flight


@triton.jit
def _read_or_kernel(src, out, n, BLOCK: tl.constexpr):
    """out[pid] = OR of src's words [pid·BLOCK, (pid + 1)·BLOCK) (int32): a read of src and nothing else."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    w = tl.load(src + o, mask=o < n, other=0)
    tl.store(out + tl.program_id(0), tl.reduce_or(w, 0))


def read_words(t: dict) -> torch.Tensor:
    """The packed tensors of one linear as one flat int32 buffer (a copy: equal bytes, one allocation)."""
    flat = torch.cat([v.contiguous().view(-1).view(torch.uint8) for v in t.values()])
    pad = (-flat.numel()) % 4
    return torch.cat([flat, flat.new_zeros(pad)]).view(torch.int32)


def read_us(copies: list[dict], bench, small: bool) -> float:
    """µs to read one copy's packed bytes (read_words) in one kernel: a CUDA graph of back-to-back reads over
    `copies` (the GEMV's rotating weights, so every read comes from memory), timed by bench_quant.bench."""
    bufs = [read_words(t) for t in copies]
    n = bufs[0].numel()
    grid = (triton.cdiv(n, READ_BLOCK),)
    out = torch.empty(grid[0], dtype=torch.int32, device=bufs[0].device)

    def read_all():
        for b in bufs:
            _read_or_kernel[grid](b, out, n, BLOCK=READ_BLOCK, num_warps=8)

    _read_or_kernel[grid](bufs[0], out, n, BLOCK=READ_BLOCK, num_warps=8)
    host = torch.cat([bufs[0].cpu(), bufs[0].new_zeros(grid[0] * READ_BLOCK - n, device="cpu")]).numpy()
    want = np.bitwise_or.reduce(host.reshape(grid[0], READ_BLOCK), axis=1)
    assert (want == out.cpu().numpy()).all(), "the read kernel did not read every word"
    return bench(read_all, small, True, len(bufs)) * 1e3

"""PLE table row gather: out[t, h*d:(h+1)*d] = dequant(table[rows[t, h]]), from device or host-mapped memory.

The n-gram table is [R, d] in the checkpoint's storage dtype: FP8 E4M3 with one global scale
(dequantised as fp32(q) * scale), or 16/32-bit (no scale). `table` may be a device tensor or
pinned host memory: Triton's launcher turns a pointer into the address the device reads it at
(cuPointerGetAttribute DEVICE_POINTER), which for pinned memory under unified addressing is a
mapped view, so the kernel reads the host rows over PCIe directly and can sit inside a CUDA graph
(spec/engine.md §6.2). FP8 bytes are decoded with integer ops (qsa/common.e4m3_decode), not a float8
load: sm70 has no float8 conversion instructions, and the decode is exact (NaN codes aside, which a
table does not hold).

Both functions take (table [R, d], rows [T, H] int64, scale: 0-dim fp32 tensor or None, out
[T, H * d]) and return out; rows index [0, R) by construction (hash mod a head's prime + offset).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .qsa.common import e4m3_decode

FP8 = torch.float8_e4m3fn
TABLE_DTYPES = (FP8, torch.float16, torch.bfloat16, torch.float32)


def dequantize_rows(raw: Tensor, scale: Tensor | None, dtype: torch.dtype) -> Tensor:
    """Stored rows -> `dtype`: fp32(q) * scale for a scaled (FP8) table, else a plain cast."""
    if scale is None:
        return raw.to(dtype)
    return (raw.float() * scale.to(raw.device)).to(dtype)


def ple_gather_ref(table: Tensor, rows: Tensor, scale: Tensor | None, out: Tensor) -> Tensor:
    """Torch reference of `ple_gather` (rows and the table may sit on different devices)."""
    T, H = rows.shape
    d = table.shape[1]
    ids = rows.reshape(-1).to(table.device)
    raw = table.view(torch.uint8).view(table.shape[0], -1)[ids].view(table.dtype)  # fp8 has no CPU index kernel
    out.copy_(dequantize_rows(raw.to(out.device), scale, out.dtype).view(T, H * d))
    return out


@triton.jit
def _ple_gather_kernel(table, rows, scale, out, N, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                       IS_FP8: tl.constexpr, HAS_SCALE: tl.constexpr):
    """One program gathers BLOCK_R of the N = T * H looked-up rows (d values each)."""
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_D)
    rmask = r < N
    row = tl.load(rows + r, mask=rmask, other=0)  # int64
    mask = rmask[:, None] & (c[None, :] < D)
    v = tl.load(table + row[:, None] * D + c[None, :], mask=mask, other=0)
    if IS_FP8:
        v = e4m3_decode(v).to(tl.float32) * 256.0  # exact: e4m3_decode gives value * 2^-8 in fp16
    else:
        v = v.to(tl.float32)
    if HAS_SCALE:
        v = v * tl.load(scale)
    tl.store(out + r[:, None].to(tl.int64) * D + c[None, :], v.to(out.dtype.element_ty), mask=mask)


def gather_config(d: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_D): the row width padded to a power of two, ~2K values per program."""
    block_d = triton.next_power_of_2(d)
    return max(1, 2048 // block_d), block_d


def ple_gather(table: Tensor, rows: Tensor, scale: Tensor | None, out: Tensor) -> Tensor:
    """Triton gather (see the module docstring); `table` on the device or in pinned host memory."""
    T, H = rows.shape
    R, d = table.shape
    if table.dtype not in TABLE_DTYPES:
        raise ValueError(f"PLE table dtype {table.dtype}; expected one of {TABLE_DTYPES}")
    if tuple(out.shape) != (T, H * d) or not out.is_contiguous() or not table.is_contiguous():
        raise ValueError(f"ple_gather: out {tuple(out.shape)} must be contiguous [{T}, {H * d}] and the table contiguous")
    if (scale is not None) != (table.dtype == FP8):
        raise ValueError("an FP8 PLE table needs its scale, and a 16/32-bit table has none")
    N = T * H
    if N == 0:
        return out
    block_r, block_d = gather_config(d)
    src = table.view(torch.uint8) if table.dtype == FP8 else table
    _ple_gather_kernel[(triton.cdiv(N, block_r),)](
        src, rows.reshape(-1).contiguous(), scale if scale is not None else out, out, N, D=d, BLOCK_R=block_r,
        BLOCK_D=block_d, IS_FP8=table.dtype == FP8, HAS_SCALE=scale is not None)
    return out

"""Shared pieces of the QSA kernels: KV storage formats, E4M3/int8 codecs, row metadata.

KV formats (`kv_dtype`):
  "auto"      the cache holds the model dtype (fp16/bf16): plain copy.
  "fp8_e4m3"  the cache is uint8 holding OCP E4M3 bits with one fp32 scale per layer and per
              K/V (`k_scale`, `v_scale`: 1-element fp32 tensors). stored = e4m3(sat448(x / scale)),
              value = e4m3 * scale. Encoding and decoding use integer bit operations only, so the
              sm_70 build has no fp8 instructions (Triton rejects fp8e4nv below sm_89).
  "int8"      the cache is int8 with per-token-per-head fp32 scales `k_scale, v_scale`
              [num_blocks, block_size, KVH]: scale = absmax / 127, q = rne(x / scale).

Decoding trick (E4M3 -> fp16): the 7 magnitude bits shifted left by 7 land on the low exponent bits
and high mantissa bits of an fp16, which then equals value * 2^-8 exactly, subnormals included
(both formats have subnormals and the bias differs by 8). The factor 256 is folded into the scale.

Rows: attention/selection work on "rows" = query tokens. A row has a request b (its block_table /
seq_lens row) and a token index t. Uniform rows (decode Q = 1, speculative verify Q = 2..8): row r
is request r // Q at t = seq_lens[b] - Q + r % Q. Explicit rows (prefill): `row_req`, `row_pos`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

KV_FORMATS = {"auto": 0, "fp16": 0, "bf16": 0, "fp32": 0, "fp8_e4m3": 1, "int8": 2}
E4M3_MAX = 448.0
FP8_DECODE_FACTOR = 256.0  # e4m3_decode returns value * 2^-8
_RNE_MAGIC = 12582912.0  # 1.5 * 2^23: (x + M) - M rounds |x| < 2^22 to nearest even


def kv_format(kv_dtype: str) -> int:
    if kv_dtype not in KV_FORMATS:
        raise ValueError(f"kv_dtype must be one of {sorted(KV_FORMATS)}, got {kv_dtype!r}")
    return KV_FORMATS[kv_dtype]


@triton.jit
def rne_f32(x):
    """Round fp32 to the nearest integer value, ties to even (|x| < 2^22), without libdevice."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def e4m3_encode(x):
    """fp32 -> uint8 OCP E4M3 bits, round to nearest even, saturating to +-448. NaN unsupported."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    u = x.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    # normal range (|x| >= 2^-6): drop 20 mantissa bits with RNE, rebias exponent 127 -> 7
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal range: the code is round(|x| * 2^9); 8 rounds up into the smallest normal (0x08)
    sub = rne_f32(a.to(tl.float32, bitcast=True) * 512.0).to(tl.int32)
    mag = tl.where(a >= (121 << 23), normal, sub)
    return (mag | sign).to(tl.uint8)


@triton.jit
def e4m3_decode(b):
    """uint8 E4M3 bits -> fp16 equal to value * 2^-8 (exact, subnormals included)."""
    i = b.to(tl.int32)
    h = ((i & 0x7F) << 7) | ((i & 0x80) << 8)
    return h.to(tl.uint16).to(tl.float16, bitcast=True)


def e4m3_encode_ref(x: Tensor, scale: Tensor) -> Tensor:
    """x (any float) / scale -> uint8 E4M3 bits, saturating."""
    y = (x.float() / scale.float()).clamp(-E4M3_MAX, E4M3_MAX)
    return y.to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_decode_ref(b: Tensor, scale: Tensor) -> Tensor:
    """uint8 E4M3 bits -> fp32 value * scale."""
    return b.view(torch.float8_e4m3fn).float() * scale.float()


def int8_quant_ref(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row (last dim) absmax int8: x [..., D] -> (q int8 [..., D], scale fp32 [...])."""
    xf = x.float()
    scale = xf.abs().amax(-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.where(scale[..., None] > 0, xf / safe[..., None], torch.zeros_like(xf))
    return torch.round(q).clamp(-127, 127).to(torch.int8), scale


def dequant_cache_ref(cache: Tensor, kv_dtype: str, scale: Tensor | None) -> Tensor:
    """Whole paged cache -> fp32 values (refs only)."""
    fmt = kv_format(kv_dtype)
    if fmt == 0:
        return cache.float()
    if fmt == 1:
        return e4m3_decode_ref(cache, scale)
    return cache.float() * scale[..., None].float()


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_cache(name: str, cache: Tensor, kv_dtype: str, scale: Tensor | None, model_dtype: torch.dtype) -> None:
    """Validate one paged cache [num_blocks, block_size, KVH, D] against its format."""
    fmt = kv_format(kv_dtype)
    check(cache.dim() == 4, f"{name}: expected [num_blocks, block_size, KVH, D], got {tuple(cache.shape)}")
    check(cache.stride(-1) == 1, f"{name}: last dim must be contiguous, strides {cache.stride()}")
    want = {0: (torch.float16, torch.bfloat16, torch.float32), 1: (torch.uint8,), 2: (torch.int8,)}[fmt]
    check(cache.dtype in want, f"{name}: kv_dtype={kv_dtype!r} needs a cache of {want}, got {cache.dtype}")
    if fmt == 0:
        check(cache.dtype == model_dtype or model_dtype == torch.float32,
              f"{name}: cache dtype {cache.dtype} != model dtype {model_dtype}")
    if fmt == 1:
        check(scale is not None and scale.numel() == 1 and scale.dtype == torch.float32,
              f"{name}: fp8_e4m3 needs a 1-element fp32 layer scale tensor")
    if fmt == 2:
        check(scale is not None and scale.dtype == torch.float32 and tuple(scale.shape) == tuple(cache.shape[:3])
              and scale.is_contiguous(),
              f"{name}: int8 needs a contiguous fp32 scale [num_blocks, block_size, KVH] = {tuple(cache.shape[:3])}, "
              f"got {None if scale is None else (tuple(scale.shape), scale.dtype)}")


def scale_arg(scale: Tensor | None, like: Tensor) -> Tensor:
    """Kernels always take a pointer; a dummy when the format has no scale."""
    return scale if scale is not None else like.new_empty(1, dtype=torch.float32)


def uniform_rows(seq_lens: Tensor, num_rows_per_req: int) -> tuple[Tensor, Tensor]:
    """(row_req, row_pos) of uniform rows, for refs: row r -> request r // Q at seq_len - Q + r % Q."""
    q = num_rows_per_req
    b = torch.arange(seq_lens.shape[0] * q, device=seq_lens.device) // q
    pos = seq_lens.long()[b] - q + torch.arange(seq_lens.shape[0] * q, device=seq_lens.device) % q
    return b, pos


def varlen_rows(cu_seqlens: Tensor, seq_lens: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """(row_req int32 [T], row_pos int32 [T]) of a varlen step, without a host sync."""
    qlens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    b = torch.repeat_interleave(torch.arange(qlens.shape[0], device=qlens.device), qlens, output_size=num_rows)
    i = torch.arange(num_rows, device=qlens.device)
    pos = seq_lens.long()[b] - qlens[b] + (i - cu_seqlens.long()[b])
    return b.to(torch.int32), pos.to(torch.int32)


@triton.jit
def row_meta(r, seq_lens_ptr, row_req_ptr, row_pos_ptr, Q: tl.constexpr, EXPLICIT: tl.constexpr):
    """Request index and token index of query row r."""
    if EXPLICIT:
        b = tl.load(row_req_ptr + r)
        t = tl.load(row_pos_ptr + r)
    else:
        b = r // Q
        t = tl.load(seq_lens_ptr + b) - Q + r % Q
    return b, t

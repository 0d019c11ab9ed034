"""Scatter a step's new K/V tokens into the paged QSA caches, quantising on the way.

k_cache, v_cache: [num_blocks, block_size, KVH, D]; token i goes to
block slot_mapping[i] // block_size, offset slot_mapping[i] % block_size. A negative slot
(padding token) is skipped. Formats: see common.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import check, check_cache, e4m3_encode, e4m3_encode_ref, int8_quant_ref, kv_format, rne_f32, scale_arg


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
                     BLOCK_SIZE: tl.constexpr, KVH: tl.constexpr, BH: tl.constexpr, D: tl.constexpr,
                     FMT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # masks are built from tensor comparisons (the interpreter mistypes tensor & scalar-bool)
    ok_h = (tl.zeros([BH], tl.int64) + slot) >= 0
    slot = tl.maximum(slot, 0)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BH)
    d = tl.arange(0, D)
    mask = (h[:, None] < KVH) & (d[None, :] < D) & ok_h[:, None]
    for which in tl.static_range(2):
        if which == 0:
            x_ptr, stride_xt, stride_xh = k_ptr, stride_kt, stride_kh
            c_ptr, stride_cb, stride_co, stride_ch = kc_ptr, stride_kcb, stride_kco, stride_kch
            s_ptr = ks_ptr
        else:
            x_ptr, stride_xt, stride_xh = v_ptr, stride_vt, stride_vh
            c_ptr, stride_cb, stride_co, stride_ch = vc_ptr, stride_vcb, stride_vco, stride_vch
            s_ptr = vs_ptr
        x = tl.load(x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :], mask=mask, other=0.0)  # [BH, D]
        dst = c_ptr + blk * stride_cb + off * stride_co + h[:, None] * stride_ch + d[None, :]
        if FMT == 0:
            tl.store(dst, x.to(c_ptr.dtype.element_ty), mask=mask)
        elif FMT == 1:
            scale = tl.load(s_ptr)
            tl.store(dst, e4m3_encode(tl.math.div_rn(x.to(tl.float32), scale)), mask=mask)
        else:
            xf = x.to(tl.float32)
            amax = tl.max(tl.abs(xf), axis=1)  # [BH]
            scale = amax / 127.0
            safe = tl.where(scale > 0, scale, 1.0)
            q = tl.where(scale[:, None] > 0, tl.math.div_rn(xf, safe[:, None]), 0.0)
            q = tl.minimum(tl.maximum(rne_f32(q), -127.0), 127.0)
            tl.store(dst, q.to(tl.int8), mask=mask)
            # per-token-per-head scales: contiguous [num_blocks, block_size, KVH]
            tl.store(s_ptr + (blk * BLOCK_SIZE + off) * KVH + h, scale, mask=ok_h & (h < KVH))


def store_kv_ref(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, kv_dtype: str,
                 k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> None:
    """Torch reference of `store_kv` (same contract, in place)."""
    fmt = kv_format(kv_dtype)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    bs = k_cache.shape[1]
    blk, off = slots // bs, slots % bs
    for x, cache, scale in ((k[keep], k_cache, k_scale), (v[keep], v_cache, v_scale)):
        if fmt == 0:
            cache[blk, off] = x.to(cache.dtype)
        elif fmt == 1:
            cache[blk, off] = e4m3_encode_ref(x, scale)
        else:
            q, s = int8_quant_ref(x)
            cache[blk, off] = q
            scale[blk, off] = s


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, kv_dtype: str,
             k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> None:
    """Write new tokens into the paged caches (in place).

    k, v: [T, KVH, D] model dtype (last dim contiguous); k_cache, v_cache: [num_blocks, block_size, KVH, D]
    in the format of `kv_dtype` ("auto" | "fp8_e4m3" | "int8", see common.py); slot_mapping: [T] int64
    (negative = skip). fp8_e4m3: k_scale/v_scale are the layer's 1-element fp32 scales (read).
    int8: k_scale/v_scale [num_blocks, block_size, KVH] fp32 (written).
    """
    fmt = kv_format(kv_dtype)
    check(k.dim() == 3 and v.shape == k.shape, f"k, v: expected equal [T, KVH, D], got {tuple(k.shape)}, {tuple(v.shape)}")
    T, KVH, D = k.shape
    check(k.stride(-1) == 1 and v.stride(-1) == 1, "k, v: last dim must be contiguous")
    check(k.dtype == v.dtype and k.dtype in (torch.float16, torch.bfloat16, torch.float32), f"k, v dtype {k.dtype}")
    for name, cache, scale in (("k_cache", k_cache, k_scale), ("v_cache", v_cache, v_scale)):
        check_cache(name, cache, kv_dtype, scale, k.dtype)
        check(tuple(cache.shape[2:]) == (KVH, D), f"{name}: [.., KVH, D] = {tuple(cache.shape[2:])} != {(KVH, D)}")
    check(k_cache.shape == v_cache.shape, "k_cache and v_cache shapes differ")
    check(D & (D - 1) == 0, f"head dim {D} must be a power of two")
    check(slot_mapping.shape == (T,) and slot_mapping.dtype in (torch.int64, torch.int32),
          f"slot_mapping: expected [T={T}] int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    check(slot_mapping.is_contiguous(), "slot_mapping must be contiguous")
    if T == 0:
        return
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping, scale_arg(k_scale, k), scale_arg(v_scale, k),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], KVH=KVH, BH=triton.next_power_of_2(KVH), D=D, FMT=fmt, num_warps=4,
    )

"""Compress the indexer's raw keys into one key per complete group of c tokens (spec §4.3, §4.6 option B).

For each group j completed by this step's tokens:
    K̄_j = RoPE_R( ZCRMSNorm_(1+w)( dtype( mean_fp32(raw_{cj..cj+c-1}) ) ), cos/sin of token cj )
written to index_cache[block_table[b, cj // block_size], (cj % block_size) // c].

Pending ring: raw keys of tokens whose group is not complete yet live in a per-request ring
`pending [num_slots, P, Di]` (model dtype), token i of a request at ring slot i % P. P is a multiple of c;
P >= (max new tokens per step) + c - 1 keeps every token a rollback can need (P = 2c covers MTP4 verify,
spec §4.6). The kernel reads pending raw keys of the group that the step's first token belongs to, and
afterwards writes the step's last min(new, P) raw keys into the ring. The same program does both (with a
barrier in between), so no other program races on the ring.

RoPE of a group whose first token precedes the step needs that token's cos/sin: the caller passes
`pending_cos/pending_sin [B, R]` = cos/sin at token c * floor(start_b / c) of each request (start_b = its
first new token); they are read only when that token precedes the step. The engine keeps pending
positions (spec §4.6), and these rows are shared by all QSA layers of a step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import check


@triton.jit
def _index_compress_kernel(raw_ptr, cos_ptr, sin_ptr, ring_ptr, pcos_ptr, psin_ptr, w_ptr, out_ptr,
                           bt_ptr, cu_ptr, seq_lens_ptr, slots_ptr, eps,
                           stride_rt, stride_ct, stride_st, stride_gs, stride_gp, stride_pc, stride_ps,
                           stride_ob, stride_og, stride_btb, MAX_BLOCKS,
                           C: tl.constexpr, P: tl.constexpr, DI: tl.constexpr, R: tl.constexpr,
                           BLOCK_SIZE: tl.constexpr, HAS_SLOTS: tl.constexpr):
    b = tl.program_id(0)
    j = tl.program_id(1)
    q0 = tl.load(cu_ptr + b).to(tl.int64)
    num_new = tl.load(cu_ptr + b + 1).to(tl.int64) - q0
    end = tl.load(seq_lens_ptr + b).to(tl.int64)
    start = end - num_new
    if HAS_SLOTS:
        ring_row = tl.load(slots_ptr + b).to(tl.int64)
    else:
        ring_row = b.to(tl.int64)
    g = start // C + j
    i = tl.arange(0, C)
    d = tl.arange(0, DI)
    tok = g * C + i  # [C]
    complete = (tl.zeros([C], tl.int64) + (g + 1) * C) <= end
    in_step = tok >= start
    # rotate-half partner of each feature: d + R/2 for d < R/2, d - R/2 for R/2 <= d < R, itself beyond R
    half: tl.constexpr = R // 2
    partner = tl.where(d < half, d + half, tl.where(d < R, d - half, d))
    m_step = (complete & in_step)[:, None] & (d[None, :] < DI)
    m_ring = (complete & ~in_step)[:, None] & (d[None, :] < DI)
    row_step = raw_ptr + (q0 + tok - start)[:, None] * stride_rt
    row_ring = ring_ptr + ring_row * stride_gs + (tok % P)[:, None] * stride_gp
    x = tl.load(row_step + d[None, :], mask=m_step, other=0.0) + tl.load(row_ring + d[None, :], mask=m_ring, other=0.0)
    xp = tl.load(row_step + partner[None, :], mask=m_step, other=0.0) + tl.load(row_ring + partner[None, :], mask=m_ring, other=0.0)
    # fp32 mean, rounded once to the model dtype
    pooled = (tl.sum(x.to(tl.float32), axis=0) / C).to(out_ptr.dtype.element_ty).to(tl.float32)  # [DI]
    pooled_p = (tl.sum(xp.to(tl.float32), axis=0) / C).to(out_ptr.dtype.element_ty).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(pooled * pooled, axis=0) / DI + eps)
    w = tl.load(w_ptr + d).to(tl.float32)
    wp = tl.load(w_ptr + partner).to(tl.float32)
    y = (pooled * rstd * (1.0 + w)).to(out_ptr.dtype.element_ty).to(tl.float32)
    yp = (pooled_p * rstd * (1.0 + wp)).to(out_ptr.dtype.element_ty).to(tl.float32)
    first = g * C
    # a group this step does not complete stores nothing and reads no cos/sin row: the row it would rotate with
    # can lie past the step's [T, R] tables (the group after the last token of a step ending on a boundary)
    done = (tl.zeros([DI], tl.int64) + (g + 1) * C) <= end  # [DI]
    rmask = (d < R) & done
    if first >= start:
        cs_row = cos_ptr + (q0 + first - start) * stride_ct
        sn_row = sin_ptr + (q0 + first - start) * stride_st
    else:
        cs_row = pcos_ptr + b * stride_pc
        sn_row = psin_ptr + b * stride_ps
    cs = tl.load(cs_row + d, mask=rmask, other=1.0)
    sn = tl.load(sn_row + d, mask=rmask, other=0.0)
    sign = tl.where(d < half, -1.0, 1.0)
    out = tl.where(rmask, y * cs + sign * yp * sn, y)
    page = tl.load(bt_ptr + b * stride_btb + tl.minimum(first // BLOCK_SIZE, MAX_BLOCKS - 1)).to(tl.int64)
    dst = out_ptr + page * stride_ob + ((first % BLOCK_SIZE) // C) * stride_og + d
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=done)
    # all programs' ring reads above happen before program 0's ring writes below
    tl.debug_barrier()
    pi = tl.arange(0, P)
    ptok = end - P + pi
    pmask = (ptok >= start) & (ptok >= 0) & ((tl.zeros([P], tl.int32) + j) == 0)
    vals = tl.load(raw_ptr + (q0 + ptok - start)[:, None] * stride_rt + d[None, :],
                   mask=pmask[:, None] & (d[None, :] < DI), other=0.0)
    tl.store(ring_ptr + ring_row * stride_gs + (ptok % P)[:, None] * stride_gp + d[None, :], vals,
             mask=pmask[:, None] & (d[None, :] < DI))


def _rope_ref(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    r = cos.shape[-1]
    xf = x.float()
    rot, rest = xf[..., :r], xf[..., r:]
    rotated = rot * cos + torch.cat([-rot[..., r // 2:], rot[..., : r // 2]], dim=-1) * sin
    return torch.cat([rotated, rest], dim=-1).to(x.dtype)


def index_compress_ref(raw_keys: Tensor, cos: Tensor, sin: Tensor, pending: Tensor, pending_cos: Tensor,
                       pending_sin: Tensor, norm_weight: Tensor, eps: float, index_cache: Tensor, block_table: Tensor,
                       cu_seqlens: Tensor, seq_lens: Tensor, pending_slots: Tensor | None = None,
                       max_new_tokens: int | None = None, ratio: int = 4) -> None:
    """Torch reference of `index_compress` (same contract, in place)."""
    nb_per_page = index_cache.shape[1]
    P = pending.shape[1]
    c = ratio
    bs = nb_per_page * c
    for b in range(seq_lens.shape[0]):
        q0, q1 = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
        end = int(seq_lens[b])
        start = end - (q1 - q0)
        row = int(pending_slots[b]) if pending_slots is not None else b

        def raw(i: int) -> Tensor:
            return raw_keys[q0 + i - start] if i >= start else pending[row, i % P]

        for g in range(start // c, end // c):
            x = torch.stack([raw(g * c + i) for i in range(c)])
            pooled = x.float().mean(0).to(raw_keys.dtype)
            xf = pooled.float()
            normed = (xf * torch.rsqrt(xf.pow(2).mean() + eps) * (1.0 + norm_weight.float())).to(raw_keys.dtype)
            first = g * c
            cs = cos[q0 + first - start] if first >= start else pending_cos[b]
            sn = sin[q0 + first - start] if first >= start else pending_sin[b]
            key = _rope_ref(normed[None], cs[None], sn[None])[0]
            index_cache[block_table[b, first // bs], (first % bs) // c] = key
        for i in range(max(start, end - P, 0), end):
            pending[row, i % P] = raw_keys[q0 + i - start]


def index_compress(raw_keys: Tensor, cos: Tensor, sin: Tensor, pending: Tensor, pending_cos: Tensor,
                   pending_sin: Tensor, norm_weight: Tensor, eps: float, index_cache: Tensor, block_table: Tensor,
                   cu_seqlens: Tensor, seq_lens: Tensor, pending_slots: Tensor | None = None,
                   max_new_tokens: int | None = None, ratio: int = 4) -> None:
    """Write the compressed index keys of every group this step completes, and update the pending ring.

    raw_keys: [T, Di] model dtype, the step's raw (pre-norm, pre-RoPE) index keys, varlen by cu_seqlens.
    cos, sin: [T, R] fp32 rotary tables of the step's tokens (R <= Di, even).
    pending: [num_slots, P, Di] model dtype ring of raw keys (see module doc), read and updated.
    pending_cos, pending_sin: [B, R] fp32 cos/sin of token c*floor(start_b/c) of each request.
    norm_weight: [Di] k_layernorm weight (ZC-RMSNorm, scale 1 + w); eps its epsilon.
    index_cache: [num_blocks, block_size // c, Di] model dtype; block_table: [B, max_blocks] int32;
    cu_seqlens: [B + 1] int32; seq_lens: [B] int32 (tokens incl. the new ones);
    pending_slots: [B] int32 ring row of each request (None: row b).
    max_new_tokens: max new tokens of a request in this step (python int; None reads it from cu_seqlens,
    a host sync). ratio: c, the compress ratio (4).
    """
    c = ratio
    check(raw_keys.dim() == 2 and raw_keys.stride(-1) == 1, f"raw_keys: expected [T, Di] contiguous rows, got {tuple(raw_keys.shape)}")
    T, Di = raw_keys.shape
    check(Di & (Di - 1) == 0, f"Di={Di} must be a power of two")
    check(cos.shape == sin.shape and cos.dim() == 2 and cos.shape[0] == T and cos.dtype == torch.float32,
          f"cos/sin: expected [T={T}, R] fp32, got {tuple(cos.shape)} {cos.dtype}")
    R = cos.shape[1]
    check(R % 2 == 0 and R <= Di and cos.stride(-1) == 1 and sin.stride(-1) == 1, f"rotary dim R={R} must be even, <= Di")
    B = seq_lens.shape[0]
    check(pending.dim() == 3 and pending.shape[2] == Di and pending.shape[1] % c == 0 and pending.dtype == raw_keys.dtype
          and pending.stride(-1) == 1, f"pending: expected [num_slots, P (multiple of {c}), Di={Di}] {raw_keys.dtype}, got "
          f"{tuple(pending.shape)} {pending.dtype}")
    P = pending.shape[1]
    check(P & (P - 1) == 0, f"pending ring length {P} must be a power of two")
    for name, t in (("pending_cos", pending_cos), ("pending_sin", pending_sin)):
        check(t.shape == (B, R) and t.dtype == torch.float32 and t.stride(-1) == 1, f"{name}: expected [B={B}, R={R}] fp32")
    check(norm_weight.shape == (Di,) and norm_weight.is_contiguous(), f"norm_weight: expected [{Di}]")
    check(index_cache.dim() == 3 and index_cache.shape[2] == Di and index_cache.dtype == raw_keys.dtype
          and index_cache.stride(-1) == 1,
          f"index_cache: expected [num_blocks, block_size // c, Di={Di}] {raw_keys.dtype}, got "
          f"{tuple(index_cache.shape)} {index_cache.dtype}")
    check(block_table.dim() == 2 and block_table.shape[0] == B and block_table.dtype == torch.int32
          and block_table.stride(-1) == 1, f"block_table: expected [B={B}, max_blocks] int32")
    check(cu_seqlens.shape == (B + 1,) and cu_seqlens.dtype == torch.int32, "cu_seqlens: expected [B + 1] int32")
    check(seq_lens.dtype == torch.int32 and seq_lens.is_contiguous(), "seq_lens: expected [B] int32")
    if pending_slots is not None:
        check(pending_slots.shape == (B,) and pending_slots.dtype == torch.int32, "pending_slots: expected [B] int32")
    if max_new_tokens is None:
        max_new_tokens = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if B else 0
    if B == 0 or max_new_tokens == 0:
        return
    groups = triton.cdiv(max_new_tokens + c - 1, c)
    _index_compress_kernel[(B, groups)](
        raw_keys, cos, sin, pending, pending_cos, pending_sin, norm_weight, index_cache,
        block_table, cu_seqlens, seq_lens, pending_slots if pending_slots is not None else seq_lens, eps,
        raw_keys.stride(0), cos.stride(0), sin.stride(0), pending.stride(0), pending.stride(1),
        pending_cos.stride(0), pending_sin.stride(0), index_cache.stride(0), index_cache.stride(1), block_table.stride(0), block_table.shape[1],
        C=c, P=P, DI=Di, R=R, BLOCK_SIZE=index_cache.shape[1] * c, HAS_SLOTS=pending_slots is not None, num_warps=4,
    )

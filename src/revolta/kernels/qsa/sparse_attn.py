"""QSA sparse attention over selected groups + the tail, gated output (spec §4.4-§4.5).

A query at token t (n = floor((t + 1) / c) complete groups) attends to
  - every token of its selected groups: `selected[row, :min(n, budget)]` (valid ids first, -1 padded); when
    n <= budget the kernel ignores `selected` and takes groups 0..n-1 (dense causal attention), and
  - the tail: tokens c*n .. t of its own incomplete group (0..c-1 tokens).
Softmax in fp32 (exp2, online), q-head h reads kv-head h // (Hq / KVH), out = attn * sigmoid(gate).

One kernel serves decode (row = request), speculative verify (Q rows per request at seq_len - Q .. seq_len - 1,
each with its own selection and causal tail) and prefill (explicit rows, prefill.py). Each program takes one
row and one KV head with its Hq / KVH query heads (padded to 16 rows for tl.dot) and a contiguous slice of the
row's virtual token list; flash-decoding splits are merged by `_combine_kernel`, which applies the gate.
K/V are dequantised in the loop: E4M3 through integer bit ops (scale folded into the logits / output),
int8 with per-token scales (K scale on the logits, V dequantised to the compute dtype).

The same kernel, with PARTIAL / DCP / RANK constexprs (dcp.py's `attend_rows_partial`), attends a row's token list
restricted to one DCP rank's stripe and writes the un-gated fp32 output with its log-sum-exp instead; at the
defaults (PARTIAL False, DCP 1) those branches compile away and the single-process kernel is unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import (check, check_cache, dequant_cache_ref, e4m3_decode, kv_format, row_meta,
                     scale_arg, uniform_rows)

LOG2E = 1.4426950408889634


@triton.jit
def _qsa_attn_kernel(q_ptr, gate_ptr, out_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
                     bt_ptr, seq_lens_ptr, sel_ptr, row_req_ptr, row_pos_ptr, m_ws, l_ws, acc_ws, lse_ptr,
                     qk_scale, budget, num_splits,
                     stride_qr, stride_qh, stride_gr, stride_gh, stride_or, stride_oh,
                     stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
                     stride_btb, stride_selr, KVH,
                     Q: tl.constexpr, EXPLICIT: tl.constexpr, FMT: tl.constexpr, C: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, D: tl.constexpr,
                     BN: tl.constexpr, SPLIT: tl.constexpr, PARTIAL: tl.constexpr, DCP: tl.constexpr,
                     RANK: tl.constexpr):
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    b, t = row_meta(r, seq_lens_ptr, row_req_ptr, row_pos_ptr, Q, EXPLICIT)
    b = b.to(tl.int64)
    r64 = r.to(tl.int64)
    n = (t + 1) // C
    ns = tl.minimum(n, budget)
    if DCP == 1:
        sel_len = ns * C
        L = sel_len + (t + 1 - n * C)  # selected tokens, then the tail
    else:  # this rank's C / DCP tokens of each group, then its tokens of the tail
        sel_len = ns * (C // DCP)
        L = sel_len + tl.maximum(t + 1 - n * C - RANK + DCP - 1, 0) // DCP
    per = tl.cdiv(tl.cdiv(L, num_splits), BN) * BN
    lo = s * per
    hi = tl.minimum(lo + per, L)

    g = tl.arange(0, BG)
    d = tl.arange(0, D)
    heads = kvh * G + g
    hmask = g < G
    q = tl.load(q_ptr + r64 * stride_qr + heads[:, None] * stride_qh + d[None, :],
                mask=hmask[:, None] & (d[None, :] < D), other=0.0)  # [BG, D]
    if FMT == 0:
        cdt = k_ptr.dtype.element_ty
    else:
        cdt = q_ptr.dtype.element_ty
    q = q.to(cdt)
    scale = qk_scale
    vmult = 1.0
    if FMT == 1:
        scale = qk_scale * tl.load(ks_ptr) * 256.0
        vmult = tl.load(vs_ptr) * 256.0
    dense = (tl.zeros([BN], tl.int32) + n) <= budget

    m_i = tl.full([BG], float("-inf"), tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, D], tl.float32)
    for start in range(lo, hi, BN):
        p = start + tl.arange(0, BN)
        valid = p < hi
        in_sel = p < sel_len
        slot = p // (C // DCP)
        gid = tl.load(sel_ptr + r64 * stride_selr + slot, mask=valid & in_sel & ~dense, other=-1)
        gid = tl.where(dense, slot, gid)
        if DCP == 1:
            tok = tl.where(in_sel, gid * C + p % C, n * C + p - sel_len)
        else:  # local list index -> global token (t % DCP == RANK); gid -1 still gives tok < 0
            tok = tl.where(in_sel, gid * C + (p % (C // DCP)) * DCP + RANK, n * C + (p - sel_len) * DCP + RANK)
        valid = valid & (tok >= 0)
        tok = tl.maximum(tok, 0)
        page = tl.load(bt_ptr + b * stride_btb + tok // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        off = (tok % BLOCK_SIZE) // DCP  # a rank's page holds BLOCK_SIZE / DCP tokens
        kv_mask = valid[:, None] & (d[None, :] < D)
        kt = tl.load(k_ptr + page[:, None] * stride_kb + off[:, None] * stride_ko + kvh * stride_kh + d[None, :],
                     mask=kv_mask, other=0)
        vt = tl.load(v_ptr + page[:, None] * stride_vb + off[:, None] * stride_vo + kvh * stride_vh + d[None, :],
                     mask=kv_mask, other=0)
        if FMT == 1:
            kt = e4m3_decode(kt).to(cdt)
            vt = e4m3_decode(vt).to(cdt)
        elif FMT == 2:
            sidx = (page * (BLOCK_SIZE // DCP) + off) * KVH + kvh  # scales: contiguous [num_blocks, page, KVH]
            kst = tl.load(ks_ptr + sidx, mask=valid, other=0.0)
            vst = tl.load(vs_ptr + sidx, mask=valid, other=0.0)
            kt = kt.to(cdt)
            vt = (vt.to(tl.float32) * vst[:, None]).to(cdt)
        qk = tl.dot(q, tl.trans(kt))  # [BG, BN] fp32
        if FMT == 2:
            qk = qk * (scale * kst)[None, :]
        else:
            qk = qk * scale
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        pexp = tl.exp2(qk - m_use[:, None])
        l_i = l_i * alpha + tl.sum(pexp, axis=1)
        acc = acc * alpha[:, None] + tl.dot(pexp.to(cdt), vt)
        m_i = m_new
    acc = acc * vmult
    omask = hmask[:, None] & (d[None, :] < D)
    if SPLIT:
        wrow = (r64 * KVH * G + heads) * num_splits + s  # partials [R, Hq, S]
        tl.store(m_ws + wrow, m_i, mask=hmask)
        tl.store(l_ws + wrow, l_i, mask=hmask)
        tl.store(acc_ws + wrow[:, None] * D + d[None, :], acc, mask=omask)
    elif PARTIAL:  # un-gated fp32 output normalised over this rank's tokens, and their natural-log lse
        has = l_i > 0.0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
        tl.store(out_ptr + r64 * stride_or + heads[:, None] * stride_oh + d[None, :], o, mask=omask)
        tl.store(lse_ptr + r64 * KVH * G + heads, lse, mask=hmask)
    else:
        gate = tl.load(gate_ptr + r64 * stride_gr + heads[:, None] * stride_gh + d[None, :], mask=omask,
                       other=0.0).to(tl.float32)
        o = acc / l_i[:, None] * tl.sigmoid(gate)
        tl.store(out_ptr + r64 * stride_or + heads[:, None] * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=omask)


@triton.jit
def _combine_kernel(gate_ptr, out_ptr, m_ws, l_ws, acc_ws, lse_ptr, num_splits, stride_gr, stride_gh, stride_or,
                    stride_oh, H, D: tl.constexpr, SP: tl.constexpr, PARTIAL: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, SP)
    d = tl.arange(0, D)
    smask = sp < num_splits
    base = (r * H + h) * num_splits
    m = tl.load(m_ws + base + sp, mask=smask, other=float("-inf"))
    l = tl.load(l_ws + base + sp, mask=smask, other=0.0)
    mx = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - mx))
    denom = tl.sum(l * w, axis=0)
    o = tl.zeros([D], tl.float32)
    for i in range(0, num_splits):
        wi = tl.sum(tl.where(sp == i, w, 0.0), axis=0)
        o += wi * tl.load(acc_ws + (base + i) * D + d)
    if PARTIAL:  # un-gated, and the lse of the row's tokens (-inf, zero output where there are none)
        has = denom > 0.0
        o = o / tl.where(has, denom, 1.0)
        tl.store(out_ptr + r * stride_or + h * stride_oh + d, o)
        tl.store(lse_ptr + r * H + h, tl.where(has, (mx + tl.log2(tl.where(has, denom, 1.0))) / 1.4426950408889634,
                                               float("-inf")))
    else:
        o = o / denom
        gate = tl.load(gate_ptr + r * stride_gr + h * stride_gh + d).to(tl.float32)
        tl.store(out_ptr + r * stride_or + h * stride_oh + d, (o * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty))


def attend_rows_ref(q: Tensor, gate: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, selected: Tensor,
                    row_req: Tensor, row_pos: Tensor, scale: float, kv_dtype: str, k_scale: Tensor | None,
                    v_scale: Tensor | None, ratio: int, budget: int) -> Tensor:
    """Torch reference over explicit rows: q, gate [R, Hq, D] -> [R, Hq, D] (q dtype)."""
    kf = dequant_cache_ref(k_cache, kv_dtype, k_scale)  # [NB, bs, KVH, D] fp32
    vf = dequant_cache_ref(v_cache, kv_dtype, v_scale)
    bs, KVH = k_cache.shape[1], k_cache.shape[2]
    R, Hq, D = q.shape
    rep = Hq // KVH
    out = torch.empty_like(q)
    for r in range(R):
        b, t = int(row_req[r]), int(row_pos[r])
        n = (t + 1) // ratio
        groups = torch.arange(n) if n <= budget else selected[r, : min(n, budget)].long().cpu()
        toks = (groups[:, None] * ratio + torch.arange(ratio)).flatten()
        toks = torch.cat([toks, torch.arange(n * ratio, t + 1)]).to(q.device)
        pages = block_table[b].long()[toks // bs]
        kk = kf[pages, toks % bs].repeat_interleave(rep, dim=1)  # [L, Hq, D]
        vv = vf[pages, toks % bs].repeat_interleave(rep, dim=1)
        logits = torch.einsum("hd,lhd->hl", q[r].float(), kk) * scale
        att = torch.einsum("hl,lhd->hd", torch.softmax(logits, dim=-1), vv)
        out[r] = (att * torch.sigmoid(gate[r].float())).to(q.dtype)
    return out


def request_row_tokens(selected: Tensor, row_pos: Tensor, ratio: int) -> tuple[Tensor, Tensor]:
    """The fixed-width token list of each row: its groups x c (every group while n <= budget, else its
    `selected` ones), then a c - 1 slot tail. selected [R, budget], row_pos [R] -> (token ids int64 [R, L],
    bool [R, L] which slots are real; unused slots hold token 0)."""
    budget = selected.shape[1]
    pos = row_pos.long()
    n = (pos + 1) // ratio
    ids = torch.arange(budget, device=selected.device)
    groups = torch.where(n[:, None] <= budget, torch.where(ids < n[:, None], ids, -1), selected.long())  # [R, budget]
    offs = torch.arange(ratio, device=selected.device)
    toks = torch.cat([(groups[:, :, None] * ratio + offs).flatten(1), n[:, None] * ratio + offs[:-1]], 1)  # [R, L]
    valid = torch.cat([(groups >= 0).repeat_interleave(ratio, 1), n[:, None] * ratio + offs[:-1] <= pos[:, None]], 1)
    return toks.where(valid, 0), valid


def attend_request_rows_ref(q: Tensor, gate: Tensor, kf: Tensor, vf: Tensor, table_row: Tensor, selected: Tensor,
                            row_pos: Tensor, scale: float, ratio: int) -> Tensor:
    """Many rows of one request at once (the vectorised form of `attend_rows_ref`): q, gate [R, Hq, D];
    kf, vf: fp32 [NB, bs, KVH, D] (dequantised caches); table_row: [max_blocks] its block table; selected
    [R, budget]; row_pos [R]. Every row gathers a fixed-width token list (its groups x c, then a c - 1 slot
    tail), the unused slots masked out of the softmax. Returns [R, Hq, D] in q's dtype, gated."""
    R, Hq, D = q.shape
    bs, KVH = kf.shape[1], kf.shape[2]
    toks, valid = request_row_tokens(selected, row_pos, ratio)
    pages = table_row.long()[toks // bs]
    kk, vv = kf[pages, toks % bs], vf[pages, toks % bs]  # [R, L, KVH, D]
    qf = q.float().view(R, KVH, Hq // KVH, D)  # q-head h reads kv-head h // (Hq / KVH)
    logits = torch.einsum("rkgd,rlkd->rkgl", qf, kk) * scale
    logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
    att = torch.einsum("rkgl,rlkd->rkgd", torch.softmax(logits, dim=-1), vv).reshape(R, Hq, D)
    return (att * torch.sigmoid(gate.float())).to(q.dtype)


def check_attn(q, gate, k_cache, v_cache, block_table, seq_lens, selected, kv_dtype, k_scale, v_scale):
    check(q.dim() == 3 and gate.shape == q.shape, f"q, gate: expected equal [rows, Hq, D], got {tuple(q.shape)}, "
          f"{tuple(gate.shape)}")
    check(q.stride(-1) == 1 and gate.stride(-1) == 1, "q, gate: last dim must be contiguous")
    check(q.dtype in (torch.float16, torch.bfloat16, torch.float32) and gate.dtype == q.dtype, f"q dtype {q.dtype}")
    for name, cache, s in (("k_cache", k_cache, k_scale), ("v_cache", v_cache, v_scale)):
        check_cache(name, cache, kv_dtype, s, q.dtype)
    check(k_cache.shape == v_cache.shape, "k_cache and v_cache shapes differ")
    R, Hq, D = q.shape
    KVH = k_cache.shape[2]
    check(k_cache.shape[3] == D and D & (D - 1) == 0, f"head dim: q {D}, cache {k_cache.shape[3]} (power of two)")
    check(Hq % KVH == 0, f"Hq={Hq} not a multiple of KVH={KVH}")
    check(block_table.dim() == 2 and block_table.dtype == torch.int32 and block_table.stride(-1) == 1,
          "block_table: expected [B, max_blocks] int32")
    check(seq_lens.shape == (block_table.shape[0],) and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous(),
          "seq_lens: expected [B] int32")
    check(selected.dim() == 2 and selected.shape[0] == R and selected.dtype == torch.int32 and selected.stride(-1) == 1,
          f"selected: expected [rows={R}, budget] int32, got {tuple(selected.shape)} {selected.dtype}")


def num_splits_for(rows: int, kv_heads: int, max_tokens: int, block_n: int, num_sms: int = 132) -> int:
    """Flash-decoding split count: enough programs for ~2 waves, at least one tile per split."""
    want = max(1, (2 * num_sms) // max(1, rows * kv_heads))
    return max(1, min(triton.next_power_of_2(want), triton.cdiv(max_tokens, block_n), 64))


def attend_rows(q, gate, k_cache, v_cache, block_table, seq_lens, selected, row_req, row_pos, scale, kv_dtype,
                k_scale, v_scale, ratio, Q, explicit, num_splits=None, block_n=None):
    """Launch the row kernel (+ combine): gated output [R, Hq, D] in q's dtype. Shapes validated by the caller."""
    out = torch.empty_like(q)
    launch_rows(q, gate, out, None, k_cache, v_cache, block_table, seq_lens, selected, row_req, row_pos, scale,
                kv_dtype, k_scale, v_scale, ratio, Q, explicit, num_splits, block_n)
    return out


def launch_rows(q, gate, out, lse, k_cache, v_cache, block_table, seq_lens, selected, row_req, row_pos, scale,
                kv_dtype, k_scale, v_scale, ratio, Q, explicit, num_splits=None, block_n=None, dcp=1, rank=0):
    """The row kernel (+ combine) into `out`: gated (lse None), or with lse fp32 [R, Hq] the partial form over DCP
    rank `rank`'s stripe (dcp.py; k_cache, v_cache are its pages of block_size / dcp tokens; out fp32 un-gated)."""
    fmt = kv_format(kv_dtype)
    R, Hq, D = q.shape
    KVH = k_cache.shape[2]
    G = Hq // KVH
    budget = selected.shape[1]
    if R == 0:
        return
    partial = lse is not None
    BN = block_n or (32 if D >= 128 else 16)
    if num_splits is None:
        num_splits = num_splits_for(R, KVH, (budget * ratio + ratio - 1) // dcp, BN,
                                    torch.cuda.get_device_properties(q.device).multi_processor_count
                                    if q.is_cuda else 132)
    split = num_splits > 1
    if split:
        m_ws = torch.empty(R * Hq * num_splits, dtype=torch.float32, device=q.device)
        l_ws = torch.empty_like(m_ws)
        acc_ws = torch.empty(R * Hq * num_splits * D, dtype=torch.float32, device=q.device)
    else:
        m_ws = l_ws = acc_ws = q.new_empty(1, dtype=torch.float32)
    dummy = seq_lens
    lse_arg = lse if partial else m_ws
    _qsa_attn_kernel[(R, KVH, num_splits)](
        q, gate, out, k_cache, v_cache, scale_arg(k_scale, q), scale_arg(v_scale, q),
        block_table, seq_lens, selected, row_req if explicit else dummy, row_pos if explicit else dummy,
        m_ws, l_ws, acc_ws, lse_arg, scale * LOG2E, budget, num_splits,
        q.stride(0), q.stride(1), gate.stride(0), gate.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), block_table.stride(0), selected.stride(0), KVH,
        Q=Q, EXPLICIT=explicit, FMT=fmt, C=ratio, BLOCK_SIZE=k_cache.shape[1] * dcp, G=G,
        BG=max(16, triton.next_power_of_2(G)), D=D, BN=BN, SPLIT=split, PARTIAL=partial, DCP=dcp, RANK=rank,
        num_warps=8 if D >= 128 else 4, num_stages=2,
    )
    if split:
        _combine_kernel[(R, Hq)](gate, out, m_ws, l_ws, acc_ws, lse_arg, num_splits, gate.stride(0), gate.stride(1),
                                 out.stride(0), out.stride(1), Hq, D=D, SP=triton.next_power_of_2(num_splits),
                                 PARTIAL=partial, num_warps=4)


def _decode_rows(q, gate, selected):
    Q = q.shape[1] if q.dim() == 4 else 1
    return Q, q.reshape(-1, *q.shape[-2:]), gate.reshape(-1, *gate.shape[-2:]), selected.reshape(-1, selected.shape[-1])


def qsa_sparse_decode_ref(q: Tensor, gate: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                          seq_lens: Tensor, selected: Tensor, scale: float, kv_dtype: str = "auto",
                          k_scale: Tensor | None = None, v_scale: Tensor | None = None, ratio: int = 4,
                          num_splits: int | None = None) -> Tensor:
    """Torch reference of `qsa_sparse_decode`."""
    Q, qr, gr, sel = _decode_rows(q, gate, selected)
    row_req, row_pos = uniform_rows(seq_lens, Q)
    out = attend_rows_ref(qr, gr, k_cache, v_cache, block_table, sel, row_req, row_pos, scale, kv_dtype, k_scale,
                          v_scale, ratio, sel.shape[1])
    return out.view(q.shape)


def qsa_sparse_decode(q: Tensor, gate: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                      seq_lens: Tensor, selected: Tensor, scale: float, kv_dtype: str = "auto",
                      k_scale: Tensor | None = None, v_scale: Tensor | None = None, ratio: int = 4,
                      num_splits: int | None = None) -> Tensor:
    """Gated sparse attention of each request's last query token(s).

    q, gate: [B, Hq, D] (decode) or [B, Q, Hq, D] (verify: rows at seq_len - Q .. seq_len - 1), model dtype.
    k_cache, v_cache: [num_blocks, block_size, KVH, D] in the `kv_dtype` format (common.py) with k_scale/v_scale.
    block_table: [B, max_blocks] int32; seq_lens: [B] int32 (incl. the new tokens).
    selected: [B, budget] (or [B, Q, budget]) int32 from qsa_select_decode: valid group ids first, -1 padded.
    scale: softmax scale (1/sqrt(D)). num_splits: flash-decoding splits (None: from the batch size).
    Returns [B, Hq, D] (or [B, Q, Hq, D]) = softmax attention * sigmoid(gate), in q's dtype.
    """
    check(q.dim() in (3, 4) and q.shape[0] == seq_lens.shape[0],
          f"q: expected [B, Hq, D] or [B, Q, Hq, D] with B={seq_lens.shape[0]}, got {tuple(q.shape)}")
    check(selected.dim() == q.dim() - 1 and selected.shape[:-1] == q.shape[:-2],
          f"selected: expected {tuple(q.shape[:-2])} + [budget], got {tuple(selected.shape)}")
    Q, qr, gr, sel = _decode_rows(q, gate, selected)
    check_attn(qr, gr, k_cache, v_cache, block_table, seq_lens, sel, kv_dtype, k_scale, v_scale)
    out = attend_rows(qr, gr, k_cache, v_cache, block_table, seq_lens, sel, None, None, scale, kv_dtype, k_scale,
                      v_scale, ratio, Q, False, num_splits)
    return out.view(q.shape)

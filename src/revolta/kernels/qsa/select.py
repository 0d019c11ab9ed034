"""Indexer block selection (spec §4.4): score complete groups, keep the top `budget`.

s_j = Σ_h ReLU(q_h · K̄_j) / sqrt(Di) over complete groups j < n, n = floor((t + 1) / c) for a query at
token t. If n <= budget every group is taken, else the top `budget` by (descending score, ascending j).

Two kernels: `_index_score_kernel` (memory-bound on the compressed keys; one program reads each key tile
once for up to 8 verify rows of a request, and loops over tiles up to the rows' context) writes fp32 scores
to a workspace; `_topk_kernel` (one program per row) finds the exact budget-th largest score
with a 4-pass radix select on the score bits (scores are >= +0, so their int32 bit patterns order like
the values), 8-bit digits through `tl.histogram`, then one pass that keeps every score above the threshold
and the lowest-index ties at it. Output: selected group ids in ascending order, -1 padded: valid ids
first, which the attention kernels rely on. No sort.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import check, row_meta, uniform_rows


@triton.jit
def _index_score_kernel(iq_ptr, icache_ptr, bt_ptr, seq_lens_ptr, row_req_ptr, row_pos_ptr, score_ptr,
                        stride_qr, stride_qh, stride_cb, stride_cg, stride_btb, stride_sr, sqrt_di, budget,
                        Q: tl.constexpr, EXPLICIT: tl.constexpr, HI: tl.constexpr, DI: tl.constexpr,
                        C: tl.constexpr, BLOCK_SIZE: tl.constexpr, BN: tl.constexpr, QG: tl.constexpr):
    """Program (p, s) scores QG rows of one request (uniform rows: rows p // NCH * Q + p % NCH * QG + i,
    NCH = cdiv(Q, QG); explicit rows: QG = Q = 1, row p) against group tiles s, s + S, s + 2S, ... below
    the last row's complete groups: every key tile is read once for the QG rows, and the work follows
    the rows' context, not the grid (sized by max_model_len, static for CUDA graphs). Each row's score
    of a group is the same arithmetic whatever QG, so decode and verify rows select alike."""
    p = tl.program_id(0)
    s0 = tl.program_id(1)
    num_s = tl.num_programs(1)
    NCH: tl.constexpr = (Q + QG - 1) // QG
    first = (p // NCH) * Q + (p % NCH) * QG  # the program's first row
    last = tl.minimum(first + QG - 1, (p // NCH) * Q + Q - 1)
    b, t_last = row_meta(last, seq_lens_ptr, row_req_ptr, row_pos_ptr, Q, EXPLICIT)
    n_last = (t_last + 1) // C  # rows that take every group (n <= budget) need no scores
    num_tiles = tl.where(n_last > budget, tl.cdiv(n_last, BN), 0)
    d = tl.arange(0, DI)
    for jb in range(s0, num_tiles, num_s):
        j = jb * BN + tl.arange(0, BN)
        need = j < n_last
        page = tl.load(bt_ptr + b.to(tl.int64) * stride_btb + (j * C) // BLOCK_SIZE, mask=need, other=0).to(tl.int64)
        grp = (j * C % BLOCK_SIZE) // C
        k = tl.load(icache_ptr + page[:, None] * stride_cb + grp[:, None] * stride_cg + d[None, :],
                    mask=need[:, None] & (d[None, :] < DI), other=0.0).to(tl.float32)  # [BN, DI]
        for i in tl.static_range(QG):
            r = first + i
            n = (t_last - (last - r) + 1) // C
            ok = (tl.zeros([BN], tl.int32) + r) <= last
            s = tl.zeros([BN], tl.float32)
            for h in tl.static_range(HI):
                qh = tl.load(iq_ptr + r.to(tl.int64) * stride_qr + h * stride_qh + d,
                             mask=(tl.zeros([DI], tl.int32) + r) <= last, other=0.0).to(tl.float32)
                s += tl.maximum(tl.sum(k * qh[None, :], axis=1), 0.0)
            s = tl.math.div_rn(s, sqrt_di)
            tl.store(score_ptr + r.to(tl.int64) * stride_sr + j, s,
                     mask=ok & (j < n) & ((tl.zeros([BN], tl.int32) + n) > budget))


@triton.jit
def _topk_kernel(score_ptr, out_ptr, seq_lens_ptr, row_req_ptr, row_pos_ptr, stride_sr, stride_or, budget,
                 Q: tl.constexpr, EXPLICIT: tl.constexpr, C: tl.constexpr, KPAD: tl.constexpr, CHUNK: tl.constexpr):
    r = tl.program_id(0)
    b, t = row_meta(r, seq_lens_ptr, row_req_ptr, row_pos_ptr, Q, EXPLICIT)
    n = (t + 1) // C
    srow = score_ptr + r.to(tl.int64) * stride_sr
    orow = out_ptr + r.to(tl.int64) * stride_or
    if n <= budget:
        for k0 in range(0, budget, KPAD):
            kk = k0 + tl.arange(0, KPAD)
            tl.store(orow + kk, tl.where(kk < n, kk, -1), mask=kk < budget)
    else:
        bins = tl.arange(0, 512)
        prefix = n * 0  # the threshold's bits decided so far
        need = n * 0 + budget  # how many keys to take among those matching `prefix`
        for p in tl.static_range(4):
            hist = tl.zeros([512], tl.int32)
            for j0 in range(0, n, CHUNK):
                j = j0 + tl.arange(0, CHUNK)
                valid = j < n
                key = tl.maximum(tl.load(srow + j, mask=valid, other=0.0).to(tl.int32, bitcast=True), 0)
                if p > 0:
                    valid = valid & ((key >> (32 - 8 * p)) == prefix)
                # non-matching keys go to bin 256, which is ignored
                hist += tl.histogram(tl.where(valid, (key >> (24 - 8 * p)) & 255, 256), 512)
            hist = tl.where(bins < 256, hist, 0)
            at_or_above = tl.cumsum(hist, 0, reverse=True)  # keys with digit >= bin
            digit = tl.sum(((at_or_above >= need) & (bins < 256)).to(tl.int32), axis=0) - 1
            need -= tl.sum(tl.where(bins > digit, hist, 0), axis=0)
            prefix = (prefix << 8) | digit
        tau = prefix
        taken = n * 0
        ties = n * 0
        for j0 in range(0, n, CHUNK):
            j = j0 + tl.arange(0, CHUNK)
            valid = j < n
            key = tl.maximum(tl.load(srow + j, mask=valid, other=0.0).to(tl.int32, bitcast=True), 0)
            eq = (valid & (key == tau)).to(tl.int32)
            tie_rank = ties + tl.cumsum(eq, 0) - eq
            sel = ((valid & (key > tau)) | ((eq > 0) & (tie_rank < need))).to(tl.int32)
            pos = taken + tl.cumsum(sel, 0) - sel
            tl.store(orow + pos, j, mask=sel > 0)
            taken += tl.sum(sel, axis=0)
            ties += tl.sum(eq, axis=0)


def request_group_keys(index_cache: Tensor, block_table: Tensor, req: int, num_groups: int, ratio: int = 4) -> Tensor:
    """The compressed keys of groups 0..num_groups-1 of request `req`: fp32 [num_groups, Di]."""
    bs = index_cache.shape[1] * ratio
    j = torch.arange(num_groups, device=index_cache.device)
    return index_cache[block_table[req].long()[(j * ratio) // bs], (j * ratio % bs) // ratio].float()


def index_scores_ref(index_q: Tensor, index_cache: Tensor, block_table: Tensor, req: int, num_groups: int,
                     ratio: int = 4) -> Tensor:
    """fp32 scores [..., num_groups] of index queries [..., Hi, Di] of request `req` (QSAIndexer.scores)."""
    keys = request_group_keys(index_cache, block_table, req, num_groups, ratio)  # [n, Di]
    dots = torch.einsum("...hd,nd->...hn", index_q.float(), keys)
    return dots.relu().sum(dim=-2) / math.sqrt(index_q.shape[-1])


def select_request_rows_ref(index_q: Tensor, keys: Tensor, row_pos: Tensor, budget: int, ratio: int = 4) -> Tensor:
    """Selections of many rows of one request at once (the vectorised form of `select_top_ref` per row).

    index_q: [R, Hi, Di]; keys: fp32 [N, Di], the request's compressed keys (N >= every row's group count);
    row_pos: [R] token index of each row. Returns int32 [R, budget]: ascending ids, -1 padded; rows with
    n <= budget take 0..n-1. The top-`budget` is exact with the (descending score, ascending id) order: each
    score's bits (scores are >= +0, so as int32 they order like the values) and its reversed id form one
    unique int64 key, so `topk` has no ties to break.
    """
    n = (row_pos.long() + 1) // ratio  # [R] complete groups visible to each row
    ids = torch.arange(budget, device=index_q.device)
    out = torch.where(ids < n[:, None], ids, -1).to(torch.int32)  # [R, budget]
    sparse = (n > budget).nonzero().squeeze(1)
    if sparse.numel() == 0:
        return out
    width = int(n[sparse].max())
    dots = torch.einsum("rhd,nd->rhn", index_q[sparse].float(), keys[:width])  # [Rs, Hi, width]
    scores = dots.relu_().sum(dim=1).div_(math.sqrt(index_q.shape[-1]))  # [Rs, width]
    j = torch.arange(width, device=index_q.device)
    bits = scores.view(torch.int32).clamp_min_(0)  # -0.0 -> +0, as the kernel's integer max does
    bits.masked_fill_(j >= n[sparse, None], -1)  # groups not complete at the row's own position: below every key
    key = (bits.long() << 31).bitwise_or_(width - 1 - j)  # [Rs, width] int64
    out[sparse] = key.topk(budget, dim=-1).indices.sort(dim=-1).values.to(torch.int32)
    return out


def select_top_ref(scores: Tensor, budget: int) -> Tensor:
    """Ids of the top-`budget` of scores [n] (descending score, then ascending id), ascending, -1 padded."""
    n = scores.shape[0]
    out = torch.full((budget,), -1, dtype=torch.int32, device=scores.device)
    if n <= budget:
        out[:n] = torch.arange(n, dtype=torch.int32, device=scores.device)
        return out
    order = torch.sort(scores, descending=True, stable=True).indices[:budget]
    out[:] = torch.sort(order).values.to(torch.int32)
    return out


def _select_rows_ref(index_q, index_cache, block_table, row_req, row_pos, budget, ratio):
    out = torch.empty(index_q.shape[0], budget, dtype=torch.int32, device=index_q.device)
    for r in range(index_q.shape[0]):
        n = (int(row_pos[r]) + 1) // ratio
        scores = index_scores_ref(index_q[r], index_cache, block_table, int(row_req[r]), n, ratio)
        out[r] = select_top_ref(scores, budget)
    return out


def qsa_select_decode_ref(index_q: Tensor, index_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                          budget_blocks: int, ratio: int = 4, workspace: Tensor | None = None) -> Tensor:
    """Torch reference of `qsa_select_decode`."""
    rows = index_q.shape[1] if index_q.dim() == 4 else 1
    row_req, row_pos = uniform_rows(seq_lens, rows)
    out = _select_rows_ref(index_q.reshape(-1, *index_q.shape[-2:]), index_cache, block_table, row_req, row_pos,
                           budget_blocks, ratio)
    return out.view(*index_q.shape[:-2], budget_blocks)


def qsa_select_rows_ref(index_q: Tensor, index_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                        row_req: Tensor, row_pos: Tensor, budget_blocks: int, ratio: int = 4,
                        workspace: Tensor | None = None) -> Tensor:
    """Torch reference of `qsa_select_rows`."""
    return _select_rows_ref(index_q, index_cache, block_table, row_req, row_pos, budget_blocks, ratio)


def _check_select(index_q, index_cache, block_table, seq_lens, budget_blocks, ratio):
    check(index_q.shape[-1] & (index_q.shape[-1] - 1) == 0 and index_q.stride(-1) == 1,
          f"index_q: last dim (Di) must be a power of two and contiguous, got {tuple(index_q.shape)}")
    check(index_q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"index_q dtype {index_q.dtype}")
    check(index_cache.dim() == 3 and index_cache.shape[2] == index_q.shape[-1] and index_cache.stride(-1) == 1,
          f"index_cache: expected [num_blocks, block_size // c, Di={index_q.shape[-1]}], got {tuple(index_cache.shape)}")
    check(block_table.dim() == 2 and block_table.dtype == torch.int32 and block_table.stride(-1) == 1,
          f"block_table: expected [B, max_blocks] int32, got {tuple(block_table.shape)} {block_table.dtype}")
    check(seq_lens.dim() == 1 and seq_lens.shape[0] == block_table.shape[0] and seq_lens.dtype == torch.int32
          and seq_lens.is_contiguous(), f"seq_lens: expected [B={block_table.shape[0]}] int32")
    check(budget_blocks >= 1, "budget_blocks must be >= 1")
    check(ratio & (ratio - 1) == 0, "ratio must be a power of two")


ROWS_PER_PROGRAM = 8  # verify rows of one request scored together (one key read); more rows: more programs


def score_splits(num_programs: int, num_tiles: int, device: torch.device) -> int:
    """Programs along the group axis of the score kernel: ~4 per SM in all, at most one per tile (each
    loops over its tiles up to the row's context, so a long max_model_len costs no empty programs)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    return max(1, min(num_tiles, triton.cdiv(4 * sms, max(1, num_programs))))


def _score(iq, index_cache, block_table, seq_lens, row_req, row_pos, budget, ratio, Q, explicit, workspace):
    """Launch the score kernel: the rows' fp32 scores into `workspace` (allocated when None), returned."""
    R = iq.shape[0]
    max_groups = block_table.shape[1] * index_cache.shape[1]
    if workspace is None:
        workspace = torch.empty(R, max_groups, dtype=torch.float32, device=iq.device)
    check(workspace.dtype == torch.float32 and workspace.shape[0] >= R and workspace.shape[1] >= max_groups
          and workspace.stride(-1) == 1, f"workspace: expected fp32 [>= {R}, >= {max_groups}]")
    if R == 0:
        return workspace
    QG = min(Q, ROWS_PER_PROGRAM)
    programs, BN = R // Q * triton.cdiv(Q, QG), 32
    dummy = seq_lens
    _index_score_kernel[(programs, score_splits(programs, triton.cdiv(max_groups, BN), iq.device))](
        iq, index_cache, block_table, seq_lens, row_req if explicit else dummy, row_pos if explicit else dummy,
        workspace, iq.stride(0), iq.stride(1), index_cache.stride(0), index_cache.stride(1), block_table.stride(0),
        workspace.stride(0), math.sqrt(iq.shape[-1]), budget, Q=Q, EXPLICIT=explicit, HI=iq.shape[1],
        DI=iq.shape[2], C=ratio, BLOCK_SIZE=index_cache.shape[1] * ratio, BN=BN, QG=QG, num_warps=4,
    )
    return workspace


def _launch(iq, index_cache, block_table, seq_lens, row_req, row_pos, budget, ratio, Q, explicit, workspace):
    R = iq.shape[0]
    workspace = _score(iq, index_cache, block_table, seq_lens, row_req, row_pos, budget, ratio, Q, explicit,
                       workspace)
    out = torch.empty(R, budget, dtype=torch.int32, device=iq.device)
    if R == 0:
        return out
    dummy = seq_lens
    _topk_kernel[(R,)](
        workspace, out, seq_lens, row_req if explicit else dummy, row_pos if explicit else dummy,
        workspace.stride(0), out.stride(0), budget,
        Q=Q, EXPLICIT=explicit, C=ratio, KPAD=min(1024, triton.next_power_of_2(budget)), CHUNK=2048, num_warps=8,
    )
    return out


def qsa_select_decode(index_q: Tensor, index_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                      budget_blocks: int, ratio: int = 4, workspace: Tensor | None = None) -> Tensor:
    """Selected groups of each request's last query token(s).

    index_q: [B, Hi, Di] (decode) or [B, Q, Hi, Di] (speculative verify: Q consecutive rows ending at
    seq_len - 1), normed + RoPEd index queries. index_cache: [num_blocks, block_size // c, Di];
    block_table: [B, max_blocks] int32; seq_lens: [B] int32 (incl. the new tokens).
    workspace: optional fp32 [rows, max_blocks * block_size // c] score buffer (graph capture).
    Returns int32 [B, budget_blocks] (or [B, Q, budget_blocks]): ascending group ids, -1 padded.
    """
    _check_select(index_q, index_cache, block_table, seq_lens, budget_blocks, ratio)
    check(index_q.dim() in (3, 4) and index_q.shape[0] == seq_lens.shape[0],
          f"index_q: expected [B, Hi, Di] or [B, Q, Hi, Di] with B={seq_lens.shape[0]}, got {tuple(index_q.shape)}")
    Q = index_q.shape[1] if index_q.dim() == 4 else 1
    iq = index_q.reshape(-1, *index_q.shape[-2:])
    check(iq.stride(-1) == 1, "index_q must be contiguous in the last dim")
    out = _launch(iq, index_cache, block_table, seq_lens, None, None, budget_blocks, ratio, Q, False, workspace)
    return out.view(*index_q.shape[:-2], budget_blocks)


def qsa_select_rows(index_q: Tensor, index_cache: Tensor, block_table: Tensor, seq_lens: Tensor, row_req: Tensor,
                    row_pos: Tensor, budget_blocks: int, ratio: int = 4, workspace: Tensor | None = None) -> Tensor:
    """Selection for explicit rows (prefill): index_q [R, Hi, Di]; row_req, row_pos [R] int32 = request and
    token index of each row. Rows with n <= budget get 0..n-1 without scoring. Returns int32 [R, budget]."""
    _check_select(index_q, index_cache, block_table, seq_lens, budget_blocks, ratio)
    R = index_q.shape[0]
    check(index_q.dim() == 3, f"index_q: expected [R, Hi, Di], got {tuple(index_q.shape)}")
    check(row_req.shape == (R,) and row_pos.shape == (R,) and row_req.dtype == torch.int32
          and row_pos.dtype == torch.int32, f"row_req, row_pos: expected [R={R}] int32")
    return _launch(index_q, index_cache, block_table, seq_lens, row_req, row_pos, budget_blocks, ratio, 1, True,
                   workspace)

"""QSA prefill / chunked-prefill attention (varlen, causal, paged).

Row i of the step (a query token of request b at token index t) attends like a decode query at t:
dense over 0..t while n = floor((t + 1) / c) <= budget, else over its selected groups + its tail.
This first version reuses the row kernel of sparse_attn.py (one program per query row and KV head,
flash-decoding splits), with per-row selections from `qsa_select_rows`. It is correct for any chunking
(groups are keyed by absolute token index) but re-reads K/V per query row: it is not a tiled
FlashAttention prefill. On sm_70 its tl.dot runs on the FMA units (no tensor cores). The torch reference,
also the CPU path, is vectorised over blocks of one request's rows.

Call order for a step: store_kv (new K/V into the pages), index_compress (new complete groups), then this.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .common import check, dequant_cache_ref, varlen_rows
from .select import qsa_select_rows, request_group_keys, select_request_rows_ref
from .sparse_attn import attend_request_rows_ref, attend_rows, check_attn

SELECT_WORKSPACE_BYTES = 256 << 20
ROW_BLOCK_BYTES = 64 << 20  # the reference's working set per block of rows (gathered K/V or int64 score keys)


def _rows(q, cu_seqlens, seq_lens):
    check(cu_seqlens.dim() == 1 and cu_seqlens.shape[0] == seq_lens.shape[0] + 1 and cu_seqlens.dtype == torch.int32,
          f"cu_seqlens: expected [B + 1] int32, got {tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")
    return varlen_rows(cu_seqlens, seq_lens, q.shape[0])


def qsa_prefill_ref(q: Tensor, gate: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, cu_seqlens: Tensor,
                    seq_lens: Tensor, scale: float, budget_blocks: int, index_q: Tensor | None = None,
                    index_cache: Tensor | None = None, selected: Tensor | None = None, kv_dtype: str = "auto",
                    k_scale: Tensor | None = None, v_scale: Tensor | None = None, ratio: int = 4) -> Tensor:
    """Torch reference of `qsa_prefill`, and the CPU prefill path.

    Vectorised over blocks of one request's rows (`select_request_rows_ref`, `attend_request_rows_ref`): a
    per-row loop costs a Python round trip per token, which made a 70K-token CPU prefill take minutes. It
    computes what the per-row `qsa_select_rows_ref` + `attend_rows_ref` compute (the tests hold them equal).
    """
    kf = dequant_cache_ref(k_cache, kv_dtype, k_scale)  # [NB, bs, KVH, D] fp32
    vf = dequant_cache_ref(v_cache, kv_dtype, v_scale)
    out = torch.empty_like(q)
    for b, r0, r1, pos, sel in request_row_blocks(q, k_cache, block_table, cu_seqlens, seq_lens, budget_blocks, index_q,
                                                  index_cache, selected, ratio):
        out[r0:r1] = attend_request_rows_ref(q[r0:r1], gate[r0:r1], kf, vf, block_table[b], sel, pos, scale, ratio)
    return out


def request_row_blocks(q: Tensor, k_cache: Tensor, block_table: Tensor, cu_seqlens: Tensor, seq_lens: Tensor,
                       budget_blocks: int, index_q: Tensor | None, index_cache: Tensor | None, selected: Tensor | None,
                       ratio: int):
    """Yield (request b, rows r0:r1, their token indices [r1 - r0], their selections [r1 - r0, budget]) over blocks
    of one request's rows at a time, each block's working set within ROW_BLOCK_BYTES. Selections are `selected`'s
    rows, or computed from index_q + index_cache (`select_request_rows_ref`)."""
    _, row_pos = _rows(q, cu_seqlens, seq_lens)
    if selected is None:
        check(index_q is not None and index_cache is not None, "qsa_prefill needs `selected` or index_q + index_cache")
    token_bytes = 8 * k_cache.shape[2] * k_cache.shape[3] * (budget_blocks * ratio + ratio)  # one row's K + V gather
    cu, lens = cu_seqlens.tolist(), seq_lens.tolist()
    for b in range(len(lens)):
        if cu[b] == cu[b + 1]:
            continue
        keys = None if selected is not None else \
            request_group_keys(index_cache, block_table, b, lens[b] // ratio, ratio)  # [N, Di]
        score_bytes = 0 if keys is None else 8 * (index_q.shape[1] + 1) * max(1, keys.shape[0])
        block = max(1, ROW_BLOCK_BYTES // max(token_bytes, score_bytes))
        for r0 in range(cu[b], cu[b + 1], block):
            r1 = min(cu[b + 1], r0 + block)
            pos = row_pos[r0:r1]
            sel = selected[r0:r1] if selected is not None else \
                select_request_rows_ref(index_q[r0:r1], keys, pos, budget_blocks, ratio)
            yield b, r0, r1, pos, sel


def select_step_rows(index_q: Tensor, index_cache: Tensor, block_table: Tensor, seq_lens: Tensor, row_req: Tensor,
                     row_pos: Tensor, budget_blocks: int, ratio: int) -> Tensor:
    """`qsa_select_rows` over a step's T rows (index_q [T, Hi, Di]) in chunks whose score workspace stays within
    SELECT_WORKSPACE_BYTES -> int32 [T, budget_blocks]."""
    T = row_req.shape[0]
    check(index_q.dim() == 3 and index_q.shape[0] == T,
          f"index_q: expected [T={T}, Hi, Di], got {tuple(index_q.shape)}")
    selected = torch.empty(T, budget_blocks, dtype=torch.int32, device=index_q.device)
    max_groups = block_table.shape[1] * index_cache.shape[1]
    chunk = max(1, SELECT_WORKSPACE_BYTES // (4 * max(1, max_groups)))
    for r0 in range(0, T, chunk):
        r1 = min(T, r0 + chunk)
        selected[r0:r1] = qsa_select_rows(index_q[r0:r1], index_cache, block_table, seq_lens, row_req[r0:r1],
                                          row_pos[r0:r1], budget_blocks, ratio)
    return selected


def qsa_prefill(q: Tensor, gate: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, cu_seqlens: Tensor,
                seq_lens: Tensor, scale: float, budget_blocks: int, index_q: Tensor | None = None,
                index_cache: Tensor | None = None, selected: Tensor | None = None, kv_dtype: str = "auto",
                k_scale: Tensor | None = None, v_scale: Tensor | None = None, ratio: int = 4) -> Tensor:
    """Varlen causal QSA attention of a prefill (or mixed) step.

    q, gate: [T, Hq, D], T = cu_seqlens[-1] new tokens; request b owns rows cu_seqlens[b]:cu_seqlens[b+1], the
    last seq_lens[b] - 1 being its final token index. k_cache, v_cache (+ scales): the paged caches, already
    holding this step's tokens. Selection: `selected` [T, budget] int32, or computed here from index_q
    [T, Hi, Di] and index_cache (rows under the sparse onset take every group and need no scores).
    Returns [T, Hq, D] in q's dtype, gated.
    """
    row_req, row_pos = _rows(q, cu_seqlens, seq_lens)
    if selected is None:
        check(index_q is not None and index_cache is not None, "qsa_prefill needs `selected` or index_q + index_cache")
        selected = select_step_rows(index_q, index_cache, block_table, seq_lens, row_req, row_pos, budget_blocks,
                                    ratio)
    check_attn(q, gate, k_cache, v_cache, block_table, seq_lens, selected, kv_dtype, k_scale, v_scale)
    return attend_rows(q, gate, k_cache, v_cache, block_table, seq_lens, selected, row_req, row_pos, scale, kv_dtype,
                       k_scale, v_scale, ratio, 1, True)

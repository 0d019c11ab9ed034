"""Decode context parallelism (DCP) for QSA: attention over one rank's stripe of a sequence's K/V, and the exact
merge of the ranks' partial outputs (docs/parallel.md, "Decode context parallelism").

Layout (interleave 1, vLLM's default): token t of a sequence lives on DCP rank t % dcp, in the page of its global
block (block_table[t // block_size]: the same block ids on every rank) at local offset (t % block_size) // dcp, so
a rank's K/V pages hold block_size / dcp tokens. `local_slot_mapping` turns the engine's slot mapping into this
rank's (-1, which store_kv skips, for another rank's token).

A rank attends each row's token list (its selected groups and its tail: exactly the list the single-process
kernels use, the selection computed on every rank from the replicated compressed keys) restricted to the tokens it
holds, and returns the un-gated output normalised over them with their log-sum-exp. `merge_partials` recombines:
out = sum_r exp(lse_r - M) o_r / sum_r exp(lse_r - M), M = max_r lse_r, which is the softmax over the union of the
ranks' tokens (exact up to fp32 rounding: every token is on exactly one rank).

`attend_rows_partial` / `qsa_partial` are the Triton forms (the row kernel of sparse_attn.py with its DCP
constexprs: it walks only this rank's C / dcp tokens of each group and of the tail, so ratio % dcp == 0); the
`_ref` functions are the CPU path and the numerics contract. `merge_partials` stays torch on both paths: a handful
of element-wise ops and reductions, no host sync (graph-capturable), over [dcp, T, H, D] that is small next to the
attention itself.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .common import check, dequant_cache_ref, varlen_rows
from .prefill import request_row_blocks, select_step_rows
from .sparse_attn import check_attn, launch_rows, request_row_tokens


def local_slot_mapping(slot_mapping: Tensor, block_size: int, dcp: int, rank: int) -> Tensor:
    """[T] global slots (block * block_size + offset, negative = padding) -> this rank's slots in pages of
    block_size / dcp tokens; -1 where the token belongs to another rank (or is padding)."""
    off = slot_mapping % block_size
    local = slot_mapping // block_size * (block_size // dcp) + off // dcp
    return torch.where((slot_mapping >= 0) & (off % dcp == rank), local, -1)


def attend_partial_rows_ref(q: Tensor, kf: Tensor, vf: Tensor, table_row: Tensor, selected: Tensor, row_pos: Tensor,
                            scale: float, ratio: int, dcp: int, rank: int) -> tuple[Tensor, Tensor]:
    """Rows of one request over this rank's tokens. q [R, Hq, D]; kf, vf: fp32 [NB, block_size / dcp, KVH, D] (this
    rank's dequantised pages); table_row [max_blocks]; selected [R, budget]; row_pos [R].
    Returns (out fp32 [R, Hq, D] normalised over the rank's tokens, zero where it holds none; lse fp32 [R, Hq],
    -inf where it holds none)."""
    R, Hq, D = q.shape
    lbs, KVH = kf.shape[1], kf.shape[2]
    bs = lbs * dcp
    toks, valid = request_row_tokens(selected, row_pos, ratio)  # [R, L]
    valid = valid & (toks % dcp == rank)
    pages, offs = table_row.long()[toks // bs], (toks % bs) // dcp
    kk, vv = kf[pages, offs], vf[pages, offs]  # [R, L, KVH, D]
    qf = q.float().view(R, KVH, Hq // KVH, D)  # q-head h reads kv-head h // (Hq / KVH)
    logits = torch.einsum("rkgd,rlkd->rkgl", qf, kk) * scale
    logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = logits.logsumexp(dim=-1)  # [R, KVH, G]
    probs = torch.exp(logits - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])  # 0 where no token
    out = torch.einsum("rkgl,rlkd->rkgd", probs, vv)
    return out.reshape(R, Hq, D), lse.reshape(R, Hq)


def qsa_partial_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, cu_seqlens: Tensor,
                    seq_lens: Tensor, scale: float, budget_blocks: int, index_q: Tensor, index_cache: Tensor,
                    dcp: int, rank: int, kv_dtype: str = "auto", k_scale: Tensor | None = None,
                    v_scale: Tensor | None = None, ratio: int = 4) -> tuple[Tensor, Tensor]:
    """Every row of a step (prefill, decode or verify: row i of request b at its token index, as `qsa_prefill`)
    over this rank's stripe. q [T, Hq, D]; k_cache, v_cache: this rank's pages [NB, block_size / dcp, KVH, D];
    index_q [T, Hi, Di] and index_cache (replicated) select each row's groups as the single-process path does.
    Returns (out fp32 [T, Hq, D], lse fp32 [T, Hq]) for `merge_partials`."""
    kf = dequant_cache_ref(k_cache, kv_dtype, k_scale)
    vf = dequant_cache_ref(v_cache, kv_dtype, v_scale)
    out = q.new_empty(q.shape, dtype=torch.float32)
    lse = q.new_empty(q.shape[:2], dtype=torch.float32)
    for b, r0, r1, pos, sel in request_row_blocks(q, k_cache, block_table, cu_seqlens, seq_lens, budget_blocks, index_q,
                                                  index_cache, None, ratio):
        out[r0:r1], lse[r0:r1] = attend_partial_rows_ref(q[r0:r1], kf, vf, block_table[b], sel, pos, scale, ratio, dcp,
                                                         rank)
    return out, lse


def attend_rows_partial(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                        selected: Tensor, row_req: Tensor | None, row_pos: Tensor | None, scale: float, kv_dtype: str,
                        k_scale: Tensor | None, v_scale: Tensor | None, ratio: int, Q: int, explicit: bool, dcp: int,
                        rank: int, num_splits: int | None = None, block_n: int | None = None) -> tuple[Tensor, Tensor]:
    """`attend_rows` (same rows: explicit row_req / row_pos, or Q uniform rows per request) over DCP rank `rank`'s
    stripe: k_cache, v_cache (+ int8 scales) are its pages [NB, block_size / dcp, KVH, D]. Returns (out fp32
    [R, Hq, D] un-gated, normalised over the rank's tokens, zero where it holds none; lse fp32 [R, Hq], -inf there)."""
    check(dcp >= 1 and 0 <= rank < dcp and ratio % dcp == 0,
          f"dcp={dcp}, rank={rank}, ratio={ratio}: the kernel needs 0 <= rank < dcp and dcp dividing the group size "
          f"(each group then has ratio / dcp tokens per rank); use a decode_context_parallel_size that divides the "
          f"indexer's compress ratio {ratio}, or kernels='torch' (qsa_partial_ref takes any stripe)")
    check_attn(q, q, k_cache, v_cache, block_table, seq_lens, selected, kv_dtype, k_scale, v_scale)  # no gate: q's
    out = q.new_empty(q.shape, dtype=torch.float32)
    lse = q.new_empty(q.shape[:2], dtype=torch.float32)
    launch_rows(q, q, out, lse, k_cache, v_cache, block_table, seq_lens, selected, row_req, row_pos, scale, kv_dtype,
                k_scale, v_scale, ratio, Q, explicit, num_splits, block_n, dcp, rank)
    return out, lse


def qsa_partial(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, cu_seqlens: Tensor,
                seq_lens: Tensor, scale: float, budget_blocks: int, index_q: Tensor, index_cache: Tensor,
                dcp: int, rank: int, kv_dtype: str = "auto", k_scale: Tensor | None = None,
                v_scale: Tensor | None = None, ratio: int = 4) -> tuple[Tensor, Tensor]:
    """Triton form of `qsa_partial_ref` (same arguments and results), without a host sync: rows from cu_seqlens on
    the device, the selection by `qsa_select_rows` (the single-process rule), then `attend_rows_partial`."""
    row_req, row_pos = varlen_rows(cu_seqlens, seq_lens, q.shape[0])
    selected = select_step_rows(index_q, index_cache, block_table, seq_lens, row_req, row_pos, budget_blocks, ratio)
    return attend_rows_partial(q, k_cache, v_cache, block_table, seq_lens, selected, row_req, row_pos, scale, kv_dtype,
                               k_scale, v_scale, ratio, 1, True, dcp, rank)


def merge_partials(out: Tensor, lse: Tensor) -> Tensor:
    """The exact softmax over the union of P disjoint token sets. out [P, ..., D] fp32 each normalised over its own
    set; lse [P, ...] their log-sum-exps (-inf: an empty set) -> [..., D] fp32."""
    m = lse.amax(dim=0)
    m = m.masked_fill(m == float("-inf"), 0.0)
    w = torch.exp(lse - m)  # [P, ...]; 0 for an empty set
    return (w[..., None] * out).sum(dim=0) / w.sum(dim=0)[..., None]

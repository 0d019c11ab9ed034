"""The PLE layer's n-gram row ids of a paged step in one launch (spec/model.md §5.3, issue 19).

For B sequences laid end to end (ids [T], cu_seqlens [B + 1]) with their carried n-gram history in the paged
cache (context_ids [num_slots, n-1], EOS where a sequence starts this step):

    c_k(t)   = id_{t-k}, or EOS when an EOS sits at t-k..t-1 (history ‖ this step's ids)
    mix_n(t) = XOR_{k<n} c_k(t) * m_k            int64, wrapping
    row_h(t) = offset_h + (mix_{n(h)}(t) mod p_h)  bigram heads first, mod non-negative (torch's floor-mod)

and, outside a verify step, the last n-1 ids of (history ‖ this step's ids) go back to context_ids[slot].
As torch ops this was ~58 small kernels per PLE layer at decode (`ple_rows_ref`, the composition the layer
ran before); one program per sequence here, for steps whose sequences have at most MAX_BLOCK_T new tokens
(decode, speculative verify). Longer steps (prefill) run the reference.

Numerics: integer arithmetic, bitwise equal to the reference. Triton's `%` on signed ints truncates (srem,
also under the interpreter), torch's floors; a negative remainder gets p added (a negative mix only occurs
with multipliers or ids beyond the spec's bound m_k < 2^63 / vocab, e.g. a checkpoint's own buffers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..ple.ngram_host import row_ids

MAX_BLOCK_T = 16  # the longest per-sequence step the kernel takes (verify: 1 + drafts); longer: the reference


def token_layout(cu_seqlens: Tensor, T: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """[T] sequence index and in-step index of every token, from the device `cu_seqlens` [B + 1] (no host data,
    so a decode step can be captured in a CUDA graph)."""
    cu = cu_seqlens.to(device=device, dtype=torch.long)  # [B + 1]
    token = torch.arange(T, device=device)
    seq_index = torch.searchsorted(cu[1:], token, right=True)
    return seq_index, token - cu[seq_index]


def carried_histories(context_ids: Tensor, slots: Tensor, has_initial_state: Tensor, eos: int,
                      device: torch.device) -> Tensor:
    """[B, n-1] n-gram context each sequence carries into the step: its slot's row of context_ids, EOS where it
    starts this step (has_initial_state False)."""
    rows = context_ids[slots.long()].to(device)
    return torch.where(has_initial_state[:, None].to(device), rows, torch.full_like(rows, eos))


def ngram_contexts(ids: Tensor, history: Tensor, seq_index: Tensor, local_index: Tensor, eos: int) -> Tensor:
    """Vectorised layers.ngram.ngram_context over a flat varlen batch, on the ids' device (no host sync).

    ids: [T] raw token ids; history: [B, n-1] each sequence's previous ids (oldest first);
    seq_index, local_index: [T] the sequence of each token and its index inside this step.
    Returns contexts [T, n] = (c_0 .. c_{n-1}).
    """
    order = history.shape[1] + 1
    ctx, broken = [ids], torch.zeros_like(ids, dtype=torch.bool)
    for k in range(1, order):
        from_step = local_index >= k  # id_{t-k} is in this step, else it is history entry n-1-(k-i)
        prev = torch.where(from_step, ids[(torch.arange(ids.shape[0], device=ids.device) - k).clamp_min(0)],
                           history[seq_index, (order - 1 - k + local_index).clamp(0, order - 2)])
        broken = broken | (prev == eos)  # an EOS at t-k..t-1 cuts everything before it
        ctx.append(torch.where(broken, torch.full_like(prev, eos), prev))
    return torch.stack(ctx, dim=-1)


def new_histories(ids: Tensor, history: Tensor, cu: Tensor) -> Tensor:
    """[B, n-1]: the last n-1 ids of each sequence after the step (history [B, n-1], then its ids of the flat [T]
    ids; cu [B + 1] int64 offsets on the ids' device)."""
    keep = history.shape[1]
    starts, ends = cu[:-1, None], cu[1:, None]
    pos = ends - keep + torch.arange(keep, device=ids.device)  # [B, n-1] flat index of each kept id
    from_step = pos >= starts  # else the id is still in the carried history
    from_history = history.gather(1, (pos - starts + keep).clamp(0, keep - 1))
    return torch.where(from_step, ids[pos.clamp_min(0)], from_history)


def ple_rows_ref(ids: Tensor, cu_seqlens: Tensor, context_ids: Tensor, slots: Tensor, has_initial_state: Tensor,
                 multipliers: Tensor, sizes: Tensor, offsets: Tensor, heads_per_ngram: int, eos: int,
                 max_new_tokens: int, store: bool = True, history_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """ids [T] raw token ids of B sequences (cu_seqlens [B + 1] int32); context_ids [num_slots, n-1] int64 the
    carried histories, by slots [B]; has_initial_state [B] bool; multipliers [n], sizes, offsets [H] int64
    (NGramEmbedding's buffers) -> (row ids [T, H] int64, the carried history [B, n-1] int64, into history_out when
    given). store: write each sequence's new history into context_ids[slot] (not on a verify step).
    max_new_tokens: the longest sequence of the step (the kernel's tile; unused here)."""
    ids, d = ids.long(), ids.device
    seq_index, local_index = token_layout(cu_seqlens, ids.shape[0], d)
    history = carried_histories(context_ids, slots, has_initial_state, eos, d)  # [B, n-1]
    contexts = ngram_contexts(ids, history, seq_index, local_index, eos)  # [T, n]
    rows = row_ids(contexts, multipliers.to(d), sizes.to(d), offsets.to(d), heads_per_ngram, torch.stack)
    if store:
        cu = cu_seqlens.to(device=ids.device, dtype=torch.long)
        context_ids[slots.long()] = new_histories(ids, history, cu).to(context_ids.device, context_ids.dtype)
    return rows, history if history_out is None else history_out.copy_(history)


@triton.jit
def _ple_rows_kernel(ids, cu_seqlens, context_ids, slots, has_initial_state, multipliers, sizes, offsets, rows,
                     history, stride_ctx, eos, ORDER: tl.constexpr, HEADS_PER_NGRAM: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, STORE: tl.constexpr):
    """One program per sequence: its tokens BLOCK_T at a time, its n-1 carried ids in BLOCK_K lanes."""
    KEEP: tl.constexpr = ORDER - 1
    H: tl.constexpr = KEEP * HEADS_PER_NGRAM
    b = tl.program_id(0)
    start = tl.load(cu_seqlens + b).to(tl.int64)
    n = tl.load(cu_seqlens + b + 1).to(tl.int64) - start
    carried = tl.load(has_initial_state + b) != 0  # False: the history reads EOS (a new sequence)
    row = context_ids + tl.load(slots + b).to(tl.int64) * stride_ctx
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < KEEP
    # (where, not a load mask: the slot's row exists either way, and the interpreter cannot AND a scalar into a mask)
    tl.store(history + b * KEEP + o_k, tl.where(carried, tl.load(row + o_k, mask=m_k, other=eos), eos), mask=m_k)

    for t0 in range(0, n, BLOCK_T):  # one pass at decode / verify (BLOCK_T >= the longest sequence)
        o_t = t0 + tl.arange(0, BLOCK_T)
        m_t = o_t < n
        mix = tl.load(ids + start + o_t, mask=m_t, other=0).to(tl.int64) * tl.load(multipliers)
        broken = o_t < 0
        for k in tl.static_range(1, ORDER):
            in_step = o_t >= k  # id_{t-k} is this step's, else the history's entry KEEP + t - k
            prev = tl.where(in_step, tl.load(ids + start + o_t - k, mask=m_t & in_step, other=0).to(tl.int64),
                            tl.where(carried, tl.load(row + KEEP + o_t - k, mask=m_t & ~in_step, other=eos), eos))
            broken = broken | (prev == eos)  # an EOS at t-k..t-1 cuts everything before it
            mix = mix ^ (tl.where(broken, eos, prev).to(tl.int64) * tl.load(multipliers + k))
            for j in tl.static_range(HEADS_PER_NGRAM):
                h = (k - 1) * HEADS_PER_NGRAM + j
                p = tl.load(sizes + h)
                r = mix % p
                r = tl.where(r < 0, r + p, r)  # srem truncates; torch's % floors
                tl.store(rows + (start + o_t) * H + h, tl.load(offsets + h) + r, mask=m_t)

    if STORE:  # the last KEEP ids of history ‖ step into the slot this program alone owns
        pos = n - KEEP + o_k  # in-step index of each kept id; < 0: still in the history
        in_step = pos >= 0
        new = tl.where(in_step, tl.load(ids + start + pos, mask=m_k & in_step, other=0).to(tl.int64),
                       tl.where(carried, tl.load(row + KEEP + pos, mask=m_k & ~in_step, other=eos), eos))
        tl.debug_barrier()  # every lane has read the old row before any lane overwrites it
        tl.store(row + o_k, new, mask=m_k)


def ple_rows(ids: Tensor, cu_seqlens: Tensor, context_ids: Tensor, slots: Tensor, has_initial_state: Tensor,
             multipliers: Tensor, sizes: Tensor, offsets: Tensor, heads_per_ngram: int, eos: int,
             max_new_tokens: int, store: bool = True, history_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Triton version of `ple_rows_ref` (same arguments, bitwise the same results and stored histories).
    max_new_tokens (a host int, no sync) picks the tile, BLOCK_T = its next power of two (a longer sequence would
    take several passes); steps longer than MAX_BLOCK_T run the reference."""
    if max_new_tokens > MAX_BLOCK_T:
        return ple_rows_ref(ids, cu_seqlens, context_ids, slots, has_initial_state, multipliers, sizes, offsets,
                            heads_per_ngram, eos, max_new_tokens, store, history_out)
    B, keep, T = slots.shape[0], context_ids.shape[1], ids.shape[0]
    H = (multipliers.shape[0] - 1) * heads_per_ngram
    assert sizes.shape == offsets.shape == (H,) and keep == multipliers.shape[0] - 1, (sizes.shape, keep)
    assert context_ids.dtype == torch.int64 and context_ids.stride(1) == 1, (context_ids.dtype, context_ids.stride())
    multipliers, sizes, offsets = (t.to(ids.device) for t in (multipliers, sizes, offsets))  # no-ops: buffers
    for t in (multipliers, sizes, offsets):
        assert t.dtype == torch.int64 and t.is_contiguous(), (t.dtype, t.stride())
    rows = torch.empty(T, H, dtype=torch.int64, device=ids.device)
    history = torch.empty(B, keep, dtype=torch.int64, device=ids.device) if history_out is None else history_out
    assert history.shape == (B, keep) and history.dtype == torch.int64 and history.is_contiguous(), history.shape
    if B == 0:
        return rows, history
    _ple_rows_kernel[(B,)](ids, cu_seqlens, context_ids, slots, has_initial_state, multipliers, sizes, offsets, rows,
                           history, context_ids.stride(0), eos, ORDER=keep + 1, HEADS_PER_NGRAM=heads_per_ngram,
                           BLOCK_T=triton.next_power_of_2(max(1, max_new_tokens)),
                           BLOCK_K=triton.next_power_of_2(max(1, keep)), STORE=store, num_warps=1)
    return rows, history

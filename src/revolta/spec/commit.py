"""Recurrent state after a verify step: commit the state of the last accepted row.

During verification (`forward.VerifyMeta`) no recurrent layer writes its committed state:
GDN runs the token-by-token verify kernel from the committed state (the same arithmetic as a
single-token decode) and, with per-draft state slots, writes the state after every row into
its own slot; the causal convs (GDN q/k/v conv, PLE dilated conv) only read their windows, and
PLE's n-gram context is not advanced. Once the accepted count a_b is known, `commit_verified`
makes every slot hold the state after the definite token and a_b drafts (n_b = a_b + 1 rows):

- per-draft slots: the GDN state is already in `draft_slots[b, n_b - 1]`, which becomes the
  running slot (the allocator re-points it, nothing is copied); the small remaining slot
  tensors (conv windows, PLE history, QSA pending index keys) are carried over to it first;
- replay (`spec_state_replay`): the replay kernel re-runs the first n_b rows from the committed
  state with the verify step's recorded inputs and launch shape, bitwise the kept state;
- both: each conv window is advanced by its first n_b recorded inputs (a pure copy of values,
  exact), and the PLE n-gram context by the first n_b token ids.

QSA K/V and index keys need no commit: they are addressed by token position, so rows past the
accepted ones are overwritten when those positions are computed for real (the pending-key ring
holds 2c entries, enough for verify steps of up to c + 1 rows, spec/model.md §4.6).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cache.storage import CacheStorage
from ..forward import GDNRecord, PLERecord, VerifyMeta
from ..kernels.ops import KernelOps


def commit_verified(storage: CacheStorage, ops: KernelOps, meta: VerifyMeta, cu_seqlens: Tensor,
                    input_ids: Tensor, slots: Tensor, keep_slots: Tensor, num_kept: Tensor) -> None:
    """Make `keep_slots` hold each sequence's state after its first `num_kept` rows.

    cu_seqlens: int32 [B + 1] and input_ids: [T] of the verify step; slots: int32 [B] the
    running slots it read; keep_slots: int32 [B] the slots that hold the committed state from now
    on (= slots for replay; draft_slots[b, n_b - 1] with per-draft slots); num_kept: int32 [B] in
    [1, rows of b] (definite token + accepted drafts). Device work only, no host sync, so a
    CUDA graph can capture it (spec/graphs.py); rows padded onto the dummy slot 0 are harmless.
    """
    if meta.draft_slots is not None:
        # carry the small slot tensors to the kept slot (an identity copy where nothing moved)
        src, dst = slots.long(), keep_slots.long()
        for x in storage.slot_tensors(skip_gdn_state=True):
            x.index_copy_(0, dst, x.index_select(0, src))
    for rec in meta.record.values():
        if isinstance(rec, GDNRecord):
            cache = storage.gdn[rec.layer_idx]
            ops.causal_conv1d_commit(rec.mixed, cache.conv_state, keep_slots, cu_seqlens, num_kept)
            if meta.draft_slots is None:
                q, k, v, g, beta = rec.replay_inputs
                ops.gdn_replay_commit(q, k, v, g, beta, cache.ssm_state, keep_slots, num_kept, rec.scale)
        elif isinstance(rec, PLERecord):
            cache = storage.ple[rec.layer_idx]
            ops.causal_conv1d_commit(rec.conv_in, cache.conv, keep_slots, cu_seqlens, num_kept)
            cache.context_ids[keep_slots.long()] = _advance_context(rec.history, input_ids, cu_seqlens,
                                                                    num_kept).to(cache.context_ids.dtype)


def check_replay_slots(slots: list[int], keep_slots: list[int], replay: bool) -> None:
    """Replay commits in place: every kept slot must be the running slot (host lists, checked before
    the device work)."""
    if replay and slots != keep_slots:
        raise ValueError(f"replay commits in place: keep_slots {keep_slots} must equal slots {slots}")


def _advance_context(history: Tensor, input_ids: Tensor, cu_seqlens: Tensor, num_kept: Tensor) -> Tensor:
    """[B, n-1] the last n-1 ids of (history ++ the first num_kept ids of each sequence), gathered
    without a per-sequence loop: entry j is element num_kept + j of that concatenation."""
    B, keep = history.shape
    if keep == 0 or B == 0:
        return history.clone()
    j = torch.arange(keep, device=history.device)
    at = num_kept.long()[:, None] + j[None, :]  # [B, n-1] index into (history ++ new ids)
    from_hist = at < keep
    flat = (cu_seqlens[:-1].long()[:, None] + at - keep).clamp(0, max(input_ids.shape[0] - 1, 0))
    new = input_ids[flat].to(history.dtype)
    return torch.where(from_hist, history.gather(1, at.clamp(max=keep - 1)), new)

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
    [1, rows of b] (definite token + accepted drafts).
    """
    moved = [(int(s), int(k)) for s, k in zip(slots.tolist(), keep_slots.tolist()) if s != k]
    if moved:
        if meta.draft_slots is None:
            raise ValueError("replay commits in place: keep_slots must equal slots")
        storage.copy_slots(moved, skip_gdn_state=True)
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


def _advance_context(history: Tensor, input_ids: Tensor, cu_seqlens: Tensor, num_kept: Tensor) -> Tensor:
    """[B, n-1] the last n-1 ids of (history ++ the first num_kept ids of each sequence)."""
    keep = history.shape[1]
    rows = []
    for b, (start, n) in enumerate(zip(cu_seqlens[:-1].tolist(), num_kept.tolist())):
        ids = torch.cat([history[b], input_ids[start:start + n].to(history.dtype)])
        rows.append(ids[ids.shape[0] - keep:])
    return torch.stack(rows)

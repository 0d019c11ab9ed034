"""The n-gram row ids of spec/model.md §5.3 on plain arrays (torch-free, so the PLE worker needs only numpy).

`row_ids` is the one hash implementation: the PLE layer calls it on torch tensors (with torch.stack),
the worker on numpy arrays (with np.stack); only operators both share are used, so the two agree
bit for bit. `ngram_contexts_host` is the worker's numpy twin of kernels/ple_rows.ngram_contexts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def row_ids(contexts: Any, multipliers: Sequence[Any], sizes: Any, offsets: Any, heads_per_ngram: int,
            stack: Callable) -> Any:
    """contexts [T, n] int64 (c_0 .. c_{n-1}) -> row ids [T, (n-1) * heads_per_ngram], bigram heads first.

    mix_n = XOR_{k<n} c_k * m_k (products fit int64: m_k < 2^63 / vocab); row_h = offset_h + mix_{n(h)} mod p_h.
    """
    mix, cols = contexts[:, 0] * multipliers[0], []
    for k in range(1, contexts.shape[1]):
        mix = mix ^ (contexts[:, k] * multipliers[k])
        cols += [mix] * heads_per_ngram
    return offsets + stack(cols, -1) % sizes


def ngram_contexts_host(ids: np.ndarray, history: np.ndarray, cu_seqlens: np.ndarray, eos: int) -> np.ndarray:
    """ids [T] int64 of B sequences laid end to end (cu_seqlens [B + 1]); history [B, n-1] the ids before
    each sequence's first one (oldest first, EOS at a sequence start) -> contexts [T, n]: c_k = id_{t-k}
    unless an EOS sits at t-k..t-1, else EOS."""
    T, order = ids.shape[0], history.shape[1] + 1
    seq = np.repeat(np.arange(cu_seqlens.shape[0] - 1), np.diff(cu_seqlens))
    local = np.arange(T) - cu_seqlens[:-1][seq]
    ctx, broken = [ids], np.zeros(T, dtype=bool)
    for k in range(1, order):
        in_step = ids[np.clip(np.arange(T) - k, 0, None)]
        earlier = history[seq, np.clip(order - 1 - k + local, 0, order - 2)]
        prev = np.where(local >= k, in_step, earlier)
        broken |= prev == eos
        ctx.append(np.where(broken, eos, prev))
    return np.stack(ctx, -1)

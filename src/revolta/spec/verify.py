"""The acceptance rule for a linear chain of drafts (spec/engine.md §2.4).

A request verified with n drafts has n + 1 target rows: row i is the target's distribution for
the token after [definite token, d_1 .. d_i]. Emitted tokens per round = accepted + 1.

- greedy target: accept the longest prefix where d_i equals the argmax of row i-1; the bonus
  token is the argmax of the first mismatching row (or of row n when all are accepted). Each
  emitted token is the argmax of its own row, so the output equals greedy decoding without
  speculation whenever the rows equal the single-token decode rows.
- sampling target: standard speculative rejection sampling, lossless. Draft x_i with draft
  probability q_i(x_i) is accepted when u < p_i(x_i) / q_i(x_i), u ~ U[0, 1); at the first
  rejection the token is drawn from the normalised residual max(p_i - q_i, 0); after n
  acceptances a bonus is drawn from p_n. Greedy drafts have a one-hot q: acceptance is p_i(x_i)
  and the residual is p_i without x_i. For them this is done as plain decoding would sample:
  row i's token t_i = argmax(p_i / E_i), one noise draw per row, and d_i is accepted when t_i == d_i
  (probability p_i(d_i); otherwise t_i follows the residual). Each emitted token then uses exactly
  the noise plain decoding gives its position, so a seeded request draws the same tokens whether
  or when the adaptive policy drafts for it.
All randomness comes from the request's own generator, in a fixed order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


class DraftTokens(list):
    """A request's draft ids (a plain list of ints to every reader) with the drafter's proposal
    distribution when it sampled them: probs [n, V] fp32 (row i for draft i), or None for greedy
    (one-hot) drafts."""

    def __init__(self, ids=(), probs: Tensor | None = None):
        super().__init__(ids)
        self.probs = probs


def greedy_accept(target_ids: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """target_ids: argmax of each of the n + 1 rows; drafts: n tokens -> emitted tokens (accepted + bonus)."""
    if len(target_ids) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} target rows, got {len(target_ids)}")
    out: list[int] = []
    for i, d in enumerate(drafts):
        if int(target_ids[i]) != int(d):
            break
        out.append(int(d))
    out.append(int(target_ids[len(out)]))
    return out


def sample_from(probs: Tensor, generator: torch.Generator | None) -> int:
    """One draw from probs [V] (need not be normalised) by the exponential race argmax(p / E)."""
    noise = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=generator)
    return int((probs.float() / noise).argmax())


def rejection_sample(target_probs: Tensor, drafts: Sequence[int], draft_probs: Tensor | None,
                     generator: torch.Generator | None) -> list[int]:
    """Lossless speculative sampling for one request.

    target_probs: [n + 1, V] the target's sampling distributions (after temperature / top-k /
    top-p / min-p); drafts: n token ids; draft_probs: [n, V] the drafter's distributions, or None
    for greedy (one-hot) drafts. Returns the emitted tokens: the accepted drafts and one more.
    """
    n = len(drafts)
    if target_probs.dim() != 2 or target_probs.shape[0] != n + 1:
        raise ValueError(f"{n} drafts need target_probs [{n + 1}, V], got {tuple(target_probs.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (n, target_probs.shape[1]):
        raise ValueError(f"draft_probs must be [{n}, {target_probs.shape[1]}], got {tuple(draft_probs.shape)}")
    out: list[int] = []
    if draft_probs is None:  # greedy drafts: sample each row as plain decoding does, stop at the first mismatch
        for i, x in enumerate(drafts):
            out.append(sample_from(target_probs[i], generator))
            if out[-1] != int(x):
                return out
        out.append(sample_from(target_probs[n], generator))
        return out
    for i, x in enumerate(drafts):
        p = target_probs[i].float()
        p = p / p.sum()
        q = draft_probs[i].float() / draft_probs[i].float().sum()
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * float(q[x]) < float(p[x]):  # u < p(x) / q(x), without dividing by a zero q
            out.append(int(x))
            continue
        residual = (p - q).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: the rejection had probability ~0
            residual = p
        out.append(sample_from(residual, generator))
        return out
    out.append(sample_from(target_probs[n].float(), generator))
    return out

"""A forced drafter for speculative-decoding tests and benchmarks: the MTP head still runs (its K/V
seeding and its cost are part of what is measured), then its drafts are replaced by the run without
speculation's own greedy tokens, optionally altered, so every accept length can be exercised.

Works on both kinds of `MTPDrafter.propose` output: host lists, and the [n, k] device tensor of a
round on the speculative graphs (replaced through a pinned copy, without a host sync).
"""

from __future__ import annotations

from typing import Callable

import torch


def wrong_at(drafts: list[int], j: int | None, vocab_size: int) -> list[int]:
    """drafts with draft j (if there is one) replaced by another token."""
    return [(t + 1) % vocab_size if i == j else t for i, t in enumerate(drafts)]


def force_drafts(engine, refs: dict, alter: Callable[[str, list[int]], list[int]] | None = None,
                 check_count: bool = False) -> None:
    """refs: request_id -> (prompt length, its tokens without speculation); alter(request_id,
    drafts) -> the drafts to propose instead (same length), called once per request and round.
    check_count: fail when a request was asked for drafts past its reference tokens (its draft
    count was not trimmed near max_tokens)."""
    propose = engine.drafter.propose

    def forced(items, *graphs):
        out = propose(items, *graphs)
        rows = []
        for it in items:
            prompt_len, ref = refs.get(it.request_id, (0, []))
            g = len(it.all_token_ids) - prompt_len
            d = list(ref[g:g + it.num_drafts]) if it.num_drafts else []
            if check_count:
                assert len(d) == it.num_drafts, "drafts past max_tokens: the draft count was not trimmed"
            d = (d + [0] * it.num_drafts)[:it.num_drafts]
            rows.append(alter(it.request_id, d) if alter and d else d)
        if isinstance(out, torch.Tensor):
            host = torch.tensor([d + [0] * (out.shape[1] - len(d)) for d in rows], dtype=out.dtype)
            return (host.pin_memory() if out.is_cuda else host).to(out.device, non_blocking=True)
        return rows

    engine.drafter.propose = forced

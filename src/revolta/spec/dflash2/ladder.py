"""The concurrency ladder `dflash_concurrency_drafts` (spec/engine.md §2.5): how many of the
drafter's drafts a request verifies at a given number of running requests.

The release note calls {"4": 3, "5": 4} a "verification-width ladder" and states no semantics.
The reading implemented here is the threshold one (spec §2.5, [infer]), the same shape as
vLLM's `num_speculative_tokens_per_batch_size`: the rung with the largest key <= the number of
running requests applies, and it holds up to the next key; below the smallest key every draft
is verified. So {"4": 3, "5": 4} verifies 7 drafts at 1-3 running requests, 3 at 4, and 4 at 5
and more. The drafter still proposes its whole block; verifying a prefix of it is lossless
(acceptance only ever keeps a prefix). The exact-match reading (rungs only at exactly 4 and 5)
would verify all 7 at 8 requests, the most expensive width at the highest load, which is not
what a ladder tuned for throughput does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Ladder = tuple[tuple[int, int], ...]  # ((min running requests, drafts verified), ...), keys ascending


def parse_ladder(raw: Mapping[Any, Any] | None, num_drafts: int) -> Ladder:
    """{"4": 3, "5": 4} (JSON keys are strings) -> ((4, 3), (5, 4)); ValueError for keys that are
    not integers >= 1 or values outside [1, num_drafts]."""
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise ValueError(f"speculative_config dflash_concurrency_drafts={raw!r} must be a dict from running "
                         'requests to drafts verified, e.g. {"4": 3, "5": 4}')
    rungs = {}
    for key, value in raw.items():
        try:
            c = int(key)
        except (TypeError, ValueError):
            c = 0
        if c < 1 or isinstance(key, bool) or (isinstance(key, float) and not key.is_integer()):
            raise ValueError(f"dflash_concurrency_drafts key {key!r} must be a number of running requests >= 1")
        if c in rungs:
            raise ValueError(f"dflash_concurrency_drafts names {c} running requests twice")
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= num_drafts:
            raise ValueError(f"dflash_concurrency_drafts[{key!r}]={value!r} must be an integer in [1, {num_drafts}] "
                             f"(num_speculative_tokens={num_drafts})")
        rungs[c] = value
    return tuple(sorted(rungs.items()))


def drafts_at(ladder: Ladder, num_drafts: int, num_running: int) -> int:
    """Drafts each request verifies when `num_running` requests are running (see the module docstring)."""
    k = num_drafts
    for min_running, drafts in ladder:
        if num_running < min_running:
            break
        k = drafts
    return min(k, num_drafts)

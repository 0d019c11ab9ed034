"""Async scheduling: the next decode step launches before the host reads this step's tokens.

Why: a synchronous step leaves the GPU idle while the host reads the sampled tokens, appends them (detokenizer,
stop strings), schedules and packs the next step: 0.5-1.1 ms of a 13-14 ms C8 step of the full-depth stand-in on
the H200, the gap between its wall-time and GPU-time roofline fractions (benchmarks/RESULTS.md, F1 run I). Measured
(RESULTS.md A1, H100, the same engine and graphs): a C8 decode loop 1.09-1.15x faster (66-70% -> 73-76% of its
roofline), C1 1.06-1.11x.

How (`EngineConfig.async_scheduling`, vLLM's `async_scheduling` for plain decode steps):

    launch   a decode step of plain requests (`plain_request`; `Executor.runs_async` says the step qualifies)
             samples on the device and starts copying its tokens to pinned host memory (`PendingTokens`); the
             host does not wait: the step is in flight (`InFlightStep`).
    chain    at the next `Engine.step`, when nothing stands in the way (`chain_blocker`), the in-flight step is
             committed (its input tokens were known), each of its requests gets one placeholder token
             (`SeqState.num_placeholders`), the scheduler plans the next step as usual, and it launches with its
             input ids taken on the device from the in-flight step's samples. Only then does the host wait for
             the older step's tokens and append them (stop rules). A request that ended there (a stop, or its
             last token by length) already has a row in the newer step: that row is dropped and the request's
             blocks and slot freed at once (a later step that reuses them runs after it on the same stream); the
             step after takes its input ids from the rows that are left.
    land     otherwise (a request waiting for admission, too few free blocks, a prefix-cache snapshot due) the
             host reads the in-flight step's tokens, commits it, and the engine schedules the next step
             synchronously (which may launch asynchronously again).

Tokens are those of a synchronous run: the same forward rows, the same sampling draws in the same order (greedy
and seeded requests are reproducible either way; tests/engine/test_async_scheduling.py). One difference in the
batches: the step launched before the host saw a request end still carries that request's row, so with CUDA graphs
of several sizes it can replay a larger graph than the synchronous engine would for that step (5 rows in the 8-row
graph where the synchronous step has 3 rows in the 4-row one), and GPU kernels may round a row differently at
another batch size; with one capture size, or on the CPU's row-invariant path, the outputs are bitwise the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..cache.hybrid import HybridAllocator
from .request import Request
from .scheduler import ScheduledSeq, Scheduler


class PendingTokens:
    """A step's sampled tokens on their way to the host: `ids` [B] int64 on the device (the next step's inputs),
    and `extra` tensors of the same step (logprob values), with pinned host copies started without waiting;
    `read()` / `read_extra()` wait for them."""

    def __init__(self, ids: Tensor, extra: tuple[Tensor, ...] = ()):
        self.ids = ids
        self._event = None
        if ids.is_cuda:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (ids, *extra)]
            for h, t in zip(self._host, (ids, *extra)):
                h.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = [ids, *extra]

    def read(self) -> list[int]:
        """The token ids (waits for the step that samples them)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host[0].tolist()

    def read_extra(self) -> list[list]:
        """The extra tensors as lists (after `read`)."""
        return [h.tolist() for h in self._host[1:]]


@dataclass
class InFlightStep:
    """A launched step whose tokens the host has not read. dropped: rows whose request ended (stopped or aborted)
    after launch."""

    items: list[ScheduledSeq]
    tokens: PendingTokens  # with compute_logprobs' values of `logprob_rows` as its extra tensors
    dropped: set[int] = field(default_factory=set)
    logprob_rows: list[int] = field(default_factory=list)  # rows whose request asks for logprobs

    def row_of(self, request_id: str) -> int | None:
        return next((i for i, it in enumerate(self.items) if it.seq.request_id == request_id), None)

    def kept_rows(self) -> list[int]:
        return [i for i in range(len(self.items)) if i not in self.dropped]


def plain_request(r: Request) -> bool:
    """Sampled with no decision on the host before the draw: no grammar (its bitmask follows the tokens the host has
    read). Penalties, min_tokens and logit_bias count the one token in flight on the device (`apply_penalties`'
    in_flight); logprobs are computed on the device and read with the tokens."""
    return r.constraint is None


def chain_blocker(step: InFlightStep, scheduler: Scheduler, allocator: HybridAllocator) -> str | None:
    """Why the step after `step` cannot be planned before `step`'s tokens are read, or None when it can: then
    the scheduler will plan exactly `step`'s rows that are not dropped (`kept_rows`), one token each, in the same
    order, with no preemption. A request whose in-flight token is its last (by length, or a stop the host will find)
    is planned too: its row of the next step is dropped when the older step lands."""
    if scheduler.waiting:
        return "requests wait for admission"
    running, kept = scheduler.running, [step.items[i] for i in step.kept_rows()]
    if not running:
        return "no request runs"
    if len(running) != len(kept) or any(it.seq is not s for it, s in zip(kept, running)):
        return "the running requests changed"
    if len(running) > scheduler.max_num_batched_tokens:
        return "max_num_batched_tokens is below the number of running requests"
    bs, interval = allocator.block_size, allocator.config.snapshot_interval
    new_blocks = 0
    for it in kept:
        end = it.seq.num_computed_tokens + 2  # tokens in the cache after the next step
        new_blocks += -(-end // bs) > allocator.num_blocks(it.seq)
        if allocator.config.enable_prefix_caching and interval and end % interval == 0:
            return "a prefix-cache snapshot is due"  # its key would hash the placeholder
    if new_blocks > allocator.num_free_blocks:
        return "too few free blocks"
    return None

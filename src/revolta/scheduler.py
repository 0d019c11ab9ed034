"""Continuous batching within a token budget: chunked prefill mixed with decodes, preemption.

Each step: running requests first (a decode token, or the next prefill chunk), in arrival order,
then waiting requests while the token budget, `max_num_seqs` and the cache allow. When the
allocator says no for a running request, the most recently admitted running request is
preempted (recompute: its blocks and slot are freed; it restarts from the prefix cache) and the
allocation is retried, so the oldest requests always make progress.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from .cache.hybrid import Allocation, HybridAllocator


class SchedRequest(Protocol):
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated so far

    @property
    def finished(self) -> bool: ...


class Sequence:
    """A request as the scheduler and allocator see it: known tokens and how many are computed."""

    def __init__(self, request: SchedRequest):
        self.request = request
        self.request_id = request.request_id
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        # prompt logprobs need the logits of every prompt position: no prefix-cache hit
        self.skip_prefix_cache = getattr(request, "prompt_logprobs", None) is not None

    @property
    def all_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids + self.request.token_ids

    @property
    def num_pending_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.request.token_ids) - self.num_computed_tokens


@dataclass
class ScheduledSeq:
    seq: Sequence
    alloc: Allocation

    @property
    def num_new_tokens(self) -> int:
        return self.alloc.num_new_tokens


class Scheduler:
    def __init__(self, allocator: HybridAllocator, max_num_seqs: int, max_num_batched_tokens: int):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} and max_num_batched_tokens={max_num_batched_tokens} "
                             "must be >= 1")
        self.allocator = allocator
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        """Pick this step's work; every returned allocation must be followed by `update` or `abort`."""
        budget = self.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        scheduled: set[str] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            alloc = self._allocate(seq, min(seq.num_pending_tokens, budget), scheduled)
            if alloc is None:  # seq itself was preempted
                continue
            out.append(ScheduledSeq(seq, alloc))
            scheduled.add(seq.request_id)
            budget -= alloc.num_new_tokens
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            alloc = self.allocator.allocate(seq, min(seq.num_pending_tokens, budget))
            if alloc is None:
                break  # no room: wait for running requests to finish
            self.waiting.popleft()
            seq.num_computed_tokens = alloc.num_computed_tokens  # includes a prefix hit
            self.running.append(seq)
            out.append(ScheduledSeq(seq, alloc))
            scheduled.add(seq.request_id)
            budget -= alloc.num_new_tokens
        return out

    def _allocate(self, seq: Sequence, num_tokens: int, scheduled: set[str]) -> Allocation | None:
        while True:
            alloc = self.allocator.allocate(seq, num_tokens)
            if alloc is not None:
                return alloc
            # preempt the newest running request that is not already in this step
            victims = [s for s in self.running if s.request_id not in scheduled]
            victim = victims[-1]
            self._preempt(victim)
            if victim is seq:
                return None

    def _preempt(self, seq: Sequence) -> None:
        self.allocator.preempt(seq)
        self.running.remove(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update(self, items: list[ScheduledSeq]) -> None:
        """After the forward and sampling: commit the computed tokens, free finished requests."""
        for it in items:
            it.seq.num_computed_tokens += it.alloc.num_new_tokens
            self.allocator.commit(it.seq, 0)
            if it.seq.request.finished:
                self.finish(it.seq)

    def finish(self, seq: Sequence) -> None:
        self.allocator.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

"""Continuous batching within a token budget: chunked prefill mixed with decodes, preemption.

Each step: running requests first (a decode token, or the next prefill chunk), in arrival order,
then waiting requests while the token budget, `max_num_seqs` and the cache allow. When the
allocator says no for a running request, the most recently admitted running request is
preempted (recompute: its blocks and slot are freed; it restarts from the prefix cache) and the
allocation is retried, so the oldest requests always make progress.

Requests with media (`request.mm_prompt`) also need their items' vision-tower outputs: with an
`EncoderCache`, a chunk is cut right before the first item that cannot be encoded this step
(encoder budget or cache room, see encoder_cache.py). A request that cannot run a single token
for that reason is skipped this step, never allowed to block the requests behind it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from ..cache.hybrid import Allocation, HybridAllocator
from ..multimodal.encoder_cache import EncoderCache, EncoderStep
from ..multimodal.processor import MediaItem, MultimodalPrompt
from .request import Request
from .token_view import TokenView


class SeqState:
    """A request as the scheduler and allocator see it: known tokens and how many are computed."""

    def __init__(self, request: Request):
        self.request = request
        self.request_id = request.request_id
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        # prompt logprobs need the logits of every prompt position: no prefix-cache hit
        self.skip_prefix_cache = request.params.prompt_logprobs is not None
        # media: expanded prompt, items, positions; its content hashes key the prefix cache (extra_keys)
        self.mm: MultimodalPrompt | None = request.mm_prompt
        self.extra_keys = self.mm.extra_keys if self.mm is not None else None
        # tokens sampled by a launched step that the host has not read yet (async scheduling, async_step.py): they
        # count as known, so the next step can be scheduled before they are read
        self.num_placeholders = 0

    @property
    def all_token_ids(self) -> TokenView:
        """The prompt and output tokens, read in place: the cache and the step read the length and a slice every
        step, and a copy of a 512K-token context costs milliseconds of host time per request."""
        return TokenView(self.request.prompt_token_ids, self.request.token_ids, self.num_placeholders)

    @property
    def num_pending_tokens(self) -> int:
        return (len(self.request.prompt_token_ids) + len(self.request.token_ids) + self.num_placeholders
                - self.num_computed_tokens)


@dataclass
class ScheduledSeq:
    seq: SeqState
    alloc: Allocation
    encode: tuple[MediaItem, ...] = ()  # media items to run through the vision tower before this step

    @property
    def num_new_tokens(self) -> int:
        return self.alloc.num_new_tokens


class Scheduler:
    def __init__(self, allocator: HybridAllocator, max_num_seqs: int, max_num_batched_tokens: int,
                 encoder_cache: EncoderCache | None = None, max_num_encoder_input_tokens: int = 0,
                 lookahead_fn: Callable[[SeqState], int] | None = None):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} and max_num_batched_tokens={max_num_batched_tokens} "
                             "must be >= 1")
        self.allocator = allocator
        self.encoder_cache, self.max_num_encoder_input_tokens = encoder_cache, max_num_encoder_input_tokens
        # speculative decoding: how many drafts a decoding request verifies this step (they are
        # lookahead tokens in the budget and the allocation); None = no speculation
        self.lookahead_fn = lookahead_fn
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[SeqState] = deque()
        self.running: list[SeqState] = []

    def add(self, seq: SeqState) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        """Pick this step's work; every returned allocation must be followed by `update` or `abort`."""
        budget = self.max_num_batched_tokens
        enc = EncoderStep(self.encoder_cache, self.max_num_encoder_input_tokens) \
            if self.encoder_cache is not None else None
        out: list[ScheduledSeq] = []
        scheduled: set[str] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._media_limit(enc, seq, seq.num_computed_tokens, min(seq.num_pending_tokens, budget))
            if n == 0:  # its next token needs media that cannot be encoded this step
                i += 1
                continue
            lookahead = 0
            if self.lookahead_fn is not None and seq.num_pending_tokens == 1:
                lookahead = max(0, min(self.lookahead_fn(seq), budget - 1))
            alloc = self._allocate(seq, n, scheduled, lookahead)
            if alloc is None:  # seq itself was preempted
                continue
            out.append(ScheduledSeq(seq, alloc, self._media_commit(enc, seq, alloc)))
            scheduled.add(seq.request_id)
            budget -= alloc.num_new_tokens + alloc.num_lookahead_tokens
            i += 1
        j, media_blocked = 0, False
        while j < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[j]
            n = min(seq.num_pending_tokens, budget)
            if seq.mm is not None and enc is not None:
                # after a request blocked on the encoder, admit text only: later media must not take the room
                # it waits for
                n = 0 if media_blocked else self._media_limit(enc, seq, self.allocator.lookup_num_cached_tokens(seq),
                                                              n)
                if n == 0:
                    media_blocked = True
                    j += 1  # blocked on the encoder only: let the text requests behind it in
                    continue
            alloc = self.allocator.allocate(seq, n)
            if alloc is None:
                break  # no room: wait for running requests to finish
            del self.waiting[j]
            seq.num_computed_tokens = alloc.num_computed_tokens  # includes a prefix hit
            if seq.request.num_cached_tokens is None:  # the first admission's hit, not a re-admission's
                seq.request.num_cached_tokens = alloc.num_cached_tokens  # vLLM's RequestOutput.num_cached_tokens
            self.running.append(seq)
            out.append(ScheduledSeq(seq, alloc, self._media_commit(enc, seq, alloc)))
            scheduled.add(seq.request_id)
            budget -= alloc.num_new_tokens
        return out

    @staticmethod
    def _media_limit(enc: EncoderStep | None, seq: SeqState, num_computed: int, num_tokens: int) -> int:
        if enc is None or seq.mm is None:
            return num_tokens
        return enc.limit(seq.mm, num_computed, num_tokens)

    @staticmethod
    def _media_commit(enc: EncoderStep | None, seq: SeqState, alloc: Allocation) -> tuple[MediaItem, ...]:
        if enc is None or seq.mm is None:
            return ()
        return tuple(enc.commit(seq.request_id, seq.mm, alloc.num_computed_tokens, alloc.num_new_tokens))

    def _allocate(self, seq: SeqState, num_tokens: int, scheduled: set[str], lookahead: int = 0) -> Allocation | None:
        while True:
            alloc = self.allocator.allocate(seq, num_tokens, lookahead)
            if alloc is not None:
                return alloc
            # preempt the newest running request that is not already in this step
            victims = [s for s in self.running if s.request_id not in scheduled]
            victim = victims[-1]
            self._preempt(victim)
            if victim is seq:
                return None

    def _preempt(self, seq: SeqState) -> None:
        self.allocator.preempt(seq)
        self._release_media(seq)
        self.running.remove(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update(self, items: list[ScheduledSeq], num_accepted: list[int] | None = None) -> None:
        """After the forward and sampling: commit the computed tokens (and the accepted drafts of
        each item, `num_accepted`, default none), free finished requests."""
        for j, it in enumerate(items):
            accepted = num_accepted[j] if num_accepted is not None else 0
            it.seq.num_computed_tokens += it.alloc.num_new_tokens + accepted
            self.allocator.commit(it.seq, accepted)
            if it.seq.mm is not None and self.encoder_cache is not None:
                self.encoder_cache.release_passed(it.seq.request_id, it.seq.mm, it.seq.num_computed_tokens)
            if it.seq.request.finished:
                self.finish(it.seq)

    def finish(self, seq: SeqState) -> None:
        self.allocator.free(seq)
        self._release_media(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _release_media(self, seq: SeqState) -> None:
        if seq.mm is not None and self.encoder_cache is not None:
            self.encoder_cache.release_all(seq.request_id, seq.mm)

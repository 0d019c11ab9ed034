"""Encoder cache and per-step encoder budget: when a media item's vision-tower output is computed and freed.

An item is encoded once, whole, in the step whose prefill chunk first reaches one of its pad tokens; its output
rows ([num_tokens, d]) stay in the `EncoderCache` while any running request still has pad tokens of it to
compute, and are freed as soon as none has (so the cache never holds more than `capacity` rows and idle media
costs nothing). Entries are keyed by content hash: two running requests with the same image share one entry.

`EncoderStep` is the scheduler's view during one `schedule()` call. `limit()` says how many of a request's next
tokens can run given the encoder budget left this step and the room in the cache; when the next item cannot be
encoded now, the chunk stops right before that item. It never waits for an item the request has already passed,
so two adjacent items that cannot be cached together still progress: the tokens of the first finish, its entry is
freed, then the second is encoded (the release note's stall, #6). An item larger than the budget or the cache can
never run, which `check_item_fits` rejects when the request is added.

Pure Python bookkeeping; the engine runs the tower and stores the tensors with `put`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from .processor import MediaItem, MultimodalPrompt
from .media import MediaError


@dataclass
class _Entry:
    num_tokens: int
    holders: set[str] = field(default_factory=set)
    embeds: Tensor | None = None  # None between scheduling and the engine's encode


class EncoderCache:
    """Vision-tower outputs by content hash, reference-counted by request id, bounded by `capacity` rows."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"encoder_cache_size={capacity} must be >= 1")
        self.capacity = capacity
        self._entries: dict[int, _Entry] = {}
        self.num_used = 0  # rows reserved or stored
        self.peak_used = 0

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_free(self) -> int:
        return self.capacity - self.num_used

    def acquire(self, key: int, num_tokens: int, request_id: str) -> bool:
        """Hold entry `key` for `request_id`, reserving room when it is new. True when it still needs encoding."""
        entry = self._entries.get(key)
        if entry is None:
            if num_tokens > self.num_free:
                raise RuntimeError(f"encoder cache over capacity: {num_tokens} rows asked, {self.num_free} free")
            entry = self._entries[key] = _Entry(num_tokens)
            self.num_used += num_tokens
            self.peak_used = max(self.peak_used, self.num_used)
        entry.holders.add(request_id)
        return entry.embeds is None

    def put(self, key: int, embeds: Tensor) -> None:
        """Store the encoder output [num_tokens, d] of a held entry."""
        entry = self._entries[key]
        if embeds.shape[0] != entry.num_tokens:
            raise ValueError(f"encoder output has {embeds.shape[0]} rows, the entry {entry.num_tokens}")
        entry.embeds = embeds

    def get(self, key: int) -> Tensor:
        entry = self._entries.get(key)
        if entry is None or entry.embeds is None:
            raise KeyError(f"media item {key:032x} is not encoded")
        return entry.embeds

    def release(self, key: int, request_id: str) -> None:
        entry = self._entries.get(key)
        if entry is None:
            return
        entry.holders.discard(request_id)
        if not entry.holders:  # nobody running needs it: free now
            del self._entries[key]
            self.num_used -= entry.num_tokens

    def release_passed(self, request_id: str, mm: MultimodalPrompt, num_computed: int) -> None:
        """Drop the request's hold on every item whose pad tokens it has all computed (an image repeated later
        in the prompt stays held: its entry serves the later copy too)."""
        needed = {item.content_hash for item in mm.items if item.end > num_computed}
        for item in mm.items:
            if item.end <= num_computed and item.content_hash not in needed:
                self.release(item.content_hash, request_id)

    def release_all(self, request_id: str, mm: MultimodalPrompt) -> None:
        for item in mm.items:
            self.release(item.content_hash, request_id)


class EncoderStep:
    """Encoder budget and cache room during one scheduling pass."""

    def __init__(self, cache: EncoderCache, budget: int):
        self.cache = cache
        self.budget = budget  # encoder output rows this step may still compute

    def limit(self, mm: MultimodalPrompt, num_computed: int, num_tokens: int) -> int:
        """Largest n <= num_tokens such that every item with pads in [num_computed, num_computed + n) is
        already cached (or held) or can be encoded this step; 0 when the very next token needs an item that
        cannot be encoded now."""
        end = num_computed + num_tokens
        budget, room = self.budget, self.cache.num_free
        planned: set[int] = set()
        for item in mm.items_in(num_computed, end):
            if item.content_hash in self.cache or item.content_hash in planned:
                continue  # encoded (or being encoded this step) for someone: sharing costs nothing
            if item.num_tokens > budget or item.num_tokens > room:
                first_pad = item.rows_in(num_computed, end)[0][1]
                return first_pad - num_computed
            budget -= item.num_tokens
            room -= item.num_tokens
            planned.add(item.content_hash)
        return num_tokens

    def commit(self, request_id: str, mm: MultimodalPrompt, num_computed: int, num_tokens: int) -> list[MediaItem]:
        """Hold every item the scheduled tokens need; returns the items to encode before this step's forward."""
        todo = []
        for item in mm.items_in(num_computed, num_computed + num_tokens):
            new = item.content_hash not in self.cache
            needs_encode = self.cache.acquire(item.content_hash, item.num_tokens, request_id)
            if new and needs_encode:
                self.budget -= item.num_tokens
                todo.append(item)
        return todo


def check_item_fits(mm: MultimodalPrompt, encoder_budget: int, cache_size: int) -> None:
    """Reject a prompt with an item that no step could ever encode (it would wait forever)."""
    for k, item in enumerate(mm.items):
        limit = min(encoder_budget, cache_size)
        if item.num_tokens > limit:
            raise MediaError(f"{item.modality} {k} needs {item.num_tokens} encoder tokens, more than the encoder "
                             f"budget ({encoder_budget}) or encoder cache ({cache_size}) holds; lower max_pixels "
                             "(video: video_max_pixels / max_frames) or raise max_num_encoder_input_tokens and "
                             "encoder_cache_size", param=item.modality)

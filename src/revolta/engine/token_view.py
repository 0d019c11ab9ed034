"""`TokenView`: a request's prompt + output token ids as one read-only sequence, without copying either list."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence


PLACEHOLDER_ID = 0  # what a view reads for a token sampled on the device but not yet read by the host


class TokenView(Sequence[int]):
    """head + tail (+ `num_placeholders` tokens not yet known), read in place: len is O(1), an index is O(1), a
    slice copies only what it covers (a list).

    It reads the live lists, so tokens appended to them after the view was made are in it. Placeholders stand for
    tokens an asynchronous step sampled on the device whose ids the host has not read (engine/async_step.py): they
    count in the length and read as PLACEHOLDER_ID (the step that consumes one takes the real id on the device)."""

    __slots__ = ("_head", "_tail", "_extra")

    def __init__(self, head: list[int], tail: list[int], num_placeholders: int = 0):
        self._head, self._tail, self._extra = head, tail, num_placeholders

    def __len__(self) -> int:
        return len(self._head) + len(self._tail) + self._extra

    def __getitem__(self, i):
        n = len(self._head)
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return [self[j] for j in range(start, stop, step)]
            known = n + len(self._tail)
            if stop > known:  # placeholders at the end
                return self[start:known] + [PLACEHOLDER_ID] * (stop - max(start, known))
            if stop <= n:
                return self._head[start:stop]
            if start >= n:
                return self._tail[start - n:stop - n]
            return self._head[start:] + self._tail[:stop - n]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"token index {i} out of range for {len(self)} tokens")
        if i >= n + len(self._tail):
            return PLACEHOLDER_ID
        return self._head[i] if i < n else self._tail[i - n]

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(self._head, self._tail, itertools.repeat(PLACEHOLDER_ID, self._extra))

    def __eq__(self, other) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # equal to lists, mutable through them

    def __repr__(self) -> str:
        return f"TokenView({list(self)!r})"

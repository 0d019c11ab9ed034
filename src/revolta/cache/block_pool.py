"""Reference-counted ids with a free list in eviction order and a hash -> id map (pure Python).

`BlockPool` hands out KV block ids. The same class, under another name, hands out state slots
(`state_pool.StatePool`) and the CPU tier's ids, because the three need the same bookkeeping:

    id 0          reserved: the null block (block tables pad with it) / the dummy slot (graph
                  padding writes there); never handed out, never freed, never cached
    ref_cnt[i]    how many owners hold id i (requests, or pins of a prefix hit in flight)
    free          ids with ref 0, in eviction order: the head is handed out next. An id that
                  holds no cached data goes to the head when freed (reuse it first); one that
                  is cached goes to the tail (least recently used first, vLLM style)
    cached        content hash -> id, for ids whose content is worth keeping (full prefix blocks,
                  state snapshots). A cached id with ref 0 is still in `free`: taking it for a new
                  owner evicts its hash (and reports it to `on_evict`, which the CPU tier uses)

Invariants (checked by `check`): every id except 0 is either in `free` with ref 0 or has
ref > 0; an id has at most one hash; `cached` and `hash_of` mirror each other.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

NULL_ID = 0


class PoolError(RuntimeError):
    """A bookkeeping bug: a double free, freeing the null id, touching an unknown id."""


class BlockPool:
    """`num_ids` ids, 0 reserved; `num_free` of the rest are free (cached ones included)."""

    def __init__(self, num_ids: int, on_evict: Callable[[int, int], None] | None = None):
        if num_ids < 1:
            raise ValueError(f"num_ids={num_ids}: a pool needs at least the reserved id 0")
        self.num_ids = num_ids
        self.ref_cnt = [0] * num_ids
        self.hash_of: list[int | None] = [None] * num_ids
        self.cached: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_ids))
        self.on_evict = on_evict

    @property
    def num_free(self) -> int:
        """Ids that `allocate` may hand out now (free, or cached and evictable)."""
        return len(self.free)

    @property
    def num_usable(self) -> int:
        return self.num_ids - 1

    def allocate(self, n: int) -> list[int] | None:
        """Take `n` ids from the head of the free list (ref 1 each), evicting cached ones; None if short."""
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            i, _ = self.free.popitem(last=False)
            self._evict(i)
            self.ref_cnt[i] = 1
            out.append(i)
        return out

    def touch(self, ids: Iterable[int]) -> None:
        """Add one owner to each id (a prefix hit, a pin); a free id leaves the free list (not evicted)."""
        for i in ids:
            self._check_id(i)
            if self.ref_cnt[i] == 0:
                del self.free[i]
            self.ref_cnt[i] += 1

    def free_ids(self, ids: Sequence[int]) -> None:
        """Drop one owner from each id, last id first: a request's tail blocks are evicted before its head."""
        for i in reversed(ids):
            self._check_id(i)
            if self.ref_cnt[i] <= 0:
                raise PoolError(f"double free of id {i}")
            self.ref_cnt[i] -= 1
            if self.ref_cnt[i] == 0:
                self.free[i] = None
                if self.hash_of[i] is None:
                    self.free.move_to_end(i, last=False)  # nothing worth keeping: hand it out first

    def cache(self, i: int, h: int) -> bool:
        """Register id `i` (held, ref > 0) as holding content `h`. False when `h` is already cached
        under another id (the caller keeps `i` as a plain, uncached id) or `i` already has a hash."""
        self._check_id(i)
        if self.ref_cnt[i] <= 0:
            raise PoolError(f"caching id {i}, which nobody holds")
        if h in self.cached or self.hash_of[i] is not None:
            return False
        self.cached[h] = i
        self.hash_of[i] = h
        return True

    def lookup(self, h: int) -> int | None:
        return self.cached.get(h)

    def evict(self, h: int) -> None:
        """Forget content `h` (its id keeps its owners, if any; a free one moves to the head)."""
        i = self.cached.get(h)
        if i is not None:
            self._evict(i)
            if self.ref_cnt[i] == 0:
                self.free.move_to_end(i, last=False)

    def reset_cache(self) -> int:
        """Forget every cached hash (a prefix-cache reset); returns how many were dropped."""
        n = len(self.cached)
        for i in list(self.cached.values()):
            self.hash_of[i] = None
        self.cached.clear()
        return n

    def _evict(self, i: int) -> None:
        h = self.hash_of[i]
        if h is not None:
            del self.cached[h]
            self.hash_of[i] = None
            if self.on_evict is not None:
                self.on_evict(i, h)

    def _check_id(self, i: int) -> None:
        if not 0 < i < self.num_ids:
            raise PoolError(f"id {i} is the reserved id 0 or outside [1, {self.num_ids})")

    def check(self) -> None:
        """Assert the invariants (tests call this after every operation)."""
        assert self.ref_cnt[NULL_ID] == 0 and NULL_ID not in self.free and self.hash_of[NULL_ID] is None
        for i in range(1, self.num_ids):
            assert self.ref_cnt[i] >= 0, (i, self.ref_cnt[i])
            assert (self.ref_cnt[i] == 0) == (i in self.free), (i, self.ref_cnt[i])
        assert len(self.cached) == sum(h is not None for h in self.hash_of)
        for h, i in self.cached.items():
            assert self.hash_of[i] == h, (h, i)

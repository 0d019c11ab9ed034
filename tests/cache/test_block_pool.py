"""BlockPool edge cases: the null id, exact fits, eviction order, hashes, double frees."""

from __future__ import annotations

import pytest

from revolta.cache.block_pool import NULL_ID, BlockPool, PoolError


def test_null_block_is_never_handed_out_and_exactly_full_fits():
    pool = BlockPool(5)
    ids = pool.allocate(4)
    assert sorted(ids) == [1, 2, 3, 4] and NULL_ID not in ids
    assert pool.num_free == 0 and pool.allocate(1) is None
    pool.check()


def test_one_short_returns_none_and_changes_nothing():
    pool = BlockPool(5)
    assert pool.allocate(5) is None
    assert pool.num_free == 4 and pool.ref_cnt == [0] * 5
    pool.check()


def test_null_and_unknown_ids_and_double_free_raise():
    pool = BlockPool(3)
    ids = pool.allocate(2)
    pool.free_ids(ids)
    with pytest.raises(PoolError, match="double free"):
        pool.free_ids(ids[:1])
    with pytest.raises(PoolError):
        pool.free_ids([NULL_ID])
    with pytest.raises(PoolError):
        pool.touch([3])


def test_reverse_order_free_and_lru_eviction():
    pool = BlockPool(7)
    a = pool.allocate(3)  # a request's blocks, head to tail
    for j, i in enumerate(a):
        assert pool.cache(i, 100 + j)
    b = pool.allocate(3)
    pool.free_ids(a)  # cached: appended tail first, so a[-1] is evicted before a[0]
    pool.free_ids(b)  # uncached: go to the head, reused before any cached block
    assert pool.allocate(3) == b
    evicted = []
    pool.on_evict = lambda i, h: evicted.append((i, h))
    assert pool.allocate(1) == [a[2]] and evicted == [(a[2], 102)]
    assert pool.lookup(102) is None and pool.lookup(100) == a[0]
    pool.check()


def test_touch_keeps_cached_block_and_moves_it_to_mru():
    pool = BlockPool(4)
    x, y, z = pool.allocate(3)
    for i, h in ((x, 1), (y, 2), (z, 3)):
        pool.cache(i, h)
    pool.free_ids([x, y, z])  # free order (eviction order): z, y, x
    pool.touch([z])  # a prefix hit: out of the free list, not evicted
    assert pool.lookup(3) == z and pool.ref_cnt[z] == 1
    pool.free_ids([z])  # last access now: evicted last
    assert pool.allocate(2) == [y, x]
    assert pool.lookup(3) == z
    pool.check()


def test_cache_duplicate_hash_keeps_first_owner():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    assert pool.cache(a, 7) and not pool.cache(b, 7)
    assert pool.lookup(7) == a and pool.hash_of[b] is None
    assert pool.reset_cache() == 1 and pool.lookup(7) is None
    pool.free_ids([a, b])
    pool.check()

"""HybridAllocator: edge cases of allocate/commit/free, prefix hits with state, drafts, CPU tier,
and an end-to-end toy model whose outputs must not change with prefix hits, preemption or offload."""

from __future__ import annotations


import pytest

from cache_sim import Req, layout, run_requests, tiny_config
from revolta.cache.hybrid import AllocatorConfig, HybridAllocator, slot_mapping
from revolta.cache.block_pool import PoolError
from revolta.cache.storage import CacheStorage


def alloc(num_blocks=9, num_slots=6, block_size=4, **kw) -> HybridAllocator:
    return HybridAllocator(AllocatorConfig(num_blocks=num_blocks, block_size=block_size, num_slots=num_slots, **kw))


def test_exactly_full_then_one_short():
    a = alloc(num_blocks=5, enable_prefix_caching=False)  # 4 usable blocks of 4 tokens
    r = Req("r", list(range(16)))
    got = a.allocate(r, 16)
    assert got is not None and len(got.new_block_ids) == 4 and 0 not in got.new_block_ids
    a.commit(r)
    a.check()
    r2 = Req("r2", list(range(100, 104)))
    assert a.allocate(r2, 1) is None  # one block short
    a.check()
    assert a.block_ids(r2) == () and a.num_free_blocks == 0
    a.free(r)
    assert a.allocate(r2, 4) is not None
    a.free(r2)
    a.check()
    assert a.blocks.num_free == 4 and a.slots.num_free == 5


def test_slot_shortage_returns_none_without_side_effects():
    a = alloc(num_slots=3, enable_prefix_caching=False)  # 2 usable slots
    r = Req("r", [1, 2, 3])
    assert a.allocate(r, 3, 0) is not None
    a.commit(r)
    r.all_token_ids.append(4)
    free_blocks = a.num_free_blocks
    assert a.allocate(r, 1, 2) is None  # running slot + 2 drafts > 2 usable
    assert a.num_free_blocks == free_blocks
    a.check()
    assert a.allocate(r, 1, 1) is not None
    a.check()


def test_prefix_hit_needs_state_and_is_capped_at_len_minus_one():
    a = alloc(num_blocks=20, num_slots=8)
    p = Req("p", list(range(12)))  # 3 full blocks; snapshot at ((12-1)//4)*4 = 8 (prompt's last boundary)
    first = a.allocate(p, 12)
    assert first.num_new_tokens == 8 and first.snapshot_slot  # chunk cut at the snapshot point
    a.commit(p)
    second = a.allocate(p, 12)
    assert second.num_new_tokens == 4 and second.snapshot_slot == 0
    a.commit(p)
    a.free(p)
    same = Req("same", list(range(12)))
    hit = a.allocate(same, 12)
    assert hit.num_cached_tokens == 8  # 12 would leave nothing to compute: capped at len - 1
    assert hit.slot_copies == ((first.snapshot_slot, hit.state_slot),)
    assert a.slots.ref_cnt[first.snapshot_slot] == 1  # pinned until commit
    a.commit(same)
    assert a.slots.ref_cnt[first.snapshot_slot] == 0
    other = Req("other", list(range(11)) + [99, 5])
    assert a.allocate(other, 13).num_cached_tokens == 8
    diverge = Req("div", [0, 1, 2, 3, 9, 9, 9, 9, 9])  # K/V hit of 1 block, but no snapshot at 4
    d = a.allocate(diverge, 9)
    assert d.num_cached_tokens == 0 and d.num_new_tokens == 4 and d.snapshot_slot  # junction: cut + snapshot
    a.free(same), a.free(other), a.free(diverge)
    a.check()


def test_per_draft_slots_rotate_on_commit():
    a = alloc(enable_prefix_caching=False)
    r = Req("r", [1, 2, 3])
    a.allocate(r, 3)
    a.commit(r)
    running = a.state_slot(r)
    r.all_token_ids.append(4)
    g = a.allocate(r, 1, 3)
    assert g.state_slot == running and len(g.draft_slots) == 3 and running not in g.draft_slots
    r.all_token_ids += [5, 6, 7]  # two drafts accepted + bonus
    a.commit(r, 2)
    assert a.state_slot(r) == g.draft_slots[1] and a.num_computed_tokens(r) == 6
    assert a.slots.num_free == 4  # 5 usable - the new running slot
    with pytest.raises(PoolError):
        a.commit(r, 0)
    a.free(r)
    a.check()


def test_replay_mode_has_no_draft_slots_and_lookahead_blocks():
    a = alloc(per_draft_state=False, enable_prefix_caching=False)
    r = Req("r", [1, 2, 3, 4])
    g = a.allocate(r, 4, 3)
    assert g.draft_slots == () and len(g.new_block_ids) == 2  # 4 + 3 tokens -> 2 blocks
    with pytest.raises(ValueError):
        a.commit(r, 4)
    a.commit(r, 0)
    a.free(r)
    a.check()


def test_cpu_tier_swaps_out_on_eviction_and_back_in_on_hit():
    a = alloc(num_blocks=5, num_slots=3, num_cpu_blocks=9, num_cpu_slots=3)
    p = Req("p", list(range(9)))  # 2 full blocks before the last token; snapshot at 8
    for _ in range(2):
        g = a.allocate(p, 9)
        a.commit(p)
    a.free(p)
    a.take_swap_outs()
    filler = Req("f", list(range(50, 67)))  # 16 tokens now: all 4 blocks and both slots, evicting p's cache
    a.allocate(filler, 16)
    outs = a.take_swap_outs()
    assert len(outs.blocks) == 2 and len(outs.slots) == 1
    a.free(filler)
    again = Req("again", list(range(9)))
    hit = a.allocate(again, 9)
    assert hit.num_cached_tokens == 8 and len(hit.swap_in_blocks) == 2 and len(hit.swap_in_slots) == 1
    a.commit(again)
    a.free(again)
    a.check()
    assert a.stats.cpu_hit_blocks == 2


def test_slot_mapping():
    assert slot_mapping([5, 2], 2, 7, 4) == [22, 23, 8, 9, 10]


def _prompts(n_shared=11, seed=0):
    import random

    rng = random.Random(seed)
    shared = [rng.randrange(97) for _ in range(n_shared)]
    prompts = [shared + [rng.randrange(97) for _ in range(rng.randrange(1, 9))] for _ in range(5)]
    prompts.append(list(prompts[0]))  # the same prompt again
    return prompts


def _run(prompts, *, blocks, slots, prefix, drafts=0, cpu=False, max_running=3, chunk=8):
    cfg = tiny_config()
    kw = dict(num_cpu_blocks=40, num_cpu_slots=12) if cpu else {}
    a = HybridAllocator(AllocatorConfig(num_blocks=blocks, block_size=4, num_slots=slots,
                                        enable_prefix_caching=prefix, **kw))
    st = CacheStorage(cfg, layout(blocks, slots))
    mirror = CacheStorage(cfg, layout(40, 12)) if cpu else None
    reqs = [Req(f"r{i}", list(p), max_tokens=10) for i, p in enumerate(prompts)]
    out = run_requests(cfg, a, st, reqs, chunk=chunk, num_drafts=drafts, max_running=max_running, cpu=mirror)
    a.check()
    assert a.blocks.num_free == blocks - 1 and a.slots.num_free == slots - 1  # nothing leaked
    return out, a


@pytest.mark.parametrize("drafts", [0, 3])
def test_outputs_do_not_depend_on_prefix_hits_preemption_or_offload(drafts):
    prompts = _prompts()
    ref, _ = _run(prompts, blocks=200, slots=40, prefix=False, drafts=drafts, max_running=1)
    hits, a = _run(prompts, blocks=200, slots=40, prefix=True, drafts=drafts, max_running=1)
    assert hits == ref and a.stats.hit_tokens > 0
    tight, a = _run(prompts, blocks=12, slots=9, prefix=True, drafts=drafts, cpu=True, max_running=3)
    assert tight == ref
    assert a.stats.swapped_out_blocks > 0

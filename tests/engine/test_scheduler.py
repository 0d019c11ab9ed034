"""Scheduler on its own (no model): the token budget, chunked prefill, max_num_seqs, preemption of the newest
request, lookahead (draft) tokens in the budget, and the prefix-cache hit recorded at first admission.

A step here is what the engine does around the forward: schedule, append one token to every request whose
known tokens are all computed (plus the accepted drafts), update.
"""

from __future__ import annotations

from revolta.cache.hybrid import AllocatorConfig, HybridAllocator
from revolta.engine.scheduler import Scheduler, SeqState
from engine_spies import greedy_request

NO_EOS = frozenset()


def make(num_blocks=33, num_slots=9, block_size=4, max_num_seqs=4, budget=8, prefix=False, lookahead_fn=None):
    allocator = HybridAllocator(AllocatorConfig(num_blocks=num_blocks, block_size=block_size, num_slots=num_slots,
                                                enable_prefix_caching=prefix))
    return Scheduler(allocator, max_num_seqs, budget, lookahead_fn=lookahead_fn), allocator


def add(sched, rid, prompt_len, max_tokens=4, first=0):
    seq = SeqState(greedy_request(rid, list(range(first, first + prompt_len)), max_tokens))
    sched.add(seq)
    return seq


def step(sched, accepted=None):
    """One engine step without a model -> {request id: (new tokens, lookahead tokens)} of the scheduled items."""
    items = sched.schedule()
    for j, it in enumerate(items):
        r = it.seq.request
        if it.alloc.num_computed_tokens + it.num_new_tokens == len(it.seq.all_token_ids):  # its next token is due
            for _ in range(1 + (accepted[j] if accepted else 0)):
                if not r.finished:
                    r.append(100 + len(r.token_ids), NO_EOS)
    sched.update(items, accepted)
    return {it.seq.request_id: (it.num_new_tokens, it.alloc.num_lookahead_tokens) for it in items}


def run_to_end(sched, limit=200):
    steps = 0
    while sched.has_unfinished():
        step(sched)
        steps += 1
        assert steps < limit, "the scheduler stopped making progress"
    return steps


def assert_pools_free(allocator):
    allocator.check()
    assert allocator.blocks.num_free == allocator.config.num_blocks - 1
    assert allocator.slots.num_free == allocator.config.num_slots - 1


def test_budget_chunks_prefills_and_running_requests_go_first():
    sched, allocator = make(budget=8)
    a, b = add(sched, "a", 10), add(sched, "b", 3, first=50)
    assert step(sched) == {"a": (8, 0)}  # the whole budget on a's first chunk; b waits
    assert a.num_computed_tokens == 8 and not a.request.token_ids and list(sched.waiting) == [b]
    assert step(sched) == {"a": (2, 0), "b": (3, 0)}  # a (running) first, then b in what is left
    assert len(a.request.token_ids) == 1 and len(b.request.token_ids) == 1
    assert step(sched) == {"a": (1, 0), "b": (1, 0)}  # decodes
    run_to_end(sched)
    assert [len(s.request.token_ids) for s in (a, b)] == [4, 4]
    assert_pools_free(allocator)


def test_max_num_seqs_caps_the_running_set():
    sched, allocator = make(max_num_seqs=2, budget=64)
    seqs = [add(sched, f"r{i}", 3, max_tokens=2 + i, first=10 * i) for i in range(3)]
    assert set(step(sched)) == {"r0", "r1"} and len(sched.running) == 2 and list(sched.waiting) == [seqs[2]]
    step(sched)  # r0 finishes (2 tokens): its place goes to r2 on the next step
    assert seqs[0].request.finished and [s.request_id for s in sched.running] == ["r1"]
    assert set(step(sched)) == {"r1", "r2"}
    run_to_end(sched)
    assert [len(s.request.token_ids) for s in seqs] == [2, 3, 4]
    assert_pools_free(allocator)


def test_preemption_takes_the_newest_request_and_requeues_it_first():
    # 6 usable blocks of 4 tokens: two requests of 8 prompt tokens fit (2 blocks each), their growth does not
    sched, allocator = make(num_blocks=7, budget=64, max_num_seqs=4)
    old, new = add(sched, "old", 8, max_tokens=12), add(sched, "new", 8, max_tokens=12, first=100)
    preempted = []
    orig = sched._preempt
    sched._preempt = lambda seq: (preempted.append((seq.request_id, seq.num_computed_tokens)), orig(seq))
    while not preempted:
        step(sched)
    assert preempted[0][0] == "new" and preempted[0][1] > 0
    assert new.num_preemptions == 1 and new.num_computed_tokens == 0 and sched.waiting[0] is new
    assert old in sched.running and new not in sched.running
    kept = list(new.request.token_ids)  # generated tokens survive: the request recomputes them
    run_to_end(sched)
    assert new.request.token_ids[:len(kept)] == kept
    assert len(old.request.token_ids) == len(new.request.token_ids) == 12
    assert_pools_free(allocator)


def test_lookahead_tokens_count_against_the_budget_and_accepted_drafts_commit():
    asked = []

    def lookahead(seq):
        asked.append(seq.request_id)
        return 4

    sched, allocator = make(budget=6, lookahead_fn=lookahead, num_blocks=33, num_slots=17)
    a, b = add(sched, "a", 3, max_tokens=20), add(sched, "b", 3, max_tokens=20, first=40)
    step(sched)  # prefills: no lookahead (more than one pending token)
    assert asked == [] and a.num_computed_tokens == 3 and b.num_computed_tokens == 3
    # a decodes with 4 drafts (5 of the 6 budget tokens); b gets the last token and no room for drafts
    assert step(sched, accepted=[2, 0]) == {"a": (1, 4), "b": (1, 0)}
    assert a.num_computed_tokens == 3 + 1 + 2 and len(a.request.token_ids) == 1 + 3
    assert b.num_computed_tokens == 4 and len(b.request.token_ids) == 2
    sched.finish(a)
    sched.finish(b)
    assert not sched.has_unfinished()
    assert_pools_free(allocator)


def test_prefix_hit_is_recorded_at_first_admission_only():
    sched, allocator = make(prefix=True, budget=64)
    first = add(sched, "first", 12, max_tokens=2)
    run_to_end(sched)
    assert first.request.num_cached_tokens == 0
    again = add(sched, "again", 12, max_tokens=2)  # the same prompt: whole blocks before the last token hit
    step(sched)
    assert again.request.num_cached_tokens == (12 - 1) // 4 * 4
    sched._preempt(again)  # re-admission after a preemption keeps the first admission's figure
    run_to_end(sched)
    assert again.request.num_cached_tokens == 8 and again.request.token_ids == first.request.token_ids
    assert_pools_free(allocator)


def test_finish_drops_a_waiting_request():
    sched, allocator = make(budget=4)
    a, b = add(sched, "a", 4), add(sched, "b", 4, first=20)
    step(sched)  # a takes the budget; b still waits
    sched.finish(b)
    assert list(sched.waiting) == [] and sched.running == [a]
    sched.finish(a)
    assert not sched.has_unfinished()
    assert_pools_free(allocator)

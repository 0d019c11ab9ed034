"""Property tests: random allocate / commit (with lookahead) / free / preempt / prefix hits /
evictions / offload never leak or double-free a block or slot, and ref counts return to 0."""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cache_sim import Req
from revolta.cache.hybrid import AllocatorConfig, HybridAllocator

SHARED = [7, 3, 5, 1, 9, 2, 8, 6, 4, 0, 7, 7, 1, 2, 3, 4]  # prompts share prefixes of this, so hits happen


class AllocatorMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(2, 40), num_slots=st.integers(2, 14),
                prefix=st.sampled_from([True, True, True, False]), per_draft=st.booleans(), cpu=st.booleans(),
                interval_blocks=st.integers(0, 3))
    def setup(self, block_size, num_blocks, num_slots, prefix, per_draft, cpu, interval_blocks):
        self.a = HybridAllocator(AllocatorConfig(
            num_blocks=num_blocks, block_size=block_size, num_slots=num_slots, enable_prefix_caching=prefix,
            per_draft_state=per_draft, snapshot_interval=interval_blocks * block_size,
            num_cpu_blocks=12 if cpu else 0, num_cpu_slots=5 if cpu else 0))
        self.sent: list[list[int]] = []
        self.live: dict[str, Req] = {}  # requests holding cache
        self.pending: dict[str, tuple[int, int]] = {}  # request id -> (num_new, lookahead) awaiting commit
        self.n = 0

    def _alloc(self, r: Req, chunk: int, lookahead: int) -> None:
        known = len(r.all_token_ids)
        computed = self.a.num_computed_tokens(r)
        prefill = r.request_id not in self.live or computed < known - 1
        g = self.a.allocate(r, chunk if prefill else 1, 0 if prefill else lookahead)
        if g is None:
            return
        assert 0 not in self.a.block_ids(r) and g.state_slot != 0 and 0 not in g.draft_slots
        assert g.num_cached_tokens <= known - 1 and g.num_new_tokens >= 1
        assert len(self.a.block_ids(r)) * self.a.block_size >= g.num_computed_tokens + g.num_new_tokens + (
            g.num_lookahead_tokens)
        self.live[r.request_id] = r
        self.pending[r.request_id] = (g.num_new_tokens, g.num_lookahead_tokens)

    def _commit(self, r: Req, accepted: int) -> None:
        num_new, _ = self.pending.pop(r.request_id)
        done = self.a.num_computed_tokens(r) + num_new
        if done + accepted >= len(r.all_token_ids):  # reached the end: accepted drafts + bonus become known
            r.all_token_ids += [(done + j) % 10 for j in range(accepted + 1)]
        self.a.commit(r, accepted)

    @rule(tail=st.lists(st.integers(0, 9), max_size=12), shared=st.integers(0, 16), chunk=st.integers(1, 12))
    def add(self, tail, shared, chunk):
        self.n += 1
        r = Req(f"r{self.n}", SHARED[:shared] + tail or [1])
        self.sent.append(list(r.all_token_ids))
        self._alloc(r, chunk, 0)
        self._prefill(r, chunk)

    @precondition(lambda self: self.sent)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 9), max_size=6), chunk=st.integers(1, 12))
    def resend(self, data, extra, chunk):
        """A prompt seen before (possibly extended, like a next chat turn): the prefix-hit path."""
        self.n += 1
        r = Req(f"r{self.n}", data.draw(st.sampled_from(self.sent)) + extra)
        self._alloc(r, chunk, 0)
        if data.draw(st.booleans()):
            self._prefill(r, chunk)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 12), lookahead=st.integers(0, 3))
    def step(self, data, chunk, lookahead):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        r = self.live[rid]
        if rid in self.pending:
            self._commit(r, data.draw(st.integers(0, self.pending[rid][1])))
        else:
            self._alloc(r, chunk, lookahead)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def prefill(self, data, chunk):
        """Drive one request until its known tokens are computed (commits without drafts)."""
        self._prefill(self.live[data.draw(st.sampled_from(sorted(self.live)))], chunk)

    def _prefill(self, r: Req, chunk: int) -> None:
        if r.request_id not in self.live:
            return
        for _ in range(40):
            if r.request_id in self.pending:
                self._commit(r, 0)
            if self.a.num_computed_tokens(r) >= len(r.all_token_ids) - 1:
                return
            self._alloc(r, chunk, 0)
            if r.request_id not in self.pending:
                return

    @precondition(lambda self: self.live)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data, preempt):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        r = self.live.pop(rid)
        self.pending.pop(rid, None)
        (self.a.preempt if preempt else self.a.free)(r)
        self.a.free(r)  # a second free is a no-op
        if preempt:  # requeue from token 0; its next allocation may hit the prefix cache
            self.n += 1
            self._alloc(Req(f"r{self.n}", list(r.all_token_ids), num_prompt_tokens=r.num_prompt_tokens), 8, 0)

    @rule()
    def drain_swaps(self):
        outs = self.a.take_swap_outs()
        assert all(0 not in p for p in outs.blocks + outs.slots)

    @rule()
    def reset_prefix_cache(self):
        self.a.reset_prefix_cache()

    @invariant()
    def consistent(self):
        if hasattr(self, "a"):
            self.a.check()

    def teardown(self):
        if not hasattr(self, "a"):
            return
        s = self.a.stats
        event(f"prefix hits: {s.hit_tokens > 0}, cpu hits: {s.cpu_hit_blocks > 0}, swaps: {s.swapped_out_blocks > 0}")
        for r in list(self.live.values()):
            self.a.free(r)
        self.a.check()
        for pool in (self.a.blocks, self.a.slots, self.a.cpu_blocks, self.a.cpu_slots):
            if pool is not None:
                assert all(c == 0 for c in pool.ref_cnt) and pool.num_free == pool.num_usable


AllocatorMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
TestAllocator = AllocatorMachine.TestCase

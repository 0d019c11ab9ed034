"""HybridAllocator: the one object the scheduler asks for KV blocks and state slots (pure Python).

Two pools, one page unit (see docs/cache.md):

- KV blocks (`BlockPool`): block b holds tokens [j*block_size, (j+1)*block_size) of one request in
  every QSA layer (and the MTP layer) at once: main K/V, compressed index keys, int8 scales;
- state slots (`StatePool`): slot s holds one request's fixed-size state in every GDN/PLE layer
  and the QSA pending index-key rings.

Per request and step the scheduler calls

    alloc = allocator.allocate(req, num_new_tokens, num_lookahead_tokens)   # None: no room
    ... runner: take_swap_outs(), then per allocation swap-ins and slot copies, the forward,
        then the snapshot copy state_slot -> snapshot_slot (storage.apply_pre_forward/_post_forward)
    allocator.commit(req, num_accepted)     # after the scheduler appended the accepted tokens
    allocator.free(req)                      # finished or aborted; preempt(req) is the same

The scheduler decides policy: on None it waits or preempts someone (`preempt` frees everything;
the request restarts its prefill later and may hit the prefix cache, including the CPU tier).

Token bookkeeping of one request (bs = block_size):

    all_token_ids  [0 ......................................... known)
    cached/computed[0 ............ num_computed)
    this step                     [+ num_new ......)[+ lookahead)   <- drafts being verified
    blocks         |  bs  |  bs  |  bs  |  bs  |  bs  |            <- cdiv(computed+new+lookahead, bs)
    prefix cache   full committed blocks, keyed by chained hashes; a snapshot slot per chosen
                   boundary (snapshot policy below)

Speculative lookahead: the step computes num_new definite tokens then num_lookahead drafts.
With per-draft state (`AllocatorConfig.per_draft_state`), the verifier writes the state after
the definite tokens into `state_slot` and the state after draft j into `draft_slots[j-1]`;
`commit(req, a)` keeps draft_slots[a-1] as the new running slot (no copy) and frees the others.
With replay (per_draft_state=False) there are no draft slots: the replay kernel commits the
accepted state into `state_slot` in place.

Snapshot policy (prefix caching with recurrent state, "align" in spirit): a prefix hit of k blocks
needs a state snapshot taken exactly at boundary k*bs. Snapshots are taken only at the end of a
step's definite tokens, never during verification, at a block boundary that is
  - the end of a prefill chunk inside the known tokens (free: no extra cut), or
  - the last block boundary before the final prompt token, ((P-1)//bs)*bs, the hit point of the
    same prompt sent again or extended by a later turn, or
  - a shared-prefix junction: the end of the K/V hit when it reaches past the deepest snapshot
    (an earlier request diverged there), or
  - a multiple of `snapshot_interval` tokens (0 = off).
The last three cut the prefill chunk so it ends there (`alloc.num_new_tokens` can be smaller than
asked). Snapshots are best effort (skipped when no slot is free) and LRU-evicted like blocks.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .block_pool import BlockPool, PoolError
from .prefix import ExtraKeysFn, block_hashes, kv_hit_blocks, longest_hit
from .state_pool import StatePool


class CacheRequest(Protocol):
    """What the allocator reads from a request. `all_token_ids` are the prompt plus accepted
    output tokens (drafts not included); an optional `extra_keys(start, end) -> tuple` attribute
    mixes media hashes into the block keys; an optional true `skip_prefix_cache` computes the
    whole prompt (a request that asks for prompt logprobs needs every prompt position)."""

    request_id: str
    all_token_ids: Sequence[int]
    num_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class AllocatorConfig:
    """Pool sizes (ids include the reserved id 0) and policy switches; `capacity.CachePlan` builds it."""

    num_blocks: int
    block_size: int
    num_slots: int
    enable_prefix_caching: bool = True
    per_draft_state: bool = True
    snapshot_interval: int = 0
    num_cpu_blocks: int = 0  # CPU tier; 0 = off
    num_cpu_slots: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_blocks < 2 or self.num_slots < 2:
            raise ValueError(f"{self}: need block_size >= 1 and at least one usable block and slot")
        if self.snapshot_interval % self.block_size:
            raise ValueError(f"snapshot_interval={self.snapshot_interval} must be a multiple of "
                             f"block_size={self.block_size}")
        if (self.num_cpu_blocks > 0) != (self.num_cpu_slots > 0):
            raise ValueError("the CPU tier needs both num_cpu_blocks and num_cpu_slots (or neither)")


@dataclass(frozen=True, slots=True)
class Allocation:
    """Room for one request's step. Pairs are (src, dst); run copies before the forward except
    the snapshot, which copies state_slot -> snapshot_slot after it."""

    num_cached_tokens: int  # prefix hit applied by this call (first allocation only); add to computed
    num_computed_tokens: int  # tokens in the cache before this step, hit included
    num_new_tokens: int  # definite tokens to compute now (<= asked: clamped to known tokens, cut at snapshots)
    num_lookahead_tokens: int  # drafts verified after them
    new_block_ids: tuple[int, ...]  # appended to the request's block table, in order (hit blocks included)
    state_slot: int  # running state: read at step start; holds the state after the definite tokens
    draft_slots: tuple[int, ...] = ()  # state after draft j -> draft_slots[j-1] (per-draft mode)
    snapshot_slot: int = 0  # 0 = none
    slot_copies: tuple[tuple[int, int], ...] = ()  # GPU snapshot -> running slot (prefix hit)
    swap_in_blocks: tuple[tuple[int, int], ...] = ()  # (cpu block, gpu block)
    swap_in_slots: tuple[tuple[int, int], ...] = ()  # (cpu slot, gpu slot)


@dataclass(frozen=True, slots=True)
class SwapOuts:
    """GPU -> CPU copies caused by evictions since the last `take_swap_outs`; run them first."""

    blocks: tuple[tuple[int, int], ...] = ()  # (gpu block, cpu block)
    slots: tuple[tuple[int, int], ...] = ()  # (gpu slot, cpu slot)


@dataclass
class _Pending:
    alloc: Allocation
    pinned_slots: list[int] = field(default_factory=list)
    pinned_cpu_blocks: list[int] = field(default_factory=list)
    pinned_cpu_slots: list[int] = field(default_factory=list)
    snapshot_at: int = 0


@dataclass
class _Seq:
    block_ids: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # keys of full known blocks, computed lazily
    num_computed: int = 0
    num_registered: int = 0  # leading blocks already offered to the prefix cache
    running_slot: int = 0
    junction: int = 0  # shared-prefix junction to snapshot at (tokens), 0 = none
    pending: _Pending | None = None


@dataclass(frozen=True, slots=True)
class _Hit:
    num_blocks: int = 0
    gpu: tuple[int | None, ...] = ()  # per hit block: GPU id, or None when it comes from the CPU tier
    cpu: tuple[int | None, ...] = ()  # per hit block: CPU id when gpu is None
    state: tuple[str, int] | None = None  # ("gpu", slot) | ("cpu", cpu slot)
    junction: int = 0
    hashes: tuple[int, ...] = ()  # keys of the full blocks before the last known token


@dataclass
class CacheStats:
    queries: int = 0  # first allocations that looked up the prefix cache
    hit_tokens: int = 0
    query_tokens: int = 0
    cpu_hit_blocks: int = 0
    snapshots: int = 0
    swapped_out_blocks: int = 0
    swapped_out_slots: int = 0


class HybridAllocator:
    """Blocks and slots for every running request; see the module docstring for the lifecycle."""

    def __init__(self, config: AllocatorConfig):
        self.config = config
        self.block_size = config.block_size
        # the pools call back through weak references: a bound method would make allocator and pools a cycle, which
        # only Python's cyclic collector frees (the cache's tensors with it, at a moment nobody chose)
        block_evicted, slot_evicted = weakref.WeakMethod(self._block_evicted), weakref.WeakMethod(self._slot_evicted)
        self.blocks = BlockPool(config.num_blocks, on_evict=lambda block, key: block_evicted()(block, key))
        self.slots = StatePool(config.num_slots, on_evict=lambda slot, key: slot_evicted()(slot, key))
        self.cpu_blocks = BlockPool(config.num_cpu_blocks) if config.num_cpu_blocks else None
        self.cpu_slots = StatePool(config.num_cpu_slots) if config.num_cpu_slots else None
        self._seqs: dict[str, _Seq] = {}
        self._swap_out_blocks: list[tuple[int, int]] = []
        self._swap_out_slots: list[tuple[int, int]] = []
        self.stats = CacheStats()

    # ---- the scheduler's API ----------------------------------------------------------------

    def allocate(self, request: CacheRequest, num_new_tokens: int,
                 num_lookahead_tokens: int = 0) -> Allocation | None:
        """Room for `num_new_tokens` definite tokens after the cached prefix plus
        `num_lookahead_tokens` drafts, or None (nothing changed) when blocks or slots are short.

        The first call for a request applies the longest prefix-cache hit (`num_cached_tokens`).
        `num_new_tokens` is clamped to the known tokens and may be cut at a snapshot boundary;
        use `alloc.num_new_tokens`. Every allocation must be followed by `commit` or `free`.
        """
        if num_new_tokens < 1 or num_lookahead_tokens < 0:
            raise ValueError(f"num_new_tokens={num_new_tokens} must be >= 1, "
                             f"num_lookahead_tokens={num_lookahead_tokens} >= 0")
        seq = self._seqs.get(request.request_id)
        if seq is not None and seq.pending is not None:
            raise PoolError(f"request {request.request_id!r}: allocate twice without commit")
        new_seq = seq is None
        hit = self._lookup(request) if new_seq else _Hit()
        seq = seq if seq is not None else _Seq(hashes=list(hit.hashes))
        bs = self.block_size
        computed = hit.num_blocks * bs if new_seq else seq.num_computed
        known = len(request.all_token_ids)
        if computed >= known:
            raise PoolError(f"request {request.request_id!r}: all {known} known tokens are computed")
        n = min(num_new_tokens, known - computed)
        junction = hit.junction if new_seq else seq.junction
        snapshot_at = 0
        if self.config.enable_prefix_caching and num_lookahead_tokens == 0:
            n = self._cut_at_snapshot_point(request, computed, n, junction)
            snapshot_at = self._snapshot_boundary(request, seq, computed + n, known, junction)

        # what is needed, checked before anything changes
        num_hit_cpu = sum(g is None for g in hit.gpu)
        table_len = hit.num_blocks if new_seq else len(seq.block_ids)
        need_total = -(-(computed + n + num_lookahead_tokens) // bs)
        num_new_blocks = num_hit_cpu + max(0, need_total - table_len)
        reusable = sum(1 for g in hit.gpu if g is not None and self.blocks.ref_cnt[g] == 0)
        if num_new_blocks > self.blocks.num_free - reusable:
            return None
        num_drafts = num_lookahead_tokens if self.config.per_draft_state else 0
        num_slots = (1 if seq.running_slot == 0 else 0) + num_drafts
        pinned_free = int(hit.state is not None and hit.state[0] == "gpu" and self.slots.ref_cnt[hit.state[1]] == 0)
        if num_slots > self.slots.num_free - pinned_free:
            return None

        # apply: pin every hit first, so the allocations below cannot evict them
        pending = _Pending(alloc=None)  # type: ignore[arg-type]
        gpu_hits = [g for g in hit.gpu if g is not None]
        self.blocks.touch(gpu_hits)
        cpu_hits = [c for c in hit.cpu if c is not None]
        if cpu_hits:
            self.cpu_blocks.touch(cpu_hits)
            pending.pinned_cpu_blocks = cpu_hits
        if hit.state is not None:
            where, sid = hit.state
            (self.slots if where == "gpu" else self.cpu_slots).touch([sid])
            (pending.pinned_slots if where == "gpu" else pending.pinned_cpu_slots).append(sid)

        fresh = self.blocks.allocate(num_new_blocks)
        assert fresh is not None
        swap_in_blocks = []
        for g, c in zip(hit.gpu, hit.cpu):
            if g is None:
                g = fresh.pop(0)
                swap_in_blocks.append((c, g))
            seq.block_ids.append(g)
        seq.block_ids.extend(fresh)
        new_block_ids = tuple(seq.block_ids) if new_seq else tuple(fresh)

        slot_copies, swap_in_slots = (), ()
        if seq.running_slot == 0:
            seq.running_slot = self.slots.allocate(1)[0]
            if hit.state is not None:
                pair = ((hit.state[1], seq.running_slot),)
                slot_copies, swap_in_slots = (pair, ()) if hit.state[0] == "gpu" else ((), pair)
        drafts = tuple(self.slots.allocate(num_drafts)) if num_drafts else ()
        snapshot_slot = 0
        if snapshot_at and self.slots.num_free:
            snapshot_slot = self.slots.allocate(1)[0]
            pending.snapshot_at = snapshot_at

        if new_seq:
            seq.num_computed = computed
            seq.num_registered = 0
            seq.junction = hit.junction
            self._seqs[request.request_id] = seq
        pending.alloc = Allocation(
            num_cached_tokens=computed if new_seq else 0, num_computed_tokens=computed, num_new_tokens=n,
            num_lookahead_tokens=num_lookahead_tokens, new_block_ids=new_block_ids, state_slot=seq.running_slot,
            draft_slots=drafts, snapshot_slot=snapshot_slot, slot_copies=slot_copies,
            swap_in_blocks=tuple(swap_in_blocks), swap_in_slots=swap_in_slots)
        seq.pending = pending
        return pending.alloc

    def commit(self, request: CacheRequest, num_accepted: int = 0) -> None:
        """The step ran: keep the definite tokens and the first `num_accepted` drafts.

        Call after appending the accepted tokens to `request.all_token_ids`. Registers newly full
        blocks and the snapshot in the prefix cache, rotates per-draft slots and drops the pins.
        """
        seq = self._seqs.get(request.request_id)
        if seq is None or seq.pending is None:
            raise PoolError(f"request {request.request_id!r}: commit without allocate")
        p, a = seq.pending, seq.pending.alloc
        if not 0 <= num_accepted <= a.num_lookahead_tokens:
            raise ValueError(f"num_accepted={num_accepted} must be in [0, {a.num_lookahead_tokens}]")
        seq.num_computed += a.num_new_tokens + num_accepted
        if len(request.all_token_ids) < seq.num_computed:
            raise PoolError(f"request {request.request_id!r}: {seq.num_computed} tokens computed but only "
                            f"{len(request.all_token_ids)} known; append accepted tokens before commit")
        if a.draft_slots:
            keep = a.draft_slots[num_accepted - 1] if num_accepted else seq.running_slot
            self.slots.free_ids([s for s in (seq.running_slot, *a.draft_slots) if s != keep])
            seq.running_slot = keep
        if self.config.enable_prefix_caching:
            self._register_blocks(request, seq)
            if a.snapshot_slot:
                key = self._hashes(request, seq, p.snapshot_at // self.block_size)[-1]
                self.stats.snapshots += self.slots.cache(a.snapshot_slot, key)
        if a.snapshot_slot:
            self.slots.free_ids([a.snapshot_slot])  # cached: evictable at the LRU tail; else reused first
        self._unpin(p)
        seq.pending = None

    def free(self, request: CacheRequest) -> None:
        """Release everything the request holds (blocks last-first, so its tail is evicted first).
        Committed full blocks and snapshots stay in the prefix cache. Safe to call twice."""
        seq = self._seqs.pop(request.request_id, None)
        if seq is None:
            return
        if seq.pending is not None:
            a = seq.pending.alloc
            self.slots.free_ids([s for s in (*a.draft_slots, a.snapshot_slot) if s])
            self._unpin(seq.pending)
        if seq.running_slot:
            self.slots.free_ids([seq.running_slot])
        self.blocks.free_ids(seq.block_ids)

    def preempt(self, request: CacheRequest) -> None:
        """Preemption by recompute: free everything; the scheduler resets the request to 0
        computed tokens and requeues it (its next allocation may hit the prefix cache)."""
        self.free(request)

    def take_swap_outs(self) -> SwapOuts:
        """GPU -> CPU copies the evictions since the last call need; run them before any other
        copy of the step (a swapped-out block may be reused in this very step)."""
        out = SwapOuts(tuple(self._swap_out_blocks), tuple(self._swap_out_slots))
        self._swap_out_blocks.clear()
        self._swap_out_slots.clear()
        return out

    # ---- queries ----------------------------------------------------------------------------

    def lookup_num_cached_tokens(self, request: CacheRequest) -> int:
        """Tokens a first `allocate` of `request` would take from the prefix cache right now (a pure query: no
        pins, no stats). 0 for a request that already holds an allocation."""
        if request.request_id in self._seqs:
            return 0
        return self._lookup(request, count=False).num_blocks * self.block_size

    def block_ids(self, request: CacheRequest) -> tuple[int, ...]:
        seq = self._seqs.get(request.request_id)
        return tuple(seq.block_ids) if seq else ()

    def num_blocks(self, request: CacheRequest) -> int:
        """Length of the request's block table (`block_ids` without the copy)."""
        seq = self._seqs.get(request.request_id)
        return len(seq.block_ids) if seq else 0

    def state_slot(self, request: CacheRequest) -> int:
        seq = self._seqs.get(request.request_id)
        return seq.running_slot if seq else 0

    def num_computed_tokens(self, request: CacheRequest) -> int:
        seq = self._seqs.get(request.request_id)
        return seq.num_computed if seq else 0

    def slot_mapping(self, request: CacheRequest, start: int, end: int) -> list[int]:
        """KV write addresses of tokens [start, end): block * block_size + offset."""
        return slot_mapping(self._seqs[request.request_id].block_ids, start, end, self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.blocks.num_free / self.blocks.num_usable

    def reset_prefix_cache(self) -> None:
        """Forget every cached block and snapshot on the GPU and in the CPU tier."""
        for pool in (self.blocks, self.slots, self.cpu_blocks, self.cpu_slots):
            if pool is not None:
                pool.reset_cache()

    def check(self) -> None:
        """Assert pool invariants and that every ref count equals what the live requests hold."""
        want = {id(p): [0] * p.num_ids for p in (self.blocks, self.slots, self.cpu_blocks, self.cpu_slots) if p}
        for seq in self._seqs.values():
            for b in seq.block_ids:
                want[id(self.blocks)][b] += 1
            if seq.running_slot:
                want[id(self.slots)][seq.running_slot] += 1
            p = seq.pending
            if p is not None:
                for s in (*p.alloc.draft_slots, p.alloc.snapshot_slot, *p.pinned_slots):
                    if s:
                        want[id(self.slots)][s] += 1
                for c in p.pinned_cpu_blocks:
                    want[id(self.cpu_blocks)][c] += 1
                for c in p.pinned_cpu_slots:
                    want[id(self.cpu_slots)][c] += 1
        for pool in (self.blocks, self.slots, self.cpu_blocks, self.cpu_slots):
            if pool is not None:
                pool.check()
                assert pool.ref_cnt == want[id(pool)], "ref counts differ from what requests hold"

    # ---- internals --------------------------------------------------------------------------

    def _extra_keys(self, request: CacheRequest) -> ExtraKeysFn | None:
        return getattr(request, "extra_keys", None)

    def _hashes(self, request: CacheRequest, seq: _Seq, num_blocks: int) -> list[int]:
        """Keys of blocks 0..num_blocks-1 (all full and known), extending the cached list."""
        if len(seq.hashes) < num_blocks:
            parent = seq.hashes[-1] if seq.hashes else None
            seq.hashes += block_hashes(request.all_token_ids, self.block_size, num_blocks, start=len(seq.hashes),
                                       parent=parent, extra_keys=self._extra_keys(request))
        return seq.hashes[:num_blocks]

    def _lookup(self, request: CacheRequest, count: bool = True) -> _Hit:
        if not self.config.enable_prefix_caching or getattr(request, "skip_prefix_cache", False):
            return _Hit()
        known = len(request.all_token_ids)
        hashes = block_hashes(request.all_token_ids, self.block_size, (known - 1) // self.block_size,
                              extra_keys=self._extra_keys(request))
        cpu_b, cpu_s = self.cpu_blocks, self.cpu_slots

        def has_kv(h: int) -> bool:
            return h in self.blocks.cached or (cpu_b is not None and h in cpu_b.cached)

        def has_state(h: int) -> bool:
            return h in self.slots.cached or (cpu_s is not None and h in cpu_s.cached)

        kv = kv_hit_blocks(hashes, has_kv)
        k = longest_hit(hashes[:kv], has_kv, has_state)
        if count:
            self.stats.queries += 1
            self.stats.query_tokens += known
            self.stats.hit_tokens += k * self.block_size
        junction = kv * self.block_size if kv > k else 0
        if k == 0:
            return _Hit(junction=junction, hashes=tuple(hashes))
        gpu = tuple(self.blocks.lookup(h) for h in hashes[:k])
        cpu = tuple(cpu_b.lookup(h) if g is None else None for g, h in zip(gpu, hashes))
        self.stats.cpu_hit_blocks += sum(g is None for g in gpu) if count else 0
        s = self.slots.lookup(hashes[k - 1])
        state = ("gpu", s) if s is not None else ("cpu", cpu_s.lookup(hashes[k - 1]))
        return _Hit(num_blocks=k, gpu=gpu, cpu=cpu, state=state, junction=junction, hashes=tuple(hashes))

    def _snapshot_points(self, request: CacheRequest, junction: int) -> list[int]:
        bs = self.block_size
        points = [(request.num_prompt_tokens - 1) // bs * bs]
        if junction:
            points.append(junction)
        return [p for p in points if p > 0]

    def _cut_at_snapshot_point(self, request: CacheRequest, computed: int, n: int, junction: int) -> int:
        """Shorten a chunk so it ends at the first snapshot point strictly inside it."""
        end = computed + n
        points = [p for p in self._snapshot_points(request, junction) if computed < p < end]
        interval = self.config.snapshot_interval
        if interval:
            nxt = (computed // interval + 1) * interval
            if nxt < end:
                points.append(nxt)
        return min(points) - computed if points else n

    def _snapshot_boundary(self, request: CacheRequest, seq: _Seq, end: int, known: int, junction: int) -> int:
        """`end` when the state after this step should be snapshotted, else 0."""
        bs = self.block_size
        if end % bs or end == 0:
            return 0
        interval = self.config.snapshot_interval
        wanted = (end < known or end in self._snapshot_points(request, junction)
                  or (interval and end % interval == 0))
        if not wanted:
            return 0
        key = self._hashes(request, seq, end // bs)[-1]
        on_cpu = self.cpu_slots is not None and key in self.cpu_slots.cached
        return 0 if key in self.slots.cached or on_cpu else end

    def _register_blocks(self, request: CacheRequest, seq: _Seq) -> None:
        num_full = seq.num_computed // self.block_size
        if num_full <= seq.num_registered:
            return
        keys = self._hashes(request, seq, num_full)
        for j in range(seq.num_registered, num_full):
            self.blocks.cache(seq.block_ids[j], keys[j])  # False: the same prefix is cached elsewhere
        seq.num_registered = num_full

    def _unpin(self, p: _Pending) -> None:
        self.slots.free_ids(p.pinned_slots)
        if p.pinned_cpu_blocks:
            self.cpu_blocks.free_ids(p.pinned_cpu_blocks)
        if p.pinned_cpu_slots:
            self.cpu_slots.free_ids(p.pinned_cpu_slots)
        p.pinned_slots, p.pinned_cpu_blocks, p.pinned_cpu_slots = [], [], []

    def _block_evicted(self, block: int, key: int) -> None:
        dst = _offload(self.cpu_blocks, key)
        if dst:
            self._swap_out_blocks.append((block, dst))
            self.stats.swapped_out_blocks += 1

    def _slot_evicted(self, slot: int, key: int) -> None:
        dst = _offload(self.cpu_slots, key)
        if dst:
            self._swap_out_slots.append((slot, dst))
            self.stats.swapped_out_slots += 1


def _offload(pool: BlockPool | None, key: int) -> int:
    """Take a CPU id for evicted content `key` and cache it there; 0 when there is no tier, the
    content is already there, or every CPU id is pinned."""
    if pool is None or key in pool.cached:
        return 0
    got = pool.allocate(1)
    if got is None:
        return 0
    pool.cache(got[0], key)
    pool.free_ids(got)  # ref 0, cached: LRU-evictable in the CPU tier
    return got[0]


def slot_mapping(block_ids: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """KV write address of each token position in [start, end): block_ids[p // bs] * bs + p % bs."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]

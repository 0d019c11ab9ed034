"""Speculative decoding with the MTP head on the paged engine (spec/engine.md §2.4, §2.8, §3).

Greedy output with speculation must equal greedy output without it, token for token, by
construction: every verify row is computed the way a single-token decode row is (token-by-token
GDN recurrence from the committed state, per-row QSA), and the recurrent state committed for the
accepted position is bitwise the state of the run without speculation. The MTP head of the tiny
model has random weights, so its drafts are mostly rejected; forced drafters (the target's own
greedy tokens, or those with draft j corrupted) exercise every accept/reject path.
"""

from __future__ import annotations

import pytest
import torch

from revolta.config import ModelConfig
from revolta.engine import Engine, EngineConfig
from revolta.model import FlashNextModel, init_random_weights
import forced_drafts
from engine_spies import record_gaps
from test_engine import Req, assert_clean, ids
from test_engine import run as run_engine
from test_paged_model import TINY

TINY_MTP = dict(TINY, mtp_num_hidden_layers=1)


@pytest.fixture(scope="module")
def model():
    m = FlashNextModel(ModelConfig.from_dict(TINY_MTP)).eval()
    init_random_weights(m, seed=11)
    return m


def assert_same_tokens(reqs, plain):
    """Token ids equal; otherwise name the first differing step and its top-1/top-2 gap without speculation."""
    for r, p in zip(reqs, plain):
        if r.token_ids != p.token_ids:
            j = next((i for i, (x, y) in enumerate(zip(r.token_ids, p.token_ids)) if x != y),
                     min(len(r.token_ids), len(p.token_ids)))
            gaps = getattr(p, "gaps", [])
            gap = gaps[j] if j < len(gaps) else float("nan")
            raise AssertionError(f"{r.request_id}: first difference at generated token {j}, top-1/top-2 logit gap "
                                 f"there without speculation {gap:.3g}: {r.token_ids} != {p.token_ids}")


def make_engine(model, spec, **kw):
    cfg = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32, block_size=16, kv_cache_gib=0.004,
               speculative_config=spec)
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg))


def run(engine, reqs, on_step=None):
    record_gaps(engine)
    return run_engine(engine, reqs, on_step=on_step)


def force_drafts(engine, refs: dict[str, list[int]], corrupt: int | None = None):
    """Replace the MTP drafts by the target's own greedy continuation (draft `corrupt` altered).
    The MTP head still runs (its K/V seeding is part of what is under test)."""
    vocab = engine.model.cfg.text.vocab_size
    forced_drafts.force_drafts(engine, refs, lambda rid, d: forced_drafts.wrong_at(d, corrupt, vocab),
                               check_count=True)


def recurrent_state(engine, slot):
    """Every committed recurrent tensor of a slot: GDN state and conv window, PLE conv and n-gram ids."""
    st = engine.storage
    return [x[slot].clone() for g in st.gdn.values() for x in (g.ssm_state, g.conv_state)] + \
        [x[slot].clone() for p in st.ple.values() for x in (p.conv, p.context_ids)]


def state_trace(engine, request_id, trace):
    """on_step hook: the request's committed state keyed by its number of computed tokens."""
    def hook(e):
        a = e.allocator
        if request_id in a._seqs and a._seqs[request_id].pending is None:
            trace[a.num_computed_tokens(type("R", (), {"request_id": request_id})())] = \
                recurrent_state(e, a._seqs[request_id].running_slot)
    return hook


def run_with_preemption_and_hits(engine, reqs):
    """Run greedily and check that the pool forced a preemption and that the prefix cache hit."""
    preempted = []
    orig = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: (preempted.append(seq.request_id), orig(seq))
    run(engine, reqs)
    assert preempted, "the pool was large enough for everything: no preemption happened"
    assert engine.allocator.stats.hit_tokens > 0, "no prefix-cache hit happened"


@pytest.mark.parametrize("drafter", ["mtp", "forced"])
@torch.no_grad()
def test_greedy_spec_equals_no_spec_8_concurrent_with_preemption_and_prefix_hits(model, drafter):
    """8 requests in a pool too small for all (preemption), half sharing a prefix (hits): the
    MTP head's own drafts, or forced drafts where request i's draft i % 5 is wrong (every
    accept length under batching)."""
    shared = ids(33, seed=77)
    prompts = [shared + ids(2 + 3 * i, seed=i) if i % 2 else ids(7 + 6 * i, seed=50 + i) for i in range(8)]
    plain = [Req(f"r{i}", p, max_tokens=6 + i // 2) for i, p in enumerate(prompts)]
    run(make_engine(model, {"method": None}, max_num_seqs=1), plain)  # one at a time, no speculation
    reqs = [Req(r.request_id, r.prompt_token_ids, r.max_tokens) for r in plain]
    engine = make_engine(model, {"method": "mtp", "num_speculative_tokens": 4}, kv_cache_gib=0.0017,
                         max_model_len=128)
    if drafter == "forced":
        refs = {r.request_id: (len(r.prompt_token_ids), r.token_ids) for r in plain}
        propose = engine.drafter.propose
        force_drafts(engine, refs)
        forced = engine.drafter.propose

        def mixed(items):  # request i: draft i % 5 wrong (4 = all right)
            out = forced(items)
            for it, d in zip(items, out):
                j = int(it.request_id[1:]) % 5
                if j < len(d):
                    d[j] = (d[j] + 1) % model.cfg.text.vocab_size
            return out

        engine.drafter.propose = mixed
        assert propose is not mixed
    run_with_preemption_and_hits(engine, reqs)
    assert engine.spec_stats.num_draft_tokens > 0
    if drafter == "forced":
        assert engine.spec_stats.num_accepted_tokens > 0
    assert_clean(engine)
    assert_same_tokens(reqs, plain)


@pytest.mark.parametrize("replay", [False, True], ids=["per-draft-slots", "replay"])
@pytest.mark.parametrize("corrupt", [None, 0, 2], ids=["accept-all", "reject-0", "reject-2"])
@torch.no_grad()
def test_forced_acceptance_commits_the_state_of_the_non_spec_run(model, corrupt, replay):
    check_forced_acceptance(model, {"method": "mtp", "num_speculative_tokens": 4, "spec_state_replay": replay},
                            corrupt, num_drafts=4, max_tokens=17)


def check_forced_acceptance(model, spec, corrupt, num_drafts, max_tokens):
    """Forced drafts (the non-spec run's tokens, draft `corrupt` wrong): the same tokens, acceptance
    exactly `corrupt` (or all) at every position, and every committed recurrent tensor bitwise the
    non-spec run's at each committed length."""
    prompt = ids(21, seed=5)
    base_trace: dict[int, list] = {}
    base = make_engine(model, {"method": None})
    plain = Req("a", prompt, max_tokens)
    run(base, [plain], state_trace(base, "a", base_trace))
    ref = plain.token_ids

    engine = make_engine(model, spec)
    assert engine.allocator.config.per_draft_state is (not engine.spec.spec_state_replay)
    force_drafts(engine, {"a": (len(prompt), ref)}, corrupt)
    trace: dict[int, list] = {}
    req = Req("a", prompt, max_tokens)
    run(engine, [req], state_trace(engine, "a", trace))
    assert req.token_ids == ref
    s = engine.spec_stats
    j = num_drafts if corrupt is None else corrupt
    assert s.num_rounds > 0
    assert s.accepted_per_position == [d if p < j else 0 for p, d in enumerate(s.drafted_per_position)], s
    assert len(trace) >= 3 and set(trace) <= set(base_trace)
    for computed, state in trace.items():  # bitwise, every committed tensor
        for x, y in zip(state, base_trace[computed]):
            assert torch.equal(x, y), f"state differs after {computed} tokens"
    assert_clean(engine)


@torch.no_grad()
def test_fewer_drafts_near_max_model_len_and_max_tokens(model):
    prompt = ids(30, seed=9)
    plain = Req("a", prompt, 10)  # prompt + 10 = max_model_len
    run(make_engine(model, {"method": None}, max_model_len=40), [plain])
    ref = plain.token_ids + [0] * 2  # drafts past the end are never verified (the count is trimmed)
    engine = make_engine(model, {"method": "mtp"}, max_model_len=40)
    force_drafts(engine, {"a": (len(prompt), ref), "b": (len(prompt), ref)})
    seen = []
    schedule = engine.scheduler.schedule

    def spy():
        items = schedule()
        for it in items:
            if it.alloc.num_lookahead_tokens:
                seen.append((it.seq.request_id, len(it.seq.all_token_ids), len(it.seq.request.token_ids),
                             it.alloc.num_lookahead_tokens))
        return items

    engine.scheduler.schedule = spy
    a, b = Req("a", prompt, 10), Req("b", prompt, 6)
    run(engine, [a, b])
    assert a.token_ids == plain.token_ids
    assert b.token_ids == plain.token_ids[:6]
    assert seen
    for rid, known, generated, drafts in seen:
        assert known + drafts + 1 <= 40 and drafts <= 4
        assert generated + drafts + 1 <= (10 if rid == "a" else 6)
    assert any(d < 4 for _, _, _, d in seen), "no request drafted fewer near its limits"
    assert_clean(engine)


@pytest.mark.parametrize("drafter", ["mtp", "forced"])
@torch.no_grad()
def test_adaptive_policy_switching_mid_generation_keeps_greedy_tokens_and_state(model, drafter):
    """The adaptive policy on a fake clock: rounds pay, then cost 100x a plain step (paused), then pay
    again (resumed at a probe). Tokens equal the run without speculation, rounds after a pause draft
    again (the plain steps kept the drafter's rows), and with one request (forced drafts: accepted ones)
    the committed recurrent state is bitwise that run's at every length (batched prefill chunks may
    differ in the last bits with speculation, policy or not)."""
    from revolta.engine.spec_policy import SpecPolicy, SpecPolicyConfig

    prompts = [ids(21, seed=5), ids(9, seed=6), ids(14, seed=7)][:3 if drafter == "mtp" else 1]
    plain = [Req(f"r{i}", p, max_tokens=(24 if drafter == "mtp" else 40) + 4 * i) for i, p in enumerate(prompts)]
    base, base_trace = make_engine(model, {"method": None}), {}
    run(base, plain, state_trace(base, "r0", base_trace))
    engine = make_engine(model, {"method": "mtp", "draft_policy": "adaptive"})
    if drafter == "forced":
        force_drafts(engine, {r.request_id: (len(r.prompt_token_ids), r.token_ids) for r in plain}, corrupt=1)
    now = [0.0]
    policy = engine.policy = SpecPolicy(SpecPolicyConfig(first_probe=2, max_interval=4, window=1, cost_window=1),
                                         lambda: now[0])
    record, steps = policy.record, []  # per recorded step: (drafted, drafts proposed in it)

    def timed_record(num_seqs, drafted, tokens):
        expensive = 8 <= len(steps) < 24  # rounds cost 100x a plain step in this stretch
        now[0] += (100.0 if expensive else 1.0) if drafted else 1.0
        drafts = engine.spec_stats.num_draft_tokens - sum(d for _, d in steps)
        steps.append((drafted, drafts))
        record(num_seqs, drafted, tokens)

    policy.record = timed_record
    reqs, trace = [Req(r.request_id, r.prompt_token_ids, r.max_tokens) for r in plain], {}
    run(engine, reqs, state_trace(engine, "r0", trace))
    assert_same_tokens(reqs, plain)
    modes = [d for d, _ in steps]
    paused_at = next(i for i in range(8, len(modes)) if not modes[i] and not modes[i - 1])
    assert any(modes[paused_at:]), "drafting never resumed"
    resumed = [i for i in range(paused_at, len(steps)) if steps[i][0] and not steps[i - 1][0]]
    assert all(steps[i][1] > 0 for i in resumed), f"a round after plain steps proposed no drafts: {steps}"
    assert engine.num_paused_steps > 0 and engine.stats().spec_paused_steps == engine.num_paused_steps
    assert len(trace) >= 10 and set(trace) <= set(base_trace)
    assert engine.spec_stats.num_accepted_tokens > 0 or drafter == "mtp"
    for computed, state in trace.items() if drafter == "forced" else ():
        assert all(torch.equal(x, y) for x, y in zip(state, base_trace[computed])), f"state differs at {computed}"
    assert_clean(engine)


@torch.no_grad()
def test_deferred_mtp_seeding_while_paused_gives_the_drafts_of_seeding_every_step(model, monkeypatch):
    """While drafting is paused, plain steps leave their rows unseeded (up to MAX_DEFERRED_ROWS) and the
    next round seeds them together: its MTP K/V, hence its drafts, are those of seeding at every step."""
    from revolta.engine.spec_policy import SpecPolicy, SpecPolicyConfig
    import revolta.spec.mtp as mtp

    def drafts_of(max_rows):
        monkeypatch.setattr(mtp, "MAX_DEFERRED_ROWS", max_rows)
        engine = make_engine(model, {"method": "mtp", "draft_policy": "adaptive"})
        now = [0.0]
        policy = engine.policy = SpecPolicy(SpecPolicyConfig(first_probe=5, max_interval=5), lambda: now[0])
        record, propose, out = policy.record, engine.drafter.propose, []

        def timed_record(num_seqs, drafted, tokens):
            now[0] += 10.0 if drafted else 1.0  # rounds never pay: a probe round every 5 plain steps
            record(num_seqs, drafted, tokens)

        def spy(items, *graphs):
            drafts = propose(items, *graphs)
            out.append([list(d) for d in drafts])
            return drafts

        policy.record, engine.drafter.propose = timed_record, spy
        run(engine, [Req(f"r{i}", ids(11 + 7 * i, seed=20 + i), max_tokens=30) for i in range(2)])
        assert engine.num_paused_steps > 20
        return [d for d in out if any(d)]

    seeded_every_step = drafts_of(1)
    deferred = drafts_of(16)
    assert len(deferred) >= 4 and deferred == seeded_every_step


def test_an_engine_goes_with_its_last_reference(model):
    """An engine (MTP on: the scheduler asks it for draft counts; the allocator's pools report evictions) and its cache
    are freed when the last reference goes, with Python's cyclic collector off: no engine <-> scheduler or allocator
    <-> pool cycle keeps the KV cache alive until a collection (which may fall inside a later engine's CUDA-graph
    capture) and a user's `del llm` frees the memory at once."""
    import gc
    import weakref

    collecting = gc.isenabled()
    gc.disable()
    try:
        engine = Engine(model, EngineConfig(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                                            block_size=16, kv_cache_gib=0.002,
                                            speculative_config={"method": "mtp", "num_speculative_tokens": 2}))
        run_engine(engine, [Req("a", ids(20, 1), 6), Req("b", ids(9, 2), 6)])
        assert engine.spec_stats.num_rounds > 0
        refs = [weakref.ref(o) for o in (engine, engine.scheduler, engine.allocator, engine.allocator.blocks)]
        del engine
        alive = [type(r()).__name__ for r in refs if r() is not None]
        assert not alive, f"still alive without a garbage collection: {alive}"
    finally:
        if collecting:
            gc.enable()

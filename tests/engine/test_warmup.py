"""The start-up warm-up (engine/warmup.py): every row count a speculative round verifies runs once, then the engine is
as it was (no request, clean pools, no cached prefix, zeroed speculation counters, a fresh adaptive policy), and what
it generates afterwards equals a fresh engine's."""

from __future__ import annotations

import pytest

from revolta.engine.spec_policy import SpecPolicy
from test_engine import Req, assert_clean, ids
from test_engine import run as run_engine
from test_spec_engine import make_engine, model  # noqa: F401  (the tiny model with an MTP head)

MTP4 = {"method": "mtp", "num_speculative_tokens": 4}


def _spy_rounds(engine) -> list[tuple[int, ...]]:
    """The drafts of each verify row group the executor runs (one tuple per step)."""
    seen, execute = [], engine.executor.execute

    def spy(step):
        seen.append(tuple(it.num_drafts for it in step.items if it.verify))
        return execute(step)

    engine.executor.execute = spy
    return seen


@pytest.mark.parametrize("spec", [MTP4, {"method": None}], ids=["mtp4", "plain"])
def test_warm_up_runs_every_row_count_then_leaves_the_engine_as_it_was(model, spec):
    engine = make_engine(model, spec)
    seen = _spy_rounds(engine)
    report = engine.warm_up()
    k = 4 if spec["method"] else 0
    assert report.requests == k + 1 and report.verify_rows == (tuple(range(1, k + 2)) if k else ())
    verified = sorted({d for step in seen for d in step})
    assert verified == (list(range(k + 1)) if k else [])  # rounds of 0 .. k drafts: 1 .. k + 1 rows
    assert not engine.has_unfinished()
    assert_clean(engine)
    assert not engine.allocator.blocks.cached and not engine.allocator.slots.cached  # no warm-up prefix stays cached
    assert engine.spec_stats.num_rounds == 0 and engine.stats().num_running == 0
    # generation afterwards equals a fresh engine's, token for token
    prompts = [ids(11, 1), ids(23, 2)]
    warm = [Req(f"r{i}", p, 9) for i, p in enumerate(prompts)]
    run_engine(engine, warm)
    fresh_engine = make_engine(model, spec)
    fresh = [Req(f"r{i}", p, 9) for i, p in enumerate(prompts)]
    run_engine(fresh_engine, fresh)
    assert [r.token_ids for r in warm] == [r.token_ids for r in fresh]
    assert engine.spec_stats.num_rounds == fresh_engine.spec_stats.num_rounds


def test_warm_up_drafts_every_round_under_the_adaptive_policy_and_leaves_a_fresh_one(model):
    engine = make_engine(model, dict(MTP4, draft_policy="adaptive"))
    assert isinstance(engine.policy, SpecPolicy)
    old = engine.policy
    seen = _spy_rounds(engine)
    engine.warm_up()
    assert sorted({d for step in seen for d in step}) == [0, 1, 2, 3, 4]
    assert engine.policy is not old and isinstance(engine.policy, SpecPolicy) and not engine.policy.buckets
    assert engine.policy.config == old.config and engine.num_paused_steps == 0


def test_warm_up_refuses_an_engine_with_requests_in_flight(model):
    engine = make_engine(model, MTP4)
    engine.add_request(Req("busy", ids(12, 3), 4))
    with pytest.raises(RuntimeError, match="before the first request"):
        engine.warm_up()
    run_engine(engine, [])
    assert_clean(engine)

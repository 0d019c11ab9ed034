"""Async scheduling (engine/async_step.py): a plain decode step launches before the host reads the previous step's
tokens. Outputs must equal a synchronous engine's (greedy and seeded sampling), requests that stop, are aborted or
arrive while a step is in flight must not disturb the others, and nothing may leak. Every test also checks that the
asynchronous path ran (steps launched, and steps planned on unread tokens), so none passes by running synchronously.
"""

from __future__ import annotations

import pytest
import torch

from revolta.config import ModelConfig
from revolta.engine import Engine, EngineConfig, Request
from revolta.engine.sampling import SamplingParams, make_generator
from revolta.engine.token_view import PLACEHOLDER_ID, TokenView
from revolta.model import FlashNextModel, init_random_weights
from test_paged_model import TINY, ids  # noqa: F401  (the tiny config and id helper)


@pytest.fixture(scope="module")
def model():
    m = FlashNextModel(ModelConfig.from_dict(TINY)).eval()
    init_random_weights(m, seed=11)
    return m


def make_engine(model, async_scheduling: bool, **kw) -> Engine:
    cfg = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, block_size=16, kv_cache_gib=0.002,
               async_scheduling=async_scheduling)
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg))


def request(rid: str, prompt: list[int], max_tokens: int, **params) -> Request:
    p = SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True, **params})
    return Request(rid, list(prompt), p, generator=None if p.greedy else make_generator(p.seed))


def drive(engine: Engine, reqs: list[Request], on_step=None, late: dict[int, list[Request]] | None = None) -> list:
    """Step until done; `late` adds requests at a step number; on_step(engine, step) runs after each step.
    Returns every step's returned requests (by id)."""
    for r in reqs:
        engine.add_request(r)
    returned, steps = [], 0
    late = dict(late or {})
    while engine.has_unfinished() or late:
        for r in late.pop(steps, []):
            engine.add_request(r)
        returned.append([r.request_id for r in engine.step()])
        steps += 1
        if on_step is not None:
            on_step(engine, steps)
        assert steps < 2000, "the engine stopped making progress"
    return returned


def assert_clean(engine: Engine) -> None:
    engine.step()  # lands a step left in flight with only ended requests' rows
    a = engine.allocator
    a.check()
    assert not a._seqs, "requests still hold cache"
    assert a.blocks.num_free == a.config.num_blocks - 1
    assert a.slots.num_free == a.config.num_slots - 1


def outputs(reqs: list[Request]) -> list[tuple]:
    return [(r.request_id, r.token_ids, r.finish_reason, r.stop_reason) for r in reqs]


def twin_runs(model, make_reqs, **kw):
    """The same requests through a synchronous and an asynchronous engine -> (sync reqs, async reqs, async engine)."""
    sync_reqs, async_reqs = make_reqs(), make_reqs()
    drive(make_engine(model, False, **kw), sync_reqs)
    engine = make_engine(model, True, **kw)
    drive(engine, async_reqs)
    return sync_reqs, async_reqs, engine


def test_token_view_placeholders():
    view = TokenView([1, 2], [3], num_placeholders=1)
    assert len(view) == 4 and view[3] == PLACEHOLDER_ID and view[-1] == PLACEHOLDER_ID
    assert view[2:4] == [3, PLACEHOLDER_ID] and view[3:4] == [PLACEHOLDER_ID] and view[0:2] == [1, 2]
    assert list(view) == [1, 2, 3, PLACEHOLDER_ID]
    with pytest.raises(IndexError):
        view[4]


@torch.no_grad()
def test_greedy_requests_equal_a_synchronous_engine(model):
    def reqs():
        return [request(f"g{i}", ids(n, seed=n), max_tokens=5 + 3 * i) for i, n in enumerate((4, 19, 37, 9))]

    sync_reqs, async_reqs, engine = twin_runs(model, reqs)
    assert outputs(async_reqs) == outputs(sync_reqs)
    # after the prefills one launch, then every step planned on unread tokens, through three requests' last tokens
    # (the batch shrinks: the next step's input ids are gathered from the rows left)
    assert engine.num_chained_steps >= 10, (engine.num_async_steps, engine.num_chained_steps)
    assert engine.num_async_steps - engine.num_chained_steps == 1, (engine.num_async_steps, engine.num_chained_steps)
    assert_clean(engine)


@torch.no_grad()
def test_seeded_sampling_equals_a_synchronous_engine(model):
    def reqs():
        return [request(f"s{i}", ids(7 + i, seed=40 + i), max_tokens=12, temperature=0.9, top_p=0.9, top_k=50,
                        seed=123 + i) for i in range(3)]

    sync_reqs, async_reqs, engine = twin_runs(model, reqs)
    assert outputs(async_reqs) == outputs(sync_reqs)
    assert engine.num_chained_steps >= 8
    assert_clean(engine)


@torch.no_grad()
def test_a_request_that_stops_in_flight_leaves_the_next_step(model):
    """A stop token sampled by a step whose successor was already planned: the request ends with that token, its row
    of the successor is dropped, its cache freed; the others go on as in a synchronous engine."""
    probe = [request(f"p{i}", ids(11, seed=60 + i), max_tokens=16) for i in range(3)]
    drive(make_engine(model, False), probe)
    stop = probe[1].token_ids[6]  # r1 stops at its 7th token (or earlier, where that id came up before)

    def reqs():
        return [request(f"p{i}", ids(11, seed=60 + i), max_tokens=16, **({"stop_token_ids": [stop]} if i == 1 else {}))
                for i in range(3)]

    sync_reqs, async_reqs = reqs(), reqs()
    drive(make_engine(model, False), sync_reqs)
    engine = make_engine(model, True)
    dropped, land = [], engine._land

    def spy(step, successor=None):  # rows dropped from an already launched successor
        out = land(step, successor)
        dropped.append(sorted(successor.dropped) if successor is not None else [])
        return out

    engine._land = spy
    drive(engine, async_reqs)
    assert outputs(async_reqs) == outputs(sync_reqs)
    assert async_reqs[1].stop_reason == stop and len(async_reqs[1].token_ids) <= 7
    assert [1] in dropped, "r1 did not stop in a step with a launched successor: the test lost its point"
    assert engine.num_chained_steps >= 8
    assert_clean(engine)


@torch.no_grad()
def test_abort_and_late_arrivals_while_a_step_is_in_flight(model):
    def reqs():
        return [request(f"a{i}", ids(9, seed=80 + i), max_tokens=14) for i in range(3)]

    def late():
        return {6: [request("late", ids(23, seed=99), max_tokens=6)]}

    in_flight_at_abort = []

    def abort_a1(engine, step):
        if step == 5:
            in_flight_at_abort.append(engine._inflight is not None and engine._inflight.row_of("a1") is not None)
            engine.abort("a1")

    sync_reqs, sync_late = reqs(), late()
    drive(make_engine(model, False), sync_reqs, on_step=abort_a1, late=sync_late)
    engine = make_engine(model, True)
    async_reqs, async_late = reqs(), late()
    drive(engine, async_reqs, on_step=abort_a1, late=async_late)
    assert in_flight_at_abort[-1], "a1 was not in a step in flight when it was aborted: the test lost its point"
    keep = [0, 2]  # greedy tokens do not depend on the batch (the torch path is row-invariant)
    assert outputs([async_reqs[i] for i in keep]) == outputs([sync_reqs[i] for i in keep])
    assert outputs(async_late[6]) == outputs(sync_late[6])
    assert len(async_reqs[1].token_ids) < 14
    assert engine.num_chained_steps >= 5
    assert_clean(engine)


@torch.no_grad()
def test_penalties_logit_bias_and_min_tokens_run_asynchronously(model):
    """Penalties, logit_bias and min_tokens adjust the logits from the output so far: in a chained step the host has
    not read the previous step's token, which the penalties count on the device (the step's input id), and
    min_tokens counts as generated. Greedy and seeded tokens equal a synchronous engine's, and the steps chained."""
    def reqs():
        probe = [request("p", ids(8, seed=6), max_tokens=12)]
        drive(make_engine(model, False), probe)
        often = max(set(probe[0].token_ids), key=probe[0].token_ids.count)  # the token repetition would repeat
        return [request("plain", ids(8, seed=5), max_tokens=16),
                request("rep", ids(8, seed=6), max_tokens=12, repetition_penalty=1.8),
                request("freq", ids(8, seed=6), max_tokens=12, frequency_penalty=1.5, presence_penalty=0.5),
                request("bias", ids(8, seed=7), max_tokens=10, logit_bias={often: 4.0, 5: -2.0}),
                # the stop id is masked for exactly 6 tokens, then its bias makes it the 7th: a chained step must
                # count the unread 6th token, or the mask holds a step longer
                request("min", ids(8, seed=6), max_tokens=12, min_tokens=6, stop_token_ids=[7], logit_bias={7: 100.0}),
                request("seeded", ids(9, seed=8), max_tokens=12, temperature=0.9, seed=4, frequency_penalty=1.0)]

    sync_reqs, async_reqs, engine = twin_runs(model, reqs)
    assert outputs(async_reqs) == outputs(sync_reqs)
    plain_sync = [request("rep", ids(8, seed=6), max_tokens=12)]
    drive(make_engine(model, False), plain_sync)
    assert async_reqs[1].token_ids != plain_sync[0].token_ids, "the repetition penalty changed nothing: no test"
    assert len(async_reqs[4].token_ids) == 7 and async_reqs[4].stop_reason == 7
    assert engine.num_chained_steps >= 8
    assert_clean(engine)


def test_only_grammars_keep_a_request_synchronous():
    """plain_request: grammar-constrained requests decide their bitmask from the tokens the host has read; the logit
    adjustments do not stop a request from running asynchronously."""
    from revolta.engine.async_step import plain_request

    adjusted = request("adj", [1, 2], 4, repetition_penalty=1.2, logit_bias={3: 1.0}, min_tokens=2)
    assert plain_request(adjusted) and plain_request(request("plain", [1, 2], 4))
    constrained = request("grammar", [1, 2], 4)
    constrained.constraint = object()  # any constraint
    assert not plain_request(constrained)


@torch.no_grad()
def test_logprobs_are_read_with_the_tokens(model):
    """Logprobs of an asynchronous step are computed on the device and read with its tokens: the entries (chosen
    token, rank, top alternatives) and the cumulative logprob equal a synchronous engine's."""
    def reqs():
        return [request("lp2", ids(8, seed=7), max_tokens=9, logprobs=2),
                request("plain", ids(12, seed=8), max_tokens=12),
                request("lp0", ids(5, seed=9), max_tokens=7, logprobs=0, temperature=0.7, seed=3)]

    sync_reqs, async_reqs, engine = twin_runs(model, reqs)
    assert outputs(async_reqs) == outputs(sync_reqs)
    for a, s in zip(async_reqs, sync_reqs):
        assert a.logprobs == s.logprobs and a.cumulative_logprob == s.cumulative_logprob, a.request_id
    assert len(async_reqs[0].logprobs) == 9 and all(len(e) in (2, 3) for e in async_reqs[0].logprobs)
    assert engine.num_chained_steps >= 8
    assert_clean(engine)


@torch.no_grad()
def test_each_request_is_returned_once_a_step(model):
    """A landed step and a synchronous step in one call (a request arrived): no request is listed twice."""
    engine = make_engine(model, True)
    returned = drive(engine, [request("x", ids(6, seed=1), max_tokens=10)],
                     late={4: [request("y", ids(3, seed=2), max_tokens=4)]})
    assert all(len(step) == len(set(step)) for step in returned), returned
    assert engine.num_chained_steps >= 3
    assert_clean(engine)


def test_async_scheduling_must_be_a_bool():
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(max_model_len=64, async_scheduling="yes")


def test_speculation_says_async_scheduling_does_not_apply(model, caplog):
    with_mtp = FlashNextModel(ModelConfig.from_dict(dict(TINY, mtp_num_hidden_layers=1))).eval()
    init_random_weights(with_mtp, seed=3)
    with caplog.at_level("WARNING", logger="revolta.engine.engine"):
        make_engine(with_mtp, True, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert "every step runs synchronously" in caplog.text and "speculative_config={'method': None}" in caplog.text

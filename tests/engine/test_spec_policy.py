"""The adaptive drafting policy (engine/spec_policy.py) on a fake clock: it pauses drafting where rounds
cost more than they emit, keeps it where they pay, probes the other mode with a doubling interval, and
keeps each batch-size bucket apart."""

from __future__ import annotations

import logging

import pytest

from revolta.engine.spec_policy import SpecPolicy, SpecPolicyConfig, bucket_of


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(policy: SpecPolicy, clock: FakeClock, steps: int, num_seqs: int, round_s: float, plain_s: float,
        accept: float) -> list[bool]:
    """`steps` decode steps of num_seqs requests: a round costs round_s and emits `accept` tokens per
    request, a plain step costs plain_s. Returns whether each step drafted."""
    modes = []
    for _ in range(steps):
        drafted = policy.should_draft(num_seqs)
        clock.now += round_s if drafted else plain_s
        policy.record(num_seqs, drafted, round(accept * num_seqs) if drafted else num_seqs)
        modes.append(drafted)
    return modes


def test_a_losing_round_is_paused_after_one_round_and_probed_with_a_doubling_interval(caplog):
    clock = FakeClock()
    policy = SpecPolicy(SpecPolicyConfig(first_probe=4, max_interval=16), clock)
    with caplog.at_level(logging.INFO, logger="revolta.engine.spec_policy"):
        modes = run(policy, clock, 60, 1, round_s=4.0, plain_s=1.0, accept=1.0)
    # warmup round, plain probe -> paused; probes after 4, 8, 16, 16, ... plain steps
    rounds = [i for i, m in enumerate(modes) if m]
    assert rounds == [0, 6, 15, 32, 49]
    assert policy.paused and policy.estimated_speedup() == pytest.approx(0.25)
    assert "paused at batch size bucket 1" in caplog.text and "estimated 0.25x" in caplog.text
    assert "resumed" not in caplog.text


def test_a_paying_round_keeps_drafting_with_rare_plain_probes():
    clock = FakeClock()
    policy = SpecPolicy(SpecPolicyConfig(first_probe=4, max_interval=8), clock)
    modes = run(policy, clock, 40, 2, round_s=2.0, plain_s=1.0, accept=3.0)
    plain = [i for i, m in enumerate(modes) if not m]
    assert plain == [1, 6, 15, 24, 33]  # the first probe, then after 4, 8, 8, 8 rounds
    assert not policy.paused and policy.estimated_speedup() == pytest.approx(1.5)


def test_drafting_resumes_when_acceptance_rises_and_pauses_again_when_it_falls(caplog):
    clock = FakeClock()
    policy = SpecPolicy(SpecPolicyConfig(first_probe=2, max_interval=4, window=2), clock)
    run(policy, clock, 10, 1, round_s=2.0, plain_s=1.0, accept=1.0)
    assert policy.paused
    with caplog.at_level(logging.INFO, logger="revolta.engine.spec_policy"):
        run(policy, clock, 12, 1, round_s=2.0, plain_s=1.0, accept=4.0)  # the next probes see 4 tokens a round
        assert not policy.paused and "resumed" in caplog.text
        run(policy, clock, 12, 1, round_s=2.0, plain_s=1.0, accept=1.0)
    assert policy.paused


def test_a_slow_first_round_pauses_only_until_the_first_probe():
    """One-time costs (and other processes) only slow steps down: the least cost of the window counts."""
    clock = FakeClock()
    policy = SpecPolicy(SpecPolicyConfig(first_probe=4), clock)
    run(policy, clock, 1, 1, round_s=20.0, plain_s=1.0, accept=3.0)  # the first round: 20x a plain step
    run(policy, clock, 2, 1, round_s=2.0, plain_s=1.0, accept=3.0)
    assert policy.paused and policy.estimated_speedup() == pytest.approx(3 / 20)
    modes = run(policy, clock, 10, 1, round_s=2.0, plain_s=1.0, accept=3.0)
    assert modes[:5] == [False, False, False, True, True] and not policy.paused  # the probe after 4 steps resumes
    assert policy.estimated_speedup() == pytest.approx(1.5)


def test_buckets_decide_apart():
    clock = FakeClock()
    policy = SpecPolicy(SpecPolicyConfig(first_probe=4), clock)
    run(policy, clock, 5, 1, round_s=2.0, plain_s=1.0, accept=4.0)  # pays at 1 request
    run(policy, clock, 5, 16, round_s=8.0, plain_s=1.0, accept=2.0)  # loses at 16
    assert policy.should_draft(1) and not policy.should_draft(9)
    assert [bucket_of(n) for n in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]


def test_config_checks():
    with pytest.raises(ValueError, match="first_probe=0"):
        SpecPolicyConfig(first_probe=0)


def test_a_busy_stretch_does_not_resume_losing_rounds():
    """Other processes slow every plain step of a stretch 10x and spare one probe round: the least plain
    cost of the long cost window still remembers the quiet steps."""
    clock = FakeClock()
    policy = SpecPolicy(SpecPolicyConfig(first_probe=4, max_interval=4), clock)
    run(policy, clock, 10, 1, round_s=4.0, plain_s=1.0, accept=1.0)
    assert policy.paused
    modes = run(policy, clock, 20, 1, round_s=4.0, plain_s=10.0, accept=1.0)  # rounds look cheap next to these
    assert policy.paused and modes.count(True) == 4  # one probe per 4 plain steps, none resumed

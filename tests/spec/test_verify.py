"""The acceptance rule (spec/engine.md §2.4): greedy longest prefix + bonus, and rejection sampling
that reproduces the target distribution exactly (chi-square on a small vocabulary, fixed seeds)."""

from __future__ import annotations

import pytest
import torch

from revolta.spec.config import SpeculativeConfig
from revolta.spec.stats import SpecStats
from revolta.spec.verify import greedy_accept, rejection_sample

CHI2_DF5_P001 = 20.515  # chi-square critical value, 5 degrees of freedom, p = 0.001


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = float(counts.sum())
    expected = probs.double() * n
    return float(((counts.double() - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("target, drafts, emitted", [
    ([5, 6, 7], [5, 6], [5, 6, 7]),  # all accepted: bonus from the last row
    ([5, 9, 7], [5, 6], [5, 9]),  # reject draft 2: the target's token there, then stop
    ([4, 6, 7], [5, 6], [4]),  # reject the first
    ([3], [], [3]),  # no drafts: plain decoding
])
def test_greedy_accept(target, drafts, emitted):
    assert greedy_accept(target, drafts) == emitted


def test_greedy_accept_checks_row_count():
    with pytest.raises(ValueError, match="2 drafts need 3 target rows"):
        greedy_accept([1, 2], [1, 2])


def _dist(gen, V=6):
    return torch.softmax(torch.randn(V, generator=gen) * 1.5, dim=-1)


@pytest.mark.parametrize("one_hot,sparse", [(False, False), (False, True), (True, False)],
                         ids=["sampled-drafts", "sparse-q-drafts", "greedy-drafts"])
def test_rejection_sampling_reproduces_the_target_distribution(one_hot, sparse):
    """First emitted token ~ p_0 and, given it, the second ~ p_1 (when the first draft was
    accepted) or the chain stops; drafts drawn from q (dense, or sparse on a few candidates as
    DFlash2's selector proposes), or q's argmax for greedy drafting."""
    gen = torch.Generator().manual_seed(0)
    p = torch.stack([_dist(gen), _dist(gen), _dist(gen)])  # [3, V] target rows
    q = torch.stack([_dist(gen), _dist(gen)])  # [2, V] draft distributions
    if sparse:  # DFlash2's selector: q lives on K = 3 candidates, zero elsewhere
        keep = q.topk(3, dim=-1).indices
        q = torch.zeros_like(q).scatter_(-1, keep, q.gather(-1, keep))
        q = q / q.sum(-1, keepdim=True)
    trials = 6000
    first = torch.zeros(6)
    second = torch.zeros(6)  # second token when the first equals draft token x0 = argmax q_0
    x0 = int(q[0].argmax())
    draw = torch.Generator().manual_seed(1)
    for _ in range(trials):
        if one_hot:
            d = [int(q[0].argmax()), int(q[1].argmax())]
            out = rejection_sample(p, d, None, draw)
        else:
            d = [int(torch.multinomial(q[0], 1, generator=draw)), int(torch.multinomial(q[1], 1, generator=draw))]
            out = rejection_sample(p, d, q, draw)
        assert 1 <= len(out) <= 3 and out[:-1] == d[:len(out) - 1]
        first[out[0]] += 1
        if out[0] == x0 and len(out) >= 2:
            second[out[1]] += 1
    assert chi2(first, p[0]) < CHI2_DF5_P001, (first / trials, p[0])
    if one_hot:  # the second token, given the first accepted, ~ p_1
        assert chi2(second, p[1]) < CHI2_DF5_P001, (second / second.sum(), p[1])


def test_rejection_sampling_accepts_what_the_target_would_always_pick():
    p = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert rejection_sample(p, [1], None, torch.Generator().manual_seed(0)) == [1, 0]
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(p, [1, 2], None, None)


def test_stats():
    s = SpecStats()
    s.record(4, 2)
    s.record(4, 4)
    s.record(2, 0)
    assert s.num_rounds == 3 and s.num_draft_tokens == 10 and s.num_accepted_tokens == 6
    assert s.accepted_per_position == [2, 2, 1, 1] and s.drafted_per_position == [3, 3, 2, 2]
    assert s.acceptance_length == pytest.approx(3.0) and s.acceptance_rate == pytest.approx(0.6)
    assert s.per_position_rates == pytest.approx([2 / 3, 2 / 3, 0.5, 0.5])
    total = SpecStats()
    total.merge(s)
    total.merge(s)
    assert total.num_accepted_tokens == 12 and total.accepted_per_position == [4, 4, 2, 2]
    with pytest.raises(ValueError):
        s.record(2, 3)


def test_config_resolution():
    assert SpeculativeConfig.resolve(None, has_mtp=True, env={}) == SpeculativeConfig("mtp", 4)  # MTP4 by default
    assert SpeculativeConfig.resolve(None, has_mtp=True, env={}).draft_policy == "adaptive"
    assert SpeculativeConfig.resolve({"draft_policy": "always"}, has_mtp=True).draft_policy == "always"
    with pytest.raises(ValueError, match="draft_policy='sometimes'"):
        SpeculativeConfig.resolve({"draft_policy": "sometimes"}, has_mtp=True)
    assert not SpeculativeConfig.resolve(None, has_mtp=False).enabled
    assert not SpeculativeConfig.resolve({"method": None}, has_mtp=True).enabled
    c = SpeculativeConfig.resolve({"method": "mtp", "num_speculative_tokens": 2, "spec_state_replay": True}, True)
    assert (c.num_speculative_tokens, c.spec_state_replay) == (2, True)
    assert SpeculativeConfig.resolve(c, True) == c
    for raw, msg in [({"method": "eagle"}, "not supported"), ({"method": "dflash"}, "needs .model."),
                     ({"num_speculative_tokens": 0}, r"\[1, 8\]"),
                     ({"method": "mtp", "typo": 1}, "unknown keys"), ({"spec_state_replay": "yes"}, "true or false"),
                     ({"draft_sample_method": "probabilistic"}, "not validated"), ("mtp", "must be a dict")]:
        with pytest.raises(ValueError, match=msg):
            SpeculativeConfig.resolve(raw, has_mtp=True)
    with pytest.raises(ValueError, match="has none"):
        SpeculativeConfig.resolve({"method": "mtp"}, has_mtp=False)


@pytest.mark.parametrize("agree", [0, 1, 2])
def test_greedy_drafts_emit_the_tokens_plain_sampling_draws(agree):
    """With one-hot drafts, a round emits exactly what plain decoding draws from the same rows with the same
    generator (one exponential race per emitted token) and leaves the generator where plain decoding would: a
    seeded request's tokens do not depend on whether (or how often) the engine drafted."""
    gen = torch.Generator().manual_seed(5)
    p = torch.stack([_dist(gen, V=50) for _ in range(3)])  # [3, V]: two drafts, then the bonus row
    plain_gen = torch.Generator().manual_seed(9)
    plain = [int((p[j] / torch.empty(50).exponential_(generator=plain_gen)).argmax()) for j in range(3)]
    drafts = plain[:agree] + [(plain[agree] + 1) % 50] * (2 - agree)  # the first `agree` drafts match
    round_gen = torch.Generator().manual_seed(9)
    out = rejection_sample(p, drafts, None, round_gen)
    assert out == plain[:agree + 1]
    plain_gen = torch.Generator().manual_seed(9)
    for _ in out:
        torch.empty(50).exponential_(generator=plain_gen)
    assert torch.equal(round_gen.get_state(), plain_gen.get_state())


def test_greedy_draft_verification_draws_what_plain_decoding_draws():
    """With greedy drafts each emitted token uses the noise plain decoding gives its position (one draw per row),
    so a seeded request's tokens do not depend on whether (or how far) the adaptive policy drafted."""
    from revolta.engine.sampling import Sampler, SamplingParams, make_generator

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3)) * 3  # [3, V] target rows
    params = SamplingParams(temperature=0.9, seed=7)
    gen = make_generator(7)
    plain = [int(Sampler()(logits[i:i + 1], [params], [gen])) for i in range(3)]
    probs = Sampler.probs(logits, [params] * 3)
    assert rejection_sample(probs, plain[:2], None, make_generator(7)) == plain  # both drafts right: + bonus
    wrong = (plain[1] + 1) % 50
    assert rejection_sample(probs, [plain[0], wrong], None, make_generator(7)) == plain[:2]  # 2nd rejected
    assert rejection_sample(probs[:1], [], None, make_generator(7)) == plain[:1]  # no drafts: plain decoding


def test_a_bad_draft_policy_names_where_it_came_from():
    """A bad REVOLTA_SPEC_DRAFT_POLICY is reported as that variable, not as a speculative_config key never set."""
    with pytest.raises(ValueError, match="REVOLTA_SPEC_DRAFT_POLICY='bogus'"):
        SpeculativeConfig.resolve({"method": "mtp"}, True, env={"REVOLTA_SPEC_DRAFT_POLICY": "bogus"})
    with pytest.raises(ValueError, match="speculative_config draft_policy='never'"):
        SpeculativeConfig.resolve({"method": "mtp", "draft_policy": "never"}, True, env={})

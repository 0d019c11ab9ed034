"""Sampling kernel (revolta.kernels.sample): greedy, seeded reproducibility, support, distribution."""

import pytest
import torch

from revolta.kernels import sample as K
from revolta.engine.sampling import Sampler, SamplingParams


pytestmark = pytest.mark.usefixtures("poison")  # tests/kernels/conftest.py


def _params(N, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    f = lambda v: torch.full((N,), float(v))  # noqa: E731
    return f(temperature), torch.full((N,), int(top_k), dtype=torch.int32), f(top_p), f(min_p)


def test_greedy_exact():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 1000, generator=g)
    logits[3, 17] = logits[3, 900] = 50.0  # tie: the first maximum wins, as torch.argmax
    assert torch.equal(K.greedy(logits), logits.argmax(-1))
    t, k, p, mp = _params(9, temperature=0.0, top_k=5, top_p=0.5)
    seeds = torch.arange(9, dtype=torch.int64)
    assert torch.equal(K.sample_from_logits(logits, t, k, p, mp, seeds, seeds), logits.argmax(-1))


def test_matches_ref_and_reproducible_independent_of_batch():
    g = torch.Generator().manual_seed(1)
    N, V = 8, 300
    logits = torch.randn(N, V, generator=g) * 2
    temp = torch.tensor([0.0, 1.0, 0.7, 1.3, 1.0, 1.0, 2.0, 0.5])
    top_k = torch.tensor([0, 5, 0, 20, 1, 300, 50, 0], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 0.8, 0.9, 1.0, 0.5, 0.95, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.05])
    seeds = torch.arange(N, dtype=torch.int64) * 1000 + 7
    offsets = torch.arange(N, dtype=torch.int64) * 3 + (1 << 33)
    ids = K.sample_from_logits(logits, temp, top_k, top_p, min_p, seeds, offsets)
    assert torch.equal(ids, K.sample_from_logits_ref(logits, temp, top_k, top_p, min_p, seeds, offsets))
    # each row alone, and the batch reversed: the same tokens
    for i in (1, 3, 6):
        sl = slice(i, i + 1)
        one = K.sample_from_logits(logits[sl], temp[sl], top_k[sl], top_p[sl], min_p[sl], seeds[sl], offsets[sl])
        assert one.item() == ids[i].item()
    rev = lambda t: t.flip(0).contiguous()  # noqa: E731
    ids_rev = K.sample_from_logits(rev(logits), rev(temp), rev(top_k), rev(top_p), rev(min_p), rev(seeds), rev(offsets))
    assert torch.equal(ids_rev.flip(0), ids)


def test_probs_ref_matches_sampler():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 50, generator=g)
    params = [SamplingParams(temperature=0.8, top_k=7), SamplingParams(top_p=0.6),
              SamplingParams(temperature=1.5, top_k=20, top_p=0.9, min_p=0.05), SamplingParams(min_p=0.2)]
    ref = Sampler.probs(logits, params)
    mine = K.sampling_probs_ref(logits, torch.tensor([p.temperature for p in params]),
                                torch.tensor([p.top_k for p in params], dtype=torch.int32),
                                torch.tensor([p.top_p for p in params]), torch.tensor([p.min_p for p in params]))
    torch.testing.assert_close(mine, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0.0), (4, 1.0, 0.0), (0, 0.7, 0.0), (6, 0.8, 0.1)])
def test_distribution_and_support(top_k, top_p, min_p):
    """The kernel draws exactly the reference's tokens (checked on a few dozen steps, the interpreter is
    slow), never outside the support; the reference's empirical distribution over 20000 steps of one
    seeded request matches the target probabilities (chi-square)."""
    V = 12
    logits = torch.linspace(-2.0, 1.5, V)[torch.randperm(V, generator=torch.Generator().manual_seed(3))]
    probs = K.sampling_probs_ref(logits[None], *_params(1, 1.0, top_k, top_p, min_p))[0]
    keep = probs > 0
    for N, use_kernel in ((24, True), (20000, False)):
        rows = logits.expand(N, V).contiguous()
        seeds = torch.full((N,), 1234, dtype=torch.int64)
        offsets = torch.arange(N, dtype=torch.int64)  # N steps of one request
        ids_ref = K.sample_from_logits_ref(rows, *_params(N, 1.0, top_k, top_p, min_p), seeds, offsets)
        if use_kernel:
            ids = K.sample_from_logits(rows, *_params(N, 1.0, top_k, top_p, min_p), seeds, offsets)
            assert torch.equal(ids, ids_ref)
        counts = torch.bincount(ids_ref, minlength=V).float()
        assert (counts[~keep] == 0).all(), "sampled outside the top-k / top-p / min-p support"
    expected = probs[keep] * N
    chi2 = ((counts[keep] - expected) ** 2 / expected).sum().item()
    # chi-square with (support - 1) <= 11 dof: the 99.9% quantile is 31.3
    assert chi2 < 31.3, (chi2, counts, expected)

"""StepSampler.verify on hand-made logits: the plain greedy requests' rows share one argmax (one launch and one host
sync a round), and every request keeps what it would alone: a penalised greedy request its penalties."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from revolta.engine import Request
from revolta.engine.sample_step import StepSampler
from revolta.engine.sampling import SamplingParams


class _CountArgmax(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.__name__.startswith("argmax")
        return func(*args, **(kwargs or {}))


def _rows(*tokens: int, vocab: int = 8) -> torch.Tensor:
    """One logits row per token, that token the largest (2.0), token 0 second (1.5)."""
    x = torch.zeros(len(tokens), vocab)
    x[:, 0] = 1.5
    x[torch.arange(len(tokens)), torch.tensor(tokens)] = 2.0
    return x


def test_verify_shares_one_argmax_and_keeps_each_request_s_own_rules():
    sampler = StepSampler(frozenset({7}), 8)
    plain = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    penalised = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=2.0)
    reqs = [Request("a", [1], plain), Request("b", [3], penalised), Request("c", [1], plain)]
    drafts = [[4, 5], [3, 6], [2]]
    # a: rows say 4, 5, 6: both drafts accepted, then 6. b: rows say 3, 6, 1, but 3 is its prompt token, penalised
    # (2.0 / 2 = 1.0 < 1.5): token 0 instead, the first draft rejected. c: rows say 1, 2: its draft 2 rejected
    logits = torch.cat([_rows(4, 5, 6), _rows(3, 6, 1), _rows(1, 2)])
    with _CountArgmax() as count:
        accepted = sampler.verify(reqs, logits, drafts)
    assert accepted == [2, 0, 0]
    assert [r.token_ids for r in reqs] == [[4, 5, 6], [0], [1]]
    assert count.n == 2  # the two plain requests' rows in one argmax, the penalised request's own

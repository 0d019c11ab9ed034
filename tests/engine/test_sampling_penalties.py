"""Presence / frequency / repetition penalties and min_tokens (vLLM semantics) on hand-made logits."""

import pytest
import torch

from revolta.engine.sampling import SamplingParams, apply_penalties


def test_presence_and_frequency_penalties():
    logits = torch.zeros(2, 6)
    p = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), SamplingParams()]
    out = apply_penalties(logits, p, [[5], [5]], [[1, 1, 2], [1]], [(), ()])
    assert out[0].tolist() == [0.0, -1.0, -0.75, 0.0, 0.0, 0.0]  # 0.5 + 2 * 0.25; 0.5 + 0.25
    assert out[1].tolist() == [0.0] * 6  # no penalties on this row
    assert logits.abs().sum() == 0  # the input is not modified


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    out = apply_penalties(logits, [SamplingParams(repetition_penalty=2.0)], [[0]], [[1]], [()])
    assert out[0].tolist() == [1.0, -4.0, 2.0, -2.0]  # prompt token 0 and output token 1 are penalised


def test_min_tokens_masks_stop_ids_until_reached():
    logits = torch.zeros(1, 5)
    p = [SamplingParams(min_tokens=2, max_tokens=4)]
    out = apply_penalties(logits, p, [[1]], [[3]], [(4, 2)])
    assert out[0, 4] == float("-inf") and out[0, 2] == float("-inf") and out[0, 0] == 0
    out = apply_penalties(logits, p, [[1]], [[3, 3]], [(4, 2)])
    assert torch.isfinite(out).all()


def test_in_flight_token_counts_as_output():
    """in_flight (async scheduling: each row's sampled token the host has not appended) = that token at the end of
    the row's output: the same penalties, bias and min_tokens mask, bitwise."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 12, generator=gen) * 3
    p = [SamplingParams(repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=0.4),
         SamplingParams(min_tokens=3, max_tokens=8, logit_bias={2: 1.5}),
         SamplingParams(frequency_penalty=-1.0, logit_bias={4: -2.0, 9: 0.5})]
    prompts, outputs, stops = [[1, 5], [0], [7, 7]], [[3, 3, 8], [6], []], [(11,), (11, 4), (11,)]
    in_flight = torch.tensor([3, 9, 5])
    got = apply_penalties(logits, p, prompts, outputs, stops, in_flight=in_flight)
    want = apply_penalties(logits, p, prompts, [o + [t] for o, t in zip(outputs, in_flight.tolist())], stops)
    assert torch.equal(got, want)
    assert got[1, 11] == float("-inf")  # 2 outputs with the one in flight: still under min_tokens = 3
    assert not torch.equal(got, apply_penalties(logits, p, prompts, outputs, stops))  # the token mattered


def test_step_sampler_keeps_a_penalised_requests_ids_on_the_device():
    """The ids the penalties read stay on the device while the request is in the batch: its prompt copied once, its
    output grown by the tokens appended since the step before (one copy for the batch, not the whole output every
    step), only for penalised requests, dropped when the request leaves; the penalties equal those over the lists."""
    from revolta.engine.request import Request
    from revolta.engine.sample_step import StepSampler

    sampler, cpu = StepSampler(frozenset({11}), 12), torch.device("cpu")
    pen = Request("pen", [1, 2, 3], SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, max_tokens=200))
    plain = Request("plain", [4, 5], SamplingParams(max_tokens=4))
    first = sampler._penalty_ids([pen, plain], cpu)
    assert first[0].prompt.tolist() == [1, 2, 3] and first[0].output.tolist() == [] and first[1] is None
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(1))
    for step in range(70):  # past the buffer's first 64 slots
        pen.token_ids.append(step % 7)
        if step % 5 == 0:
            pen.token_ids.append(9)  # two new tokens since the step before
        again = sampler._penalty_ids([plain, pen], cpu)[1]
        assert again is first[0] and again.output.tolist() == pen.token_ids  # kept, and up to date
        assert torch.equal(apply_penalties(logits, [pen.params], [again.prompt], [again.output], [()]),
                           apply_penalties(logits, [pen.params], [[1, 2, 3]], [list(pen.token_ids)], [()]))
    copied = []
    real = first[0].extend
    first[0].extend = lambda new: (copied.append(len(new)), real(new))
    pen.token_ids.append(4)
    sampler._penalty_ids([pen], cpu)
    assert copied == [1]  # the step's one new token, not the output so far
    sampler.pick([plain], torch.zeros(1, 12))  # a batch that no penalty reads
    assert not sampler._penalised  # the penalised request left the batch


def test_penalties_count_only_penalised_rows_outputs():
    """A row without penalties may pass its output ids or not: the logits are the same, bitwise (its counts meet a
    zero penalty); min_tokens reads only the number of ids."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 10, generator=gen)
    p = [SamplingParams(presence_penalty=0.7, repetition_penalty=1.3), SamplingParams(min_tokens=3, max_tokens=9)]
    a = apply_penalties(logits, p, [[1], [2]], [[3, 3], [4, 5]], [(), (9,)])
    b = apply_penalties(logits, p, [[1], [2]], [torch.tensor([3, 3]), [4, 5]], [(), (9,)])
    assert torch.equal(a, b) and torch.equal(a[1, :9], logits[1, :9]) and a[1, 9] == float("-inf")


@pytest.mark.parametrize("field,value", [("presence_penalty", 3.0), ("frequency_penalty", -2.5),
                                         ("repetition_penalty", 0.0), ("min_tokens", -1)])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_cannot_exceed_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)

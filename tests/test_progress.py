"""The `LLM.generate` bar moves every step: tokens against the batch's budget, tokens and tok/s in the postfix."""

from __future__ import annotations

from types import SimpleNamespace

from revolta.progress import GenerationBar


def _request(prompt_len: int, max_tokens: int | None):
    return SimpleNamespace(prompt_token_ids=[1] * prompt_len, token_ids=[], max_tokens=max_tokens, finished=False)


def test_bar_counts_tokens_each_step_and_ends_full_when_a_request_stops_early():
    a, b, c = _request(4, 10), _request(4, None), _request(4, 3)  # b: up to max_model_len, 16 - 4 = 12
    with GenerationBar([a, b, c], max_model_len=16, enabled=False) as bar:
        assert bar.total == 10 + 12 + 3
        a.token_ids.append(7)
        b.token_ids.append(7)
        bar.update([a, b])
        assert bar.n == 2 and bar.generated == 2  # a bar over whole sequences would still read 0
        assert "2 tokens" in bar.postfix and "tok/s" in bar.postfix and "0/3 done" in bar.postfix
        a.token_ids += [8, 9, 10]  # a speculative round: several tokens in one step
        bar.update([a])
        assert bar.n == 5
        b.token_ids.append(2)
        b.finished = True  # EOS after 2 of its 12: the other 10 will not come
        bar.update([b, b])  # seen twice: counted once
        assert bar.n == 5 + 1 + 10 and bar.generated == 6
        c.token_ids += [1, 2, 3]
        c.finished = a.finished = True
        a.token_ids += [1] * 6
        bar.update([a, c])
        assert bar.n == bar.total and bar.generated == 10 + 2 + 3
        assert "15 tokens" in bar.postfix and "3/3 done" in bar.postfix
        bar.update([_request(1, 1)])  # another caller's request in the same step is not this bar's
        assert bar.generated == 15

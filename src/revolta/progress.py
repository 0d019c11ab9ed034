"""The `LLM.generate` progress bar: it moves every engine step, not only when a whole sequence ends.

A bar over finished sequences sits at 0/N for the whole of a CPU run, which looks frozen. This one counts
tokens against the batch's token budget (each request's max_tokens, capped so that prompt + output fit
max_model_len); a request that stops early (EOS, a stop string) hands its unused budget back at once, so the
bar ends full. The postfix says what really happened: tokens generated, tokens/s, sequences done.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Protocol

from tqdm.auto import tqdm


class _Request(Protocol):  # the fields of engine.request.Request the bar reads
    prompt_token_ids: list[int]
    token_ids: list[int]
    max_tokens: int | None
    finished: bool


class GenerationBar:
    """`with GenerationBar(requests, max_model_len, enabled) as bar: bar.update(changed)` after each step."""

    def __init__(self, requests: Sequence[_Request], max_model_len: int, enabled: bool = True):
        self._budget = {id(r): _budget(r, max_model_len) for r in requests}
        self._seen = dict.fromkeys(self._budget, 0)  # tokens of each request already counted
        self._done: set[int] = set()
        self.generated = 0
        self.total, self.n = sum(self._budget.values()), 0  # the bar's position, also when it is not shown
        self._num_requests = len(requests)
        self._start = time.perf_counter()
        self.postfix = ""
        self._bar = tqdm(total=self.total, desc="Generating", unit="tok", disable=not enabled,
                         bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]")

    def update(self, changed: Iterable[_Request]) -> None:
        """Count the tokens the requests gained in one step (and the budget of those that finished)."""
        step = 0
        for r in changed:
            key = id(r)
            if key not in self._seen:  # another caller's request stepped in the same batch
                continue
            new = max(0, len(r.token_ids) - self._seen[key])
            self._seen[key] += new
            self.generated += new
            step += new
            if r.finished and key not in self._done:  # stopped early: the rest of its budget will not come
                self._done.add(key)
                step += max(0, self._budget[key] - self._seen[key])
        elapsed = time.perf_counter() - self._start
        rate = self.generated / elapsed if elapsed > 0 else 0.0
        self.postfix = f"{self.generated} tokens, {rate:.2f} tok/s, {len(self._done)}/{self._num_requests} done"
        self._bar.set_postfix_str(self.postfix, refresh=False)
        self.n += step
        self._bar.update(step)

    def __enter__(self) -> GenerationBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.close()


def _budget(request: _Request, max_model_len: int) -> int:
    """Tokens the request may generate: the engine caps max_tokens so that prompt + output fit max_model_len."""
    room = max_model_len - len(request.prompt_token_ids)
    return room if request.max_tokens is None else min(request.max_tokens, room)

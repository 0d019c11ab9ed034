"""A request as the engine runs it (`Request`), and what `LLM.generate` returns, shaped like vLLM's outputs.

`RequestOutput.outputs[0]` is a `CompletionOutput` with `.text`, `.token_ids` and `.finish_reason`
("stop" for an end-of-sequence token, a stop token id or a stop string; "length" for max_tokens or
the model's max length), so code written against `vllm.LLM` reads these the same way.

`Request` holds one completion's state: its prompt, sampling parameters and generator, the tokens and
text so far, and its stop rules (`append` decides when it is done). The engine owns it from
`Engine.add_request` on: the scheduler reads its tokens, the step's sampler appends to it.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from dataclasses import dataclass, field

import torch

from ..multimodal.processor import MultimodalPrompt
from ..spec.stats import SpecStats
from ..tokenizer import IncrementalDetokenizer, StopChecker
from .sampling import SamplingParams
from .structured import RequestConstraint

logger = logging.getLogger(__name__)


@dataclass
class Logprob:
    """Log-probability of one token under the raw model distribution; rank 1 = most likely."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated position: token id -> Logprob (the sampled token plus the top alternatives).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt position: None for the first token (nothing predicts it), then the dict of
# the prompt token there plus the top alternatives, as vLLM's RequestOutput.prompt_logprobs.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One completion of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it; None for EOS

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time() seconds) of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    # speculative decoding: rounds, drafts proposed / accepted, per-position acceptance (None when off)
    spec_decode: SpecStats | None = None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def tokens_per_s(self) -> float | None:
        """Decode speed: tokens after the first one, over the time after the first one."""
        if self.finished_time is None or self.first_token_time is None or self.num_generation_tokens < 2:
            return None
        elapsed = self.finished_time - self.first_token_time
        return (self.num_generation_tokens - 1) / elapsed if elapsed > 0 else None


@dataclass
class RequestOutput:
    """The result of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None
    prompt_logprobs: PromptLogprobs | None = None  # when SamplingParams.prompt_logprobs is set
    # prompt tokens whose cache came from the prefix cache at the request's first admission (None: not yet
    # scheduled); a multiple of the block size, as in vLLM
    num_cached_tokens: int | None = None


@dataclass(eq=False)
class Request:
    """One completion being generated: its state, its output so far, and its stop rules.

    max_tokens: the cap resolved against max_model_len (None: SamplingParams.max_tokens, else no cap
    but the engine's max_model_len). generator: None for greedy requests. detokenizer: None without a
    tokenizer (then outputs have no text and stop strings cannot match).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0, max_tokens=None))
    generator: torch.Generator | None = None
    max_tokens: int | None = None
    detokenizer: IncrementalDetokenizer | None = None
    metrics: RequestMetrics | None = None
    prompt: str | None = None
    index: int = 0  # which of the prompt's n completions this is
    parent_id: str | None = None  # the prompt's request id when n > 1
    mm_prompt: MultimodalPrompt | None = None  # media items, positions (prompt_token_ids are then expanded)
    spec_stats: SpecStats | None = None  # acceptance statistics (the engine records them) when speculating
    constraint: RequestConstraint | None = None  # grammar / thinking budget (structured.py), until it finishes
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # filled by position as chunks run
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache at the first admission

    def __post_init__(self) -> None:
        if self.max_tokens is None:
            self.max_tokens = self.params.max_tokens
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=time.time(), num_prompt_tokens=len(self.prompt_token_ids))
        self.stop_checker = StopChecker(self.params.stop_strings, self.params.include_stop_str_in_output)
        if self.params.logprobs is not None:
            self.logprobs, self.cumulative_logprob = [], 0.0
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        """Prompt and generated tokens."""
        return len(self.prompt_token_ids) + len(self.token_ids)

    def append(self, token_id: int, eos_token_ids: frozenset[int]) -> None:
        """Record one sampled token and decide whether the request is done."""
        self.token_ids.append(token_id)
        allowed = self.constraint is None or self.constraint.accept(token_id)
        if self.detokenizer is not None:
            self.text += self.stop_checker.feed(self.detokenizer.add(token_id))
        if self.stop_checker.finished:
            self._finish("stop", self.stop_checker.stop)
        elif not allowed:  # cannot happen with masked logits; end rather than emit outside the grammar
            logger.warning("request %s: token %d is outside its grammar; ending it", self.request_id, token_id)
            self._finish("stop", None)
        elif self.constraint is not None and self.constraint.terminated:  # the grammar is complete
            self._finish("stop", None if token_id in eos_token_ids else token_id)
        elif token_id in eos_token_ids and not self.params.ignore_eos:
            self._finish("stop", None)
        elif token_id in self.params.stop_token_ids:
            self._finish("stop", token_id)
        elif self.max_tokens is not None and len(self.token_ids) >= self.max_tokens:
            self._finish("length", None)

    def _finish(self, reason: str, stop_reason: int | str | None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.release()
        if self.detokenizer is not None and not self.stop_checker.finished:
            self.text += self.stop_checker.feed(self.detokenizer.flush())
            self.text += self.stop_checker.flush()
            if self.stop_checker.finished:  # the held-back tail completed a stop string
                self.stop_reason = self.stop_checker.stop
        self.metrics.finished_time = time.time()

    def abort(self) -> None:
        """End an unfinished request with finish_reason "abort" (vLLM's, for a request stopped by pause or sleep)."""
        if not self.finished:
            self._finish("abort", None)

    def release(self) -> None:
        """Drop the grammar matcher (finished or aborted)."""
        if self.constraint is not None:
            self.constraint.close()
            self.constraint = None

    def output(self) -> RequestOutput:
        self.metrics.num_generation_tokens = len(self.token_ids)
        if self.spec_stats is not None:
            self.metrics.spec_decode = copy.deepcopy(self.spec_stats)
        return RequestOutput(self.parent_id or self.request_id, self.prompt, self._output_prompt_ids,
                             [self.completion()], finished=self.finished, metrics=self.metrics,
                             prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
                             num_cached_tokens=self.num_cached_tokens)

    @functools.cached_property
    def _output_prompt_ids(self) -> list[int]:
        """One copy of the prompt ids for every RequestOutput of this request (a streamed request's output is made
        every step, and copying a 512K-token prompt each time cost milliseconds of the engine loop)."""
        return list(self.prompt_token_ids)

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )

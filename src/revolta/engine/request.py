"""What `LLM.generate` returns, shaped like vLLM's outputs.

`RequestOutput.outputs[0]` is a `CompletionOutput` with `.text`, `.token_ids` and `.finish_reason`
("stop" for an end-of-sequence token, a stop token id or a stop string; "length" for max_tokens or
the model's max length), so code written against `vllm.LLM` reads these the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec.stats import SpecStats


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
    finish_reason: str | None = None  # "stop" | "length" | None while running
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

"""What every generation route shares: the server's state, submitting, collecting, cancelling on disconnect."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from ..engine.request import CompletionOutput, PromptLogprobs
from ..engine.sampling import SamplingParams
from .chat_prompt import PromptRenderer, RenderedPrompt
from .config import ServerConfig
from .disconnect import unless_disconnected  # noqa: F401  (the routes import it from here)
from .engine_loop import EngineLoop, Fault, RequestFailed, RequestStream
from .errors import APIError, bad_request, openai_error_body
from .metrics import Metrics
from .output import ChoiceParser, Delta
from .sse import DONE, data_frame
from .tool_grammar import forced_call_constraint

# honoured only with --enable-fault-injection: fail the request after N tokens, with this status (default 500)
FAULT_HEADER, FAULT_STATUS_HEADER = "x-revolta-fail-after-tokens", "x-revolta-fail-status"
KILL_ENGINE_HEADER = "x-revolta-kill-engine"  # the engine loop dies before this request (the /health 503 check)


@dataclass(frozen=True)
class ServerState:
    """Everything a route needs; one per app (no module-level state)."""

    llm: Any
    engine: EngineLoop
    config: ServerConfig
    renderer: PromptRenderer
    metrics: Metrics
    defaults: SamplingParams  # the checkpoint's generation_config
    fault_injection: bool = False

    def parse_tools(self, prompt: RenderedPrompt) -> bool:
        return self.config.tool_call_parser is not None and prompt.tools.parse

    def engine_params(self, prompt: RenderedPrompt, params: SamplingParams) -> SamplingParams:
        """What the engine runs: with tool parsing, stop strings are the parsers' (content only), so a
        stop string inside a call's arguments does not cut the call; a forced tool_choice (required /
        named) also gets the grammar of its call (tool_grammar.py)."""
        if self.parse_tools(prompt) and params.stop_strings:
            params = dataclasses.replace(params, stop=None)
        if self.parse_tools(prompt) and params.structured_outputs is None:
            forced = forced_call_constraint(prompt.tools, self.config.structured_disable_any_whitespace)
            if forced is not None:
                params = dataclasses.replace(params, structured_outputs=forced)
        return params

    def choice_parsers(self, prompt: RenderedPrompt, params: SamplingParams,
                       streaming: bool = False) -> list[ChoiceParser]:
        """One output splitter per choice, as the server's parser flags and the request's tools say."""
        tools = self.parse_tools(prompt)
        stop = params.stop_strings if tools else ()
        return [ChoiceParser(prompt, parse_reasoning=self.config.reasoning_parser is not None, parse_tools=tools,
                             streaming=streaming, stop=stop, include_stop=params.include_stop_str_in_output)
                for _ in range(params.n)]

    async def submit(self, request: Request, prompt: Any, params: SamplingParams) -> RequestStream:
        """Hand a validated prompt (what `LLM.add_request` takes: {"prompt_token_ids": [...]} or a processed
        prompt with media) to the engine; its own rejections become 400s, a full engine a 503."""
        limit = self.config.max_pending_requests
        if limit is not None and self.engine.num_in_flight >= limit:
            raise APIError(503, f"The server is overloaded: {limit} requests are already in flight "
                                "(--max-pending-requests); retry later", headers={"Retry-After": "1"})
        fault = None
        if self.fault_injection and KILL_ENGINE_HEADER in request.headers:
            self.engine.kill()
        if self.fault_injection and FAULT_HEADER in request.headers:
            try:
                fault = Fault(int(request.headers[FAULT_HEADER]), int(request.headers.get(FAULT_STATUS_HEADER, 500)))
            except ValueError:
                raise bad_request(f"{FAULT_HEADER} and {FAULT_STATUS_HEADER} must be integers") from None
        try:
            return await self.engine.submit(prompt, params, fault)
        except RequestFailed as e:
            raise APIError(e.status, str(e), headers=e.headers) from None
        except (ValueError, TypeError) as e:
            raise bad_request(str(e)) from None


async def parsed_outputs(stream: RequestStream,
                         parsers: list[ChoiceParser]) -> AsyncIterator[tuple[CompletionOutput, Delta]]:
    """Each output with what it adds, split by its choice's parser. A choice whose parser matched a
    stop string ends there (finish_reason "stop"); reading stops, aborting the request, once all have."""
    done: set[int] = set()
    async for out in stream:
        c = out.outputs[0]
        if c.index in done:
            continue
        parser = parsers[c.index]
        delta = parser.update(c)
        if parser.stopped is not None:  # it came before whatever ended the engine's output
            c = dataclasses.replace(c, finish_reason="stop", stop_reason=parser.stopped)
        if c.finish_reason is not None:
            done.add(c.index)
        yield c, delta
        if len(done) == len(parsers):
            break


async def parse_all(stream: RequestStream, parsers: list[ChoiceParser]) -> list[CompletionOutput]:
    """Run a request to the end through its parsers; the final output of each choice, by index."""
    last: dict[int, CompletionOutput] = {}
    try:
        async for c, _ in parsed_outputs(stream, parsers):
            last[c.index] = c
    except RequestFailed as e:
        raise APIError(e.status, str(e)) from None
    finally:
        stream.close()
    return [last[i] for i in sorted(last)]


async def collect(stream: RequestStream) -> tuple[list[CompletionOutput], PromptLogprobs | None]:
    """Run a request to the end; the final CompletionOutput of each choice, by index, and the prompt's
    logprobs (when SamplingParams.prompt_logprobs asked for them; complete from the first output on)."""
    last: dict[int, CompletionOutput] = {}
    prompt_logprobs = None
    try:
        async for out in stream:
            last[out.outputs[0].index] = out.outputs[0]
            prompt_logprobs = out.prompt_logprobs
    except RequestFailed as e:
        raise APIError(e.status, str(e)) from None
    return [last[i] for i in sorted(last)], prompt_logprobs


LOGPROB_FLOOR = -9999.0  # vLLM's: a token the model gives probability 0 (-inf) must still be valid JSON


def json_logprob(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def created() -> int:
    return int(time.time())


def usage_openai(prompt_tokens: int, completions: list[CompletionOutput]) -> dict[str, Any]:
    completion_tokens = sum(len(c.token_ids) for c in completions)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": None}


async def openai_frames(frames: AsyncIterator[str], close: Callable[[], None]) -> AsyncIterator[str]:
    """An OpenAI `data:` stream: `frames`, an error frame if a request fails mid-way, then [DONE]; `close`
    (RequestStream.close, or one closing several) ends the engine requests however it goes."""
    try:
        async for frame in frames:
            yield frame
    except RequestFailed as e:
        yield data_frame(openai_error_body(e.status, str(e)))
    finally:
        close()
    yield DONE

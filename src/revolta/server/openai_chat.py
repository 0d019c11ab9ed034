"""POST /v1/chat/completions: non-streaming and streaming (data: chunks, usage chunk, [DONE])."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..engine.request import CompletionOutput
from .chat_prompt import RenderedPrompt, ToolSetup, normalize_messages, tool_setup
from . import structured_request
from .engine_loop import RequestStream
from .errors import bad_request
from .generation import (ServerState, created, json_logprob, openai_frames, parse_all, parsed_outputs,
                         unless_disconnected, usage_openai)
from .output import ChoiceParser, Delta
from .params import build_sampling_params, check_model, check_stream_options, read_body
from .protocol import ChatCompletionRequest
from .sse import data_frame, sse_response


def finish_reason(c: CompletionOutput, parser: ChoiceParser, tools: ToolSetup) -> str:
    """tool_calls only when calls parsed, the engine stopped on its own and no named tool was forced."""
    if parser.tool_calls and c.finish_reason == "stop" and tools.choice != "named":
        return "tool_calls"
    return c.finish_reason or "stop"


def logprobs_content(c: CompletionOutput, start: int, end: int, top: int) -> list[dict[str, Any]]:
    """OpenAI `logprobs.content` entries for tokens [start, end) of a choice."""
    out = []
    for token_id, entry in zip(c.token_ids[start:end], (c.logprobs or [])[start:end]):
        chosen = entry[token_id]

        def item(lp: Any) -> dict[str, Any]:
            text = lp.decoded_token or ""
            return {"token": text, "logprob": json_logprob(lp.logprob), "bytes": list(text.encode())}

        ranked = sorted(entry.values(), key=lambda lp: lp.rank or 0)[:top]
        out.append({**item(chosen), "top_logprobs": [item(lp) for lp in ranked]})
    return out


def message_of(parser: ChoiceParser, include_reasoning: bool) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": parser.content}
    reasoning = parser.reasoning if include_reasoning else None
    message["reasoning"] = message["reasoning_content"] = reasoning
    if parser.tool_calls:
        message["tool_calls"] = [{"id": t.id, "type": "function",
                                  "function": {"name": t.name, "arguments": t.arguments}}
                                 for t in parser.tool_calls]
    return message


def delta_json(d: Delta, include_reasoning: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if d.reasoning and include_reasoning:
        out["reasoning"] = out["reasoning_content"] = d.reasoning
    if d.content:
        out["content"] = d.content
    if d.tool_calls:
        calls = []
        for t in d.tool_calls:
            call: dict[str, Any] = {"index": t.index}
            if t.id is not None:
                call.update(id=t.id, type="function", function={"name": t.name, "arguments": t.arguments})
            else:
                call["function"] = {"arguments": t.arguments}
            calls.append(call)
        out["tool_calls"] = calls
    return out


class ChatCompletions:
    def __init__(self, state: ServerState):
        self.state = state

    async def __call__(self, request: Request) -> Any:
        s = self.state
        body = await read_body(request, ChatCompletionRequest, s.config.max_body_bytes)
        check_model(body.model, s.config)
        check_stream_options(body.stream, body.stream_options)
        if body.top_logprobs and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        fields = body.model_dump()  # with the vLLM extras (structured_outputs, guided_*, thinking_token_budget)
        structured = structured_request.from_chat(fields, s.config.structured_disable_any_whitespace)
        tools = tool_setup(body.tools, body.tool_choice, body.parallel_tool_calls)
        structured_request.check_tool_choice(structured, tools.choice, bool(tools.forced_prefix))
        kwargs = dict(body.chat_template_kwargs or {})
        if body.reasoning_effort == "none":
            kwargs.setdefault("enable_thinking", False)
        messages = normalize_messages([m.model_dump(exclude_none=True) for m in body.messages])
        prompt = await s.renderer.render(messages, tools, kwargs, add_generation_prompt=body.add_generation_prompt,
                                         continue_final_message=body.continue_final_message, request=request)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        top = body.top_logprobs or 0
        params = build_sampling_params(fields, defaults=s.defaults, config=s.config,
                                       max_tokens=max_tokens, max_tokens_param=param,
                                       logprobs=top if body.logprobs else None, structured_outputs=structured,
                                       vocab_size=s.renderer.tokenizer.vocab_size)
        stream = await s.submit(request, prompt.engine_prompt, s.engine_params(prompt, params))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        parsers = s.choice_parsers(prompt, params, streaming=body.stream)
        if body.stream:
            options = body.stream_options
            frames = self._stream(stream, parsers, prompt, body, request_id, bool(options and options.include_usage),
                                  bool(options and options.continuous_usage_stats), top)
            return sse_response(openai_frames(frames, stream.close), s.config.sse_keep_alive_interval, stream.close,
                                ready=stream.started)
        completions = await unless_disconnected(request, parse_all(stream, parsers))
        return JSONResponse(self._response(completions, parsers, prompt, body, request_id, top))

    def _response(self, completions: list[CompletionOutput], parsers: list[ChoiceParser], prompt: RenderedPrompt,
                  body: ChatCompletionRequest, request_id: str, top: int) -> dict[str, Any]:
        choices = []
        for c in completions:
            parser = parsers[c.index]
            choices.append({"index": c.index, "message": message_of(parser, body.include_reasoning),
                            "logprobs": {"content": logprobs_content(c, 0, len(c.token_ids), top)}
                            if body.logprobs else None,
                            "finish_reason": finish_reason(c, parser, prompt.tools), "stop_reason": c.stop_reason})
        return {"id": request_id, "object": "chat.completion", "created": created(),
                "model": self.state.config.served_model_name, "choices": choices,
                "usage": usage_openai(len(prompt.token_ids), completions)}

    async def _stream(self, stream: RequestStream, parsers: list[ChoiceParser], prompt: RenderedPrompt,
                      body: ChatCompletionRequest, request_id: str, include_usage: bool, continuous: bool,
                      top: int) -> AsyncIterator[str]:
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created(),
                "model": self.state.config.served_model_name}
        n = len(parsers)
        sent_tokens = [0] * n
        last: dict[int, CompletionOutput] = {}

        def chunk(choices: list[dict[str, Any]]) -> str:
            frame = {**head, "choices": choices}
            if continuous:
                frame["usage"] = usage_openai(len(prompt.token_ids), list(last.values()))
            return data_frame(frame)

        for i in range(n):
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        async for c, delta in parsed_outputs(stream, parsers):
            i, last[c.index] = c.index, c
            logprobs = {"content": logprobs_content(c, sent_tokens[i], len(c.token_ids), top)} \
                if body.logprobs else None
            sent_tokens[i] = len(c.token_ids)
            payload = delta_json(delta, body.include_reasoning)
            if payload or (logprobs and logprobs["content"]):
                yield chunk([{"index": i, "delta": payload, "logprobs": logprobs, "finish_reason": None}])
            if c.finish_reason is not None:
                yield chunk([{"index": i, "delta": {}, "logprobs": None,
                              "finish_reason": finish_reason(c, parsers[i], prompt.tools),
                              "stop_reason": c.stop_reason}])
        if include_usage:
            yield data_frame({**head, "choices": [],
                              "usage": usage_openai(len(prompt.token_ids), list(last.values()))})


def chat_router(state: ServerState) -> APIRouter:
    router = APIRouter()
    router.add_api_route("/v1/chat/completions", ChatCompletions(state), methods=["POST"])
    return router

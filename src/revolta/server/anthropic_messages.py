"""POST /v1/messages and /v1/messages/count_tokens: Anthropic Messages on top of the chat pipeline.

Requests are converted to chat messages + OpenAI-shaped tools, answers back to content blocks
(thinking with a signature, text, tool_use). Every error on these paths uses the Anthropic envelope
(errors.py picks it by path), including the `event: error` frame inside a stream.
"""

from __future__ import annotations

import json
import secrets
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..engine.request import CompletionOutput
from .chat_prompt import RenderedPrompt, ToolSetup, normalize_messages, tool_setup
from .engine_loop import RequestFailed, RequestStream
from .errors import anthropic_error_body, bad_request
from .generation import ServerState, parse_all, parsed_outputs, unless_disconnected
from .output import ChoiceParser, ToolCall
from .params import build_sampling_params, check_model, read_body
from .protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest
from .sse import event_frame, sse_response
from .tool_schema import ToolRequestError, anthropic_tool_choice_to_openai, anthropic_tools_to_openai

MIN_THINKING_BUDGET = 1024


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content or () if isinstance(b, Mapping) and b.get("type") == "text")


def _system_text(system: str | list[dict[str, Any]]) -> str:
    """Anthropic's `system` takes a string or text blocks only (cache_control and citations ride along); any
    other block is refused rather than dropped, so a request never loses part of its instructions unseen."""
    for i, block in enumerate(() if isinstance(system, str) else system):
        kind = block.get("type")
        if kind != "text":
            raise bad_request(f"system[{i}]: system takes text blocks only, got a block of type {kind!r}; put images "
                              "and documents in a user message's content instead")
        if not isinstance(block.get("text"), str):
            raise bad_request(f"system[{i}].text must be a string, got {type(block.get('text')).__name__}")
    return _text_of(system)


def to_chat_messages(body: AnthropicCountTokensRequest) -> list[dict[str, Any]]:
    """Anthropic system + messages -> chat messages (tool_result blocks become tool messages)."""
    out: list[dict[str, Any]] = []
    if body.system:
        out.append({"role": "system", "content": _system_text(body.system)})
    for i, message in enumerate(body.messages):
        blocks = [{"type": "text", "text": message.content}] if isinstance(message.content, str) else message.content
        parts, calls, reasoning = [], [], ""
        for j, b in enumerate(blocks):
            where = f"messages[{i}].content[{j}]"
            kind = b.get("type") if isinstance(b, Mapping) else None
            if kind == "text":
                parts.append({"type": "text", "text": b.get("text", "")})
            elif kind == "image":
                parts.append({"type": "image_url", "image_url": {"url": _image_url(b.get("source"), where)}})
            elif kind == "tool_use":
                calls.append({"id": b.get("id"), "type": "function",
                              "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input", {}))}})
            elif kind == "tool_result":
                out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": _text_of(b.get("content"))})
            elif kind == "thinking":
                reasoning += b.get("thinking", "")
            elif kind == "redacted_thinking":
                continue
            else:
                raise bad_request(f"{where}: unsupported content block type {kind!r}")
        if message.role == "assistant":
            m: dict[str, Any] = {"role": "assistant", "content": _text_of(parts)}
            if calls:
                m["tool_calls"] = calls
            if reasoning:
                m["reasoning_content"] = reasoning
            out.append(m)
        elif parts:
            out.append({"role": "user", "content": parts})
    return out


def _image_url(source: Any, where: str) -> str:
    if not isinstance(source, Mapping):
        raise bad_request(f"{where}.source is required")
    if source.get("type") == "base64":
        return f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
    if source.get("type") == "url":
        return str(source.get("url", ""))
    raise bad_request(f"{where}.source.type must be 'base64' or 'url'")


def to_tool_setup(body: AnthropicCountTokensRequest) -> ToolSetup:
    """Anthropic tools / tool_choice -> the chat ToolSetup (any -> required, tool -> named)."""
    try:
        tools = anthropic_tools_to_openai(body.tools) if body.tools is not None else None
        choice, parallel = anthropic_tool_choice_to_openai(body.tool_choice)
    except ToolRequestError as e:
        raise bad_request(e.message, e.param) from None
    return tool_setup(tools, choice, parallel is not False)


def thinking_enabled(body: AnthropicCountTokensRequest, max_tokens: int | None) -> bool | None:
    """None = the template default; checks the budget rules of `thinking: {type: enabled}`."""
    t = body.thinking
    if t is None:
        return None
    kind = t.get("type")
    if kind == "disabled":
        return False
    if kind == "adaptive":
        return None
    if kind != "enabled":
        raise bad_request(f"thinking.type must be enabled, disabled or adaptive, got {kind!r}")
    budget = t.get("budget_tokens")
    if not isinstance(budget, int) or budget < MIN_THINKING_BUDGET:
        raise bad_request(f"thinking.budget_tokens must be an integer >= {MIN_THINKING_BUDGET}, got {budget!r}")
    if max_tokens is not None and budget >= max_tokens:
        raise bad_request(f"thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})")
    return True


def thinking_budget(body: AnthropicCountTokensRequest) -> int | None:
    """thinking.budget_tokens of an enabled thinking block: the engine forces </think> after that many tokens."""
    t = body.thinking
    return t.get("budget_tokens") if t is not None and t.get("type") == "enabled" else None


def stop_reason(c: CompletionOutput, calls: list[ToolCall]) -> tuple[str, str | None]:
    if c.finish_reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def _arguments(call: ToolCall) -> dict[str, Any]:
    try:
        value = json.loads(call.arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class Messages:
    def __init__(self, state: ServerState):
        self.state = state

    async def _prompt(self, request: Request, body: AnthropicCountTokensRequest, max_tokens: int | None,
                      check_length: bool) -> RenderedPrompt:
        s = self.state
        check_model(body.model, s.config, required=True)
        tools = to_tool_setup(body)
        enable = thinking_enabled(body, max_tokens)
        kwargs = dict(body.chat_template_kwargs or {})
        if enable is not None:
            kwargs["enable_thinking"] = enable
        messages = normalize_messages(to_chat_messages(body))
        # A trailing assistant message is a prefill: the answer continues it and does not repeat it.
        prefill = body.messages[-1].role == "assistant"
        return await s.renderer.render(messages, tools, kwargs, check_length=check_length, request=request,
                                       continue_final_message=prefill)

    async def count_tokens(self, request: Request) -> JSONResponse:
        body = await read_body(request, AnthropicCountTokensRequest, self.state.config.max_body_bytes)
        prompt = await self._prompt(request, body, None, check_length=False)
        return JSONResponse({"input_tokens": len(prompt.token_ids)})

    async def create(self, request: Request) -> Any:
        s = self.state
        body = await read_body(request, AnthropicMessagesRequest, s.config.max_body_bytes)
        if body.max_tokens <= 0:
            raise bad_request(f"max_tokens must be positive, got {body.max_tokens}")
        prompt = await self._prompt(request, body, body.max_tokens, check_length=True)
        fields = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
                  "stop": body.stop_sequences, "thinking_token_budget": thinking_budget(body)}
        params = build_sampling_params(fields, defaults=s.defaults, config=s.config, max_tokens=body.max_tokens)
        stream = await s.submit(request, prompt.engine_prompt, s.engine_params(prompt, params))
        mid = f"msg_{uuid.uuid4().hex}"
        [parser] = s.choice_parsers(prompt, params, streaming=body.stream)
        if body.stream:
            return sse_response(self._stream(stream, parser, prompt, mid), s.config.sse_keep_alive_interval,
                                stream.close, ready=stream.started)
        [c] = await unless_disconnected(request, parse_all(stream, [parser]))
        content: list[dict[str, Any]] = []
        if parser.reasoning:
            content.append({"type": "thinking", "thinking": parser.reasoning, "signature": secrets.token_hex(16)})
        if parser.content or not parser.tool_calls:
            content.append({"type": "text", "text": parser.content or ""})
        content += [{"type": "tool_use", "id": t.id, "name": t.name, "input": _arguments(t)}
                    for t in parser.tool_calls]
        reason, sequence = stop_reason(c, parser.tool_calls)
        return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": s.config.served_model_name,
                             "content": content, "stop_reason": reason, "stop_sequence": sequence,
                             "usage": {"input_tokens": len(prompt.token_ids), "output_tokens": len(c.token_ids)}})

    async def _stream(self, stream: RequestStream, parser: ChoiceParser, prompt: RenderedPrompt,
                      mid: str) -> AsyncIterator[str]:
        index = -1
        open_kind: str | None = None  # thinking | text | tool_use

        def start(kind: str, block: dict[str, Any]) -> list[str]:
            nonlocal index, open_kind
            frames = stop()
            index, open_kind = index + 1, kind
            return frames + [event_frame("content_block_start", {"type": "content_block_start", "index": index,
                                                                 "content_block": block})]

        def stop() -> list[str]:
            nonlocal open_kind
            if open_kind is None:
                return []
            frames = []
            if open_kind == "thinking":
                frames.append(delta_frame({"type": "signature_delta", "signature": secrets.token_hex(16)}))
            open_kind = None
            return frames + [event_frame("content_block_stop", {"type": "content_block_stop", "index": index})]

        def delta_frame(delta: dict[str, Any]) -> str:
            return event_frame("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})

        last: CompletionOutput | None = None
        try:
            yield event_frame("message_start", {"type": "message_start", "message": {
                "id": mid, "type": "message", "role": "assistant", "content": [],
                "model": self.state.config.served_model_name, "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": len(prompt.token_ids), "output_tokens": 0}}})
            async for last, delta in parsed_outputs(stream, [parser]):
                if delta.reasoning:
                    if open_kind != "thinking":
                        for f in start("thinking", {"type": "thinking", "thinking": ""}):
                            yield f
                    yield delta_frame({"type": "thinking_delta", "thinking": delta.reasoning})
                if delta.content:
                    if open_kind != "text":
                        for f in start("text", {"type": "text", "text": ""}):
                            yield f
                    yield delta_frame({"type": "text_delta", "text": delta.content})
                for t in delta.tool_calls:
                    if t.id is not None:
                        for f in start("tool_use", {"type": "tool_use", "id": t.id, "name": t.name, "input": {}}):
                            yield f
                    if t.arguments and open_kind == "tool_use":
                        yield delta_frame({"type": "input_json_delta", "partial_json": t.arguments})
            if not parser.content and not parser.tool_calls:  # strict clients index a text block
                for f in start("text", {"type": "text", "text": ""}):
                    yield f
            for f in stop():
                yield f
            reason, sequence = stop_reason(last, parser.tool_calls) if last else ("end_turn", None)
            yield event_frame("message_delta", {"type": "message_delta",
                                                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                "usage": {"output_tokens": len(last.token_ids) if last else 0}})
            yield event_frame("message_stop", {"type": "message_stop"})
        except RequestFailed as e:
            for f in stop():
                yield f
            yield event_frame("error", anthropic_error_body(e.status, str(e)))
        finally:
            stream.close()


def anthropic_router(state: ServerState) -> APIRouter:
    router = APIRouter()
    handler = Messages(state)
    router.add_api_route("/v1/messages", handler.create, methods=["POST"])
    router.add_api_route("/v1/messages/count_tokens", handler.count_tokens, methods=["POST"])
    return router

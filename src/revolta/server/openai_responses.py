"""POST /v1/responses: the OpenAI Responses API on top of the chat pipeline (items in, items out).

Stored responses (store=true, the default) are kept in a bounded per-app map (MAX_STORED, oldest out first):
the conversation, so that `previous_response_id` can continue it, and the response object, for
GET /v1/responses/{id}; DELETE /v1/responses/{id} drops one. An unknown id is a 404.
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..engine.request import CompletionOutput
from .chat_prompt import RenderedPrompt, normalize_messages, tool_setup
from .engine_loop import RequestFailed, RequestStream
from .errors import APIError, bad_request
from .generation import ServerState, created, parse_all, parsed_outputs, unless_disconnected
from .openai_chat import logprobs_content
from .output import ChoiceParser
from .params import build_sampling_params, check_model, check_top_logprobs, read_body
from .structured_request import check_tool_choice, from_responses
from .protocol import ResponsesRequest
from .sse import event_frame, sse_response
from .tool_schema import ToolRequestError, responses_tools_to_openai

MAX_STORED = 1024
INCLUDE_LOGPROBS = "message.output_text.logprobs"  # the `include` entry that asks for output_text logprobs


@dataclass(frozen=True)
class Stored:
    conversation: list[dict[str, Any]]  # what a follow-up continues (the reply included)
    response: dict[str, Any]  # the object the create call returned (the final one, when streamed)


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """Responses `input` (a string or items) -> chat messages."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content")
            if isinstance(content, list):
                content = [_input_part(p, f"input[{i}].content[{j}]") for j, p in enumerate(content)]
            messages.append({"role": item.get("role", "user"), "content": content})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":
            continue  # earlier reasoning is not re-sent to the model (the template drops it too)
        else:
            raise bad_request(f"input[{i}]: unsupported input item type {kind!r}", "input")
    return messages


def _input_part(part: Mapping[str, Any], where: str) -> dict[str, Any]:
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text"):
        return {"type": "text", "text": part.get("text")}
    if kind == "input_image":
        url = part.get("image_url")
        return {"type": "image_url", "image_url": {"url": url.get("url") if isinstance(url, Mapping) else url}}
    if kind in ("image_url", "video_url"):  # chat-style parts, as vLLM accepts them here (video has no input_ type)
        return dict(part)
    raise bad_request(f"{where}: unsupported content type {kind!r}; use input_text, input_image or video_url",
                      "input")


class Responses:
    def __init__(self, state: ServerState):
        self.state = state
        self.stored: OrderedDict[str, Stored] = OrderedDict()  # id -> conversation and response, oldest first

    async def __call__(self, request: Request) -> Any:
        s = self.state
        body = await read_body(request, ResponsesRequest, s.config.max_body_bytes)
        check_model(body.model, s.config)
        structured = from_responses(body.text, s.config.structured_disable_any_whitespace)
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            history = list(self.lookup(body.previous_response_id, "previous_response_id").conversation)
        new = input_messages(body)
        conversation = history + new  # what a follow-up continues (instructions are per request, as in OpenAI's API)
        messages = conversation
        if body.instructions:
            messages = [{"role": "system", "content": body.instructions}] + \
                [m for m in conversation if m["role"] != "system"]
        try:
            chat_tools = responses_tools_to_openai(body.tools) if body.tools is not None else None
        except ToolRequestError as e:
            raise bad_request(e.message, e.param) from None
        tools = tool_setup(chat_tools, body.tool_choice, body.parallel_tool_calls)
        check_tool_choice(structured, tools.choice, bool(tools.forced_prefix))
        kwargs = dict(body.chat_template_kwargs or {})
        if body.reasoning is not None and body.reasoning.effort == "none":
            kwargs.setdefault("enable_thinking", False)
        prompt = await s.renderer.render(normalize_messages(messages), tools, kwargs,
                                         request=request)
        check_top_logprobs(body.top_logprobs)
        top = body.top_logprobs or 0
        logprobs = top if INCLUDE_LOGPROBS in (body.include or ()) else None  # as vLLM: top_logprobs alone adds none
        params = build_sampling_params({**body.model_dump(), "n": 1}, defaults=s.defaults, config=s.config,  # one output
                                       max_tokens=body.max_output_tokens, max_tokens_param="max_output_tokens",
                                       logprobs=logprobs, structured_outputs=structured,
                                       vocab_size=s.renderer.tokenizer.vocab_size)
        stream = await s.submit(request, prompt.engine_prompt, s.engine_params(prompt, params))
        rid = f"resp_{uuid.uuid4().hex}"
        [parser] = s.choice_parsers(prompt, params, streaming=body.stream)
        if body.stream:
            return sse_response(self._stream(stream, parser, prompt, body, rid, conversation, logprobs),
                                s.config.sse_keep_alive_interval, stream.close, ready=stream.started)
        [c] = await unless_disconnected(request, parse_all(stream, [parser]))
        text_logprobs = _logprobs(c, 0, logprobs)
        response = self._response(body, rid, c, parser, len(prompt.token_ids), self._items(rid, parser, text_logprobs),
                                  cached=stream.num_cached_tokens)
        self._store(body, rid, conversation, parser, response)
        return JSONResponse(response)

    @staticmethod
    def _items(rid: str, parser: ChoiceParser, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        items = []
        if parser.reasoning:
            items.append(_reasoning_item(f"rs_{rid}", parser.reasoning, "completed"))
        if parser.content or not parser.tool_calls:
            items.append(_message_item(f"msg_{rid}", parser.content or "", "completed", logprobs))
        for t in parser.tool_calls:
            items.append(_call_item(f"fc_{t.id}", t.id, t.name, t.arguments, "completed"))
        return items

    def _response(self, body: ResponsesRequest, rid: str, c: CompletionOutput | None, parser: ChoiceParser | None,
                  prompt_tokens: int, output: list[dict[str, Any]], status: str | None = None,
                  cached: int = 0) -> dict[str, Any]:
        """The response object; `cached` is the prompt's prefix-cache hit in tokens (the engine's count)."""
        if status is None:
            status = "incomplete" if c is not None and c.finish_reason == "length" else "completed"
        out_tokens = len(c.token_ids) if c is not None else 0
        reasoning = 0  # the reasoning text re-tokenized: the engine reports no per-part counts
        if parser is not None and parser.reasoning:
            reasoning = min(len(self.state.renderer.tokenizer.encode(parser.reasoning_text)), out_tokens)
        return {"id": rid, "object": "response", "created_at": created(), "model": self.state.config.served_model_name,
                "status": status, "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
                "temperature": body.temperature, "top_p": body.top_p, "tool_choice": body.tool_choice or "auto",
                "tools": body.tools or [], "text": body.text or {"format": {"type": "text"}}, "metadata": {},
                "reasoning": body.reasoning and body.reasoning.model_dump(), "store": body.store,
                "usage": {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
                          "output_tokens": out_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
                          "total_tokens": prompt_tokens + out_tokens}}

    def lookup(self, rid: str, param: str | None = None) -> Stored:
        if rid not in self.stored:
            raise APIError(404, f"Response with id '{rid}' not found.", param)
        return self.stored[rid]

    async def retrieve(self, response_id: str, stream: bool = False) -> JSONResponse:
        if stream:
            raise bad_request("stream=true (replaying a stored response's events) is not supported; retrieve it "
                              "without stream", "stream")
        return JSONResponse(self.lookup(response_id).response)

    async def delete(self, response_id: str) -> JSONResponse:
        self.lookup(response_id)
        del self.stored[response_id]
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})  # OpenAI's answer

    def _store(self, body: ResponsesRequest, rid: str, conversation: list[dict[str, Any]],
               parser: ChoiceParser, response: dict[str, Any]) -> None:
        if not body.store:
            return
        reply: dict[str, Any] = {"role": "assistant", "content": parser.content or ""}
        if parser.tool_calls:
            reply["tool_calls"] = [{"id": t.id, "type": "function",
                                    "function": {"name": t.name, "arguments": t.arguments}} for t in parser.tool_calls]
        self.stored[rid] = Stored(conversation + [reply], response)
        while len(self.stored) > MAX_STORED:
            self.stored.popitem(last=False)

    async def _stream(self, stream: RequestStream, parser: ChoiceParser, prompt: RenderedPrompt,
                      body: ResponsesRequest, rid: str, conversation: list[dict[str, Any]],
                      logprobs: int | None) -> AsyncIterator[str]:
        """The event stream. With `logprobs`, each output_text.delta carries the tokens not reported yet (those
        of reasoning before it included) and the done events the whole list, as the non-streaming answer."""
        seq = 0
        sent_tokens = 0  # generated tokens whose logprobs an output_text.delta carried

        def ev(kind: str, **payload: Any) -> str:
            nonlocal seq
            seq += 1
            return event_frame(kind, {"type": kind, "sequence_number": seq - 1, **payload})

        output: list[dict[str, Any]] = []
        open_item: dict[str, Any] | None = None  # the item receiving deltas
        base = self._response(body, rid, None, None, len(prompt.token_ids), [], "in_progress")

        def close() -> list[str]:
            nonlocal open_item
            if open_item is None:
                return []
            item, open_item, idx = open_item, None, len(output) - 1
            item["status"] = "completed"
            frames = []
            if item["type"] == "reasoning":
                text = item["content"][0]["text"]
                frames.append(ev("response.reasoning_text.done", item_id=item["id"], output_index=idx,
                                 content_index=0, text=text))
            elif item["type"] == "message":
                part = item["content"][0]
                part["logprobs"] = _logprobs(last, 0, logprobs) if last is not None else []
                frames += [ev("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                              text=part["text"], logprobs=part["logprobs"]),
                           ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                              part=part)]
            else:
                frames.append(ev("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                                 name=item["name"], arguments=item["arguments"]))
            frames.append(ev("response.output_item.done", output_index=idx, item=item))
            return frames

        def open_(item: dict[str, Any]) -> list[str]:
            nonlocal open_item
            frames = close()
            output.append(item)
            open_item = item
            idx = len(output) - 1
            frames.append(ev("response.output_item.added", output_index=idx, item=item))
            if item["type"] == "message":
                frames.append(ev("response.content_part.added", item_id=item["id"], output_index=idx,
                                 content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
            return frames

        last: CompletionOutput | None = None
        try:
            yield ev("response.created", response=base)
            yield ev("response.in_progress", response=base)
            async for last, delta in parsed_outputs(stream, [parser]):
                if delta.reasoning:
                    if open_item is None or open_item["type"] != "reasoning":
                        for f in open_(_reasoning_item(f"rs_{rid}_{len(output)}", "", "in_progress")):
                            yield f
                    open_item["content"][0]["text"] += delta.reasoning
                    yield ev("response.reasoning_text.delta", item_id=open_item["id"], output_index=len(output) - 1,
                             content_index=0, delta=delta.reasoning)
                if delta.content:
                    if open_item is None or open_item["type"] != "message":
                        for f in open_(_message_item(f"msg_{rid}_{len(output)}", "", "in_progress")):
                            yield f
                    open_item["content"][0]["text"] += delta.content
                    yield ev("response.output_text.delta", item_id=open_item["id"], output_index=len(output) - 1,
                             content_index=0, delta=delta.content, logprobs=_logprobs(last, sent_tokens, logprobs))
                    sent_tokens = len(last.token_ids)
                for t in delta.tool_calls:
                    if t.id is not None:
                        for f in open_(_call_item(f"fc_{t.id}", t.id, t.name, "", "in_progress")):
                            yield f
                    if t.arguments and open_item is not None and open_item["type"] == "function_call":
                        open_item["arguments"] += t.arguments
                        yield ev("response.function_call_arguments.delta", item_id=open_item["id"],
                                 output_index=len(output) - 1, delta=t.arguments)
            if not any(item["type"] != "reasoning" for item in output):  # an answer is at least one message
                for f in open_(_message_item(f"msg_{rid}_0", "", "in_progress")):
                    yield f
            for f in close():
                yield f
            final = self._response(body, rid, last, parser, len(prompt.token_ids), output,
                                   cached=stream.num_cached_tokens)
            self._store(body, rid, conversation, parser, final)
            yield ev(f"response.{final['status']}", response=final)
        except RequestFailed as e:
            for f in close():
                yield f
            failed = self._response(body, rid, last, parser, len(prompt.token_ids), output, "failed",
                                    cached=stream.num_cached_tokens)
            failed["error"] = {"code": "server_error", "message": str(e)}
            yield ev("response.failed", response=failed)
        finally:
            stream.close()


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(item_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def _logprobs(c: CompletionOutput, start: int, top: int | None) -> list[dict[str, Any]]:
    """output_text logprobs of generated tokens [start, end) of `c` ([] when not asked for): every token of
    the answer, reasoning included, as the chat route's logprobs.content and vLLM's Responses report them."""
    return logprobs_content(c, start, len(c.token_ids), top) if top is not None else []


def _call_item(item_id: str, call_id: str, name: str | None, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def responses_router(state: ServerState) -> APIRouter:
    router = APIRouter()
    responses = Responses(state)
    router.add_api_route("/v1/responses", responses, methods=["POST"])
    router.add_api_route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"])
    router.add_api_route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"])
    return router

"""Black-box checks of spec/server.md §7 D on /v1/messages and count_tokens, with the anthropic SDK and raw SSE."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from .conftest import MAX_MODEL_LEN, MODEL, sse_lines

HI = [{"role": "user", "content": "hi"}]
NO_THINK = {"thinking": {"type": "disabled"}}


def events_of(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event, data) pairs; asserts every frame has its `event:` line right before `data:`."""
    lines = [line for line in sse_lines(response) if not line.startswith(":")]
    assert len(lines) % 2 == 0, lines
    out = []
    for ev, data in zip(lines[::2], lines[1::2]):
        assert ev.startswith("event: ") and data.startswith("data: "), (ev, data)
        payload = json.loads(data[6:])
        assert payload["type"] == ev[7:]
        out.append((ev[7:], payload))
    return out


def assert_anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and set(body["error"]) == {"type", "message"}
    message = body["error"]["message"]
    assert "{'" not in message and "input_value" not in message  # no Python repr
    return message


def test_messages_basic(ac):
    m = ac.messages.create(model=MODEL, max_tokens=6, messages=HI)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.content[0].type in ("thinking", "text") and any(b.type == "text" for b in m.content)
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.input_tokens > 0
    assert 0 < m.usage.output_tokens <= 6


def test_messages_stream_event_sequence(server, ac):
    req = {"model": MODEL, "max_tokens": 6, "messages": HI, "extra_body": {"temperature": 0}, **NO_THINK}
    raw = {"model": MODEL, "max_tokens": 6, "messages": HI, "temperature": 0, "stream": True, **NO_THINK}
    with httpx.stream("POST", server.url + "/v1/messages", json=raw) as r:
        assert r.status_code == 200
        events = events_of(r)
    kinds = [k for k, _ in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[0][1]["message"]["usage"]["output_tokens"] == 0
    starts = [p["index"] for k, p in events if k == "content_block_start"]
    stops = [p["index"] for k, p in events if k == "content_block_stop"]
    assert starts == stops == list(range(len(starts))) and starts
    opened = set()
    for k, p in events:  # deltas address an open block
        if k == "content_block_start":
            opened.add(p["index"])
        elif k == "content_block_delta":
            assert p["index"] in opened
        elif k == "content_block_stop":
            opened.discard(p["index"])
    final = events[-2][1]
    plain = ac.messages.create(**req)
    assert final["usage"]["output_tokens"] == plain.usage.output_tokens
    assert final["delta"]["stop_reason"] == plain.stop_reason
    with ac.messages.stream(**req) as s:
        message = s.get_final_message()
    assert [b.type for b in plain.content] == ["text"] and plain.content[0].text
    assert [b.model_dump(exclude={"parsed_output"}) for b in message.content] == \
        [b.model_dump() for b in plain.content]


def test_count_tokens_matches_usage(ac):
    tools = [{"name": "get_weather", "input_schema": {"properties": {"city": {"type": "string"}}}}]
    n = ac.messages.count_tokens(model=MODEL, messages=HI, tools=tools).input_tokens
    assert n == ac.messages.create(model=MODEL, max_tokens=1, messages=HI, tools=tools).usage.input_tokens
    assert n > ac.messages.count_tokens(model=MODEL, messages=HI).input_tokens  # the tools are in the prompt


def test_unknown_model_is_not_found(ac):
    for call in (lambda: ac.messages.create(model="nope", max_tokens=4, messages=HI),
                 lambda: ac.messages.count_tokens(model="nope", messages=HI)):
        with pytest.raises(anthropic.NotFoundError) as e:
            call()
        assert e.value.status_code == 404 and e.value.type == "not_found_error"


@pytest.mark.parametrize("body,says", [
    ({"model": MODEL, "messages": HI}, "max_tokens"),
    ({"model": MODEL, "messages": HI, "max_tokens": -1}, "max_tokens must be positive"),
    ({"model": MODEL, "messages": HI, "max_tokens": 0}, "max_tokens must be positive"),
    ({"model": MODEL, "messages": "x", "max_tokens": 4}, "messages"),
    ({"model": "", "messages": HI, "max_tokens": 4}, "model"),
    ({"model": MODEL, "messages": HI, "max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 512}},
     "budget_tokens must be an integer >= 1024"),
    ({"model": MODEL, "messages": HI, "max_tokens": 1500, "thinking": {"type": "enabled", "budget_tokens": 1500}},
     "must be less than max_tokens"),
    ({"model": MODEL, "messages": HI, "max_tokens": 4, "tool_choice": {"type": "tool"}}, "needs a \"name\""),
    ('{"model":', "not valid JSON"),
])
def test_body_validation_is_400_anthropic_envelope(server, ac, body, says):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else \
        {"json": body}
    message = assert_anthropic_error(httpx.post(server.url + "/v1/messages", **kwargs), 400, "invalid_request_error")
    assert says in message
    assert ac.messages.create(model=MODEL, max_tokens=1, messages=HI).stop_reason in ("end_turn", "max_tokens")


def test_error_envelope_covers_framework_errors(server):
    url = server.url + "/v1/messages"
    assert_anthropic_error(httpx.post(url, content="{}", headers={"content-type": "text/plain"}), 400,
                           "invalid_request_error")
    assert_anthropic_error(httpx.post(url + "/nope", json={}), 404, "not_found_error")
    assert_anthropic_error(httpx.get(url), 405, "invalid_request_error")
    assert_anthropic_error(httpx.post(url + "/count_tokens", json={"model": MODEL}), 400, "invalid_request_error")
    # query strings and anthropic-* headers are tolerated
    r = httpx.post(url + "?beta=true", json={"model": MODEL, "max_tokens": 1, "messages": HI},
                   headers={"anthropic-version": "2023-06-01", "anthropic-beta": "x"})
    assert r.status_code == 200 and r.headers["request-id"]


@pytest.mark.parametrize("stream", [False, True])
def test_too_long_prompt(server, ac, stream):
    text = "hello " * (MAX_MODEL_LEN + 10)
    with pytest.raises(anthropic.BadRequestError) as e:
        ac.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": text}], stream=stream)
    assert e.value.type == "invalid_request_error" and "maximum context length" in e.value.message


def test_thinking_blocks(server, ac):
    short = ac.messages.create(model=MODEL, max_tokens=6, messages=HI, extra_body={"temperature": 0})
    stop = short.content[0].thinking[-2:]  # ends the long request early (the model never closes </think>)
    m = ac.messages.create(model=MODEL, max_tokens=2048, messages=HI, extra_body={"temperature": 0},
                           thinking={"type": "enabled", "budget_tokens": 1024}, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].type == "thinking" and m.content[0].thinking and m.content[0].signature
    assert [b.type for b in m.content] == ["thinking", "text"]  # strict clients index a text block
    with httpx.stream("POST", server.url + "/v1/messages",
                      json={"model": MODEL, "max_tokens": 4, "messages": HI, "stream": True}) as r:
        events = events_of(r)
    deltas = [p["delta"]["type"] for k, p in events if k == "content_block_delta" and p["index"] == 0]
    assert events[1][1]["content_block"]["type"] == "thinking"
    assert deltas[0] == "thinking_delta" and deltas[-1] == "signature_delta"
    with ac.messages.stream(model=MODEL, max_tokens=4, messages=HI) as s:
        final = s.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].signature


def test_tool_result_history(ac):
    tools = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    messages = HI + [{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                        "input": {"city": "Paris"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                   "content": "18C"}]}]
    m = ac.messages.create(model=MODEL, max_tokens=2, messages=messages, tools=tools)
    assert m.usage.input_tokens > ac.messages.count_tokens(model=MODEL, messages=HI, tools=tools).input_tokens


def test_mid_stream_error_event(server, ac):
    headers = {"x-revolta-fail-after-tokens": "2"}
    body = {"model": MODEL, "max_tokens": 8, "messages": HI, "stream": True}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers=headers) as r:
        events = events_of(r)
    kinds = [k for k, _ in events]
    assert kinds[-1] == "error" and "message_stop" not in kinds
    assert events[-1][1]["error"]["type"] == "api_error"
    if "content_block_start" in kinds:
        assert kinds[-2] == "content_block_stop"
    with pytest.raises(anthropic.APIStatusError) as e:
        with ac.messages.stream(model=MODEL, max_tokens=8, messages=HI, extra_headers=headers) as s:
            s.get_final_message()
    assert e.value.status_code == 200 and e.value.type == "api_error"
    overloaded = {**headers, "x-revolta-fail-status": "503"}  # a 503-class failure maps to overloaded_error
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers=overloaded) as r:
        assert events_of(r)[-1][1]["error"]["type"] == "overloaded_error"

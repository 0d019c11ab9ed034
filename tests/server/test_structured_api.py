"""Structured outputs and thinking budgets through the real server (spec/server.md §7 checks 13 and 25):
response_format, vLLM's structured_outputs / guided_* extras, Responses text.format, Anthropic
thinking.budget_tokens, and 400s naming the field. The random-weight model writes valid JSON only
because the grammar makes it; the server runs with compact JSON (no free whitespace), since random
weights would otherwise fill every whitespace slot up to max_tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from .conftest import MODEL, Server, run_scripted, run_server

pytest.importorskip("xgrammar")

HI = [{"role": "user", "content": "Give me a JSON object."}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["a", "ok"],
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"},
                         "c": {"enum": ["x", "y"]}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}


def valid(text: str | None) -> dict:
    value = json.loads(text)
    assert isinstance(value, dict) and {"a", "ok"} <= set(value) <= {"a", "ok", "c"}, value
    assert isinstance(value["a"], int) and not isinstance(value["a"], bool) and 0 <= value["a"] <= 9
    assert isinstance(value["ok"], bool) and value.get("c", "x") in ("x", "y")
    return value


@pytest.fixture(scope="module")
def compact() -> Iterator[Server]:
    with run_server("--sse-keep-alive-interval", "0",
                    "--structured-outputs-config", '{"disable_any_whitespace": true}') as s:
        yield s


@pytest.fixture(scope="module")
def client(compact):
    return openai.OpenAI(base_url=compact.url + "/v1", api_key="x", max_retries=0)


def test_json_schema_thinking_off_and_on(client):
    """Check 13: content parses and validates, with thinking off and on (reasoning kept apart)."""
    off = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=40, temperature=0,
                                         response_format=FORMAT, extra_body=NO_THINK)
    assert off.choices[0].finish_reason == "stop"
    valid(off.choices[0].message.content)
    assert not getattr(off.choices[0].message, "reasoning", None)
    # thinking on: the random model never writes </think>; the budget forces it after 4 tokens
    on = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=48, temperature=0,
                                        response_format=FORMAT, extra_body={"thinking_token_budget": 4})
    message = on.choices[0].message
    assert on.choices[0].finish_reason == "stop" and message.reasoning and "</think>" not in message.content
    valid(message.content)
    stream = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=48, temperature=0, stream=True,
                                            response_format=FORMAT, extra_body={"thinking_token_budget": 4})
    kinds, content = [], ""
    for chunk in stream:
        for choice in chunk.choices:
            d = choice.delta
            if getattr(d, "reasoning", None):
                kinds.append("reasoning")
            if d.content:
                kinds.append("content")
                content += d.content
    assert content == message.content and kinds.index("content") > kinds.index("reasoning")
    assert "reasoning" not in kinds[kinds.index("content"):]


def test_json_object_extras_and_responses(client, compact):
    # any object: random weights never end the first key, so only its start is checked
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=0, extra_body=NO_THINK,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith('{"') and r.choices[0].finish_reason == "length"
    for extra, ok in (({"structured_outputs": {"choice": ["alpha", "beta"]}}, ("alpha", "beta")),
                      ({"guided_choice": ["left", "right"]}, ("left", "right"))):
        r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, temperature=0,
                                           extra_body={**NO_THINK, **extra})
        assert r.choices[0].message.content in ok
    r = client.completions.create(model=MODEL, prompt="digits:", max_tokens=8, temperature=0,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert len(r.choices[0].text) == 3 and r.choices[0].text.isdigit()
    resp = client.responses.create(model=MODEL, input="Give me JSON", max_output_tokens=40, temperature=0,
                                   extra_body=NO_THINK,
                                   text={"format": {"type": "json_schema", "name": "p", "schema": SCHEMA}})
    assert resp.status == "completed"
    valid(resp.output_text)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"thinking_token_budget": -1}, "thinking_token_budget"),
    ({"response_format": {"type": "json_object"}, "tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tool_choice"),
])
def test_bad_specs_are_400_naming_the_field(compact, extra, param):
    r = httpx.post(compact.url + "/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    r = httpx.post(compact.url + "/v1/responses", json={"model": MODEL, "input": "x", "text": {
        "format": {"type": "json_schema", "name": "p", "schema": {"type": "foo"}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format.schema"


def test_anthropic_budget_tokens_reaches_the_engine():
    """Check 25: budget_tokens becomes the engine's thinking_token_budget (the engine forces </think> there:
    tests/test_structured.py); < 1024 or >= max_tokens stays a 400."""
    with run_scripted() as (llm, url):
        llm.scripts.append("thinking</think>\n\nhello")
        r = httpx.post(url + "/v1/messages", json={"model": "scripted", "max_tokens": 2048, "messages": HI,
                                                   "thinking": {"type": "enabled", "budget_tokens": 1024}})
        assert r.status_code == 200 and [b["type"] for b in r.json()["content"]] == ["thinking", "text"]
        assert llm.sampling_params[-1].thinking_token_budget == 1024
        for budget, max_tokens in ((512, 2048), (2048, 2048)):
            r = httpx.post(url + "/v1/messages", json={"model": "scripted", "max_tokens": max_tokens, "messages": HI,
                                                       "thinking": {"type": "enabled", "budget_tokens": budget}})
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        llm.scripts.append("hello")
        r = httpx.post(url + "/v1/messages", json={"model": "scripted", "max_tokens": 64, "messages": HI})
        assert r.status_code == 200 and llm.sampling_params[-1].thinking_token_budget is None

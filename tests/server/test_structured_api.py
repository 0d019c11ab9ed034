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

import xgrammar  # noqa: E402,F401  (a test dependency: fail, do not skip, when CI lacks it)

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
    body = {"model": MODEL, "messages": HI, "max_tokens": 4, **extra}
    r = httpx.post(compact.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    r = httpx.post(compact.url + "/v1/responses", json={"model": MODEL, "input": "x", "text": {
        "format": {"type": "json_schema", "name": "p", "schema": {"type": "foo"}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format.schema"


def test_anthropic_budget_tokens_reaches_the_engine():
    """Check 25: budget_tokens becomes the engine's thinking_token_budget (the engine forces </think> there:
    tests/engine/test_structured.py); < 1024 or >= max_tokens stays a 400."""
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


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["days", "metric"],
    "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 9}, "metric": {"type": "boolean"},
                   "unit": {"enum": ["c", "f"]}}}}}
NOOP = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}


def typed_arguments(call) -> dict:
    args = json.loads(call.function.arguments)
    assert {"days", "metric"} <= set(args) <= {"days", "metric", "unit"}, args
    assert isinstance(args["days"], int) and 1 <= args["days"] <= 9 and isinstance(args["metric"], bool), args
    assert args.get("unit", "c") in ("c", "f"), args
    return args


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls_follow_the_schema(client, stream):
    """Checks 17 and 18 on random weights: the grammar, not the model, makes the calls parse and type-check."""
    def ask(**kwargs):
        kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, NOOP],
                  "max_tokens": 64, "temperature": 0, **kwargs}
        if not stream:
            return client.chat.completions.create(**kwargs).choices[0]
        with client.chat.completions.stream(**kwargs) as s:
            return s.get_final_completion().choices[0]

    named = ask(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = named.message.tool_calls
    assert call.function.name == "get_weather" and named.finish_reason == "stop"
    typed_arguments(call)
    one = ask(tool_choice="required", parallel_tool_calls=False)
    assert one.finish_reason == "tool_calls" and len(one.message.tool_calls) == 1
    assert one.message.tool_calls[0].function.name in ("get_weather", "noop")
    for c in one.message.tool_calls:
        if c.function.name == "get_weather":
            typed_arguments(c)
        else:
            assert json.loads(c.function.arguments) == {}


def test_forced_call_grammar_matches_the_chat_template():
    """The call grammar accepts exactly what the chat template writes for a call (so the output parser
    reads it), and refuses missing required parameters, wrong types, values outside an enum and, without
    parallel calls, a second call."""
    import xgrammar as xgr

    from revolta.presets.default import ensure_default_model
    from revolta.server.chat_prompt import tool_setup
    from revolta.server.tool_grammar import forced_call_constraint
    from revolta.tokenizer import Tokenizer

    opts = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    weather = WEATHER["function"]["parameters"]
    city = {**weather, "$defs": {"Opts": opts}, "properties": {
        "city": {"type": "string"}, **weather["properties"], "opts": {"$ref": "#/$defs/Opts"}}}
    free = {"type": "function", "function": {"name": "free", "parameters": {"type": "object"}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": city}}, NOOP, free]
    args = {"city": "Paris </function> ok", "days": 3, "metric": True, "unit": "f", "opts": {"n": 2}}
    tok = Tokenizer.from_pretrained(ensure_default_model(progress=False))
    called = {"role": "assistant", "content": "",
              "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": args}}]}
    rendered = tok.apply_chat_template([{"role": "user", "content": "x"}, called], tools=tools)
    call = rendered[rendered.rindex("<tool_call>\n<function=") + len("<tool_call>\n<function="):]  # not the example
    call = call[:call.index("</tool_call>") + len("</tool_call>")]
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([b"a"]), cache_enabled=False)

    def accepts(text: str, choice="required", parallel=True) -> bool:
        spec = forced_call_constraint(tool_setup(tools, choice, parallel))
        m = xgr.GrammarMatcher(compiler.compile_structural_tag(json.dumps(spec.structural_tag)))
        return m.accept_string(text) and m.is_completed()

    assert accepts(call) and accepts(call, parallel=False)
    named = call.removeprefix("get_weather>\n")
    assert accepts(named, {"type": "function", "function": {"name": "get_weather"}})
    assert accepts("noop>\n</function>\n</tool_call>") and not accepts("noop>\n<parameter=x>\n1\n</parameter>\n"
                                                                   "</function>\n</tool_call>")
    assert accepts("free>\n<parameter=x>\nany\n</parameter>\n<parameter=y>\n2\n</parameter>\n</function>\n</tool_call>")
    assert accepts(call + "\n<tool_call>\n<function=" + call) and not accepts(call + "\n<tool_call>\n<function=" + call,
                                                                             parallel=False)
    for bad in (call.replace("<parameter=days>\n3\n</parameter>\n", ""), call.replace("\n3\n", "\nthree\n"),
                call.replace("\nf\n", "\ng\n"), call.replace('{"n": 2}', '{"m": 2}'), "unknown>\n" + call[12:]):
        assert not accepts(bad), bad


def _typed(args: dict) -> dict:
    return typed_arguments(type("Call", (), {"function": type("F", (), {"arguments": json.dumps(args)})})())


def test_forced_anthropic_tool_use_on_the_real_model(compact):
    """Check 24 through the real model: tool_choice {"type": "tool"} / {"type": "any"} makes the random weights
    write a call (the grammar does), which comes back as a typed tool_use block with stop_reason tool_use, streamed
    as input_json_delta fragments whose concatenation is the same JSON; a tool_result turn after it is a 200."""
    import anthropic

    ac = anthropic.Anthropic(base_url=compact.url, api_key="x", max_retries=0)
    tools = [{"name": f["function"]["name"], "input_schema": f["function"]["parameters"]} for f in (WEATHER, NOOP)]
    ask = {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}], "tools": tools,
           "extra_body": {"temperature": 0}}
    m = ac.messages.create(**ask, tool_choice={"type": "tool", "name": "get_weather"})
    [use] = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use.name == "get_weather" and use.id  # vLLM-style chatcmpl-tool-<hex> ids
    _typed(use.input)
    with ac.messages.stream(**ask, tool_choice={"type": "tool", "name": "get_weather"}) as s:
        fragments = [e.delta.partial_json for e in s if e.type == "content_block_delta"
                     and e.delta.type == "input_json_delta"]
        final = s.get_final_message()
    [streamed] = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and fragments and json.loads("".join(fragments)) == streamed.input
    assert streamed.input == use.input  # greedy: the stream and the plain call agree
    anyone = ac.messages.create(**ask, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert anyone.stop_reason == "tool_use" and len([b for b in anyone.content if b.type == "tool_use"]) == 1
    history = ask["messages"] + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18C"}]}]
    follow = ac.messages.create(**{**ask, "messages": history, "max_tokens": 2})
    assert follow.usage.output_tokens >= 1


def test_forced_responses_function_call_on_the_real_model(client):
    """Check 32 through the real model: a forced function tool gives a function_call item with typed arguments,
    streamed as function_call_arguments deltas that add up to the final item's arguments."""
    tools = [{"type": "function", "name": f["function"]["name"], "parameters": f["function"]["parameters"]}
             for f in (WEATHER, NOOP)]
    ask = {"model": MODEL, "input": "hi", "tools": tools, "max_output_tokens": 64, "temperature": 0,
           "tool_choice": {"type": "function", "name": "get_weather"}}
    r = client.responses.create(**ask)
    [call] = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    _typed(json.loads(call.arguments))
    deltas, done = [], None
    for e in client.responses.create(**ask, stream=True):
        if e.type == "response.function_call_arguments.delta":
            deltas.append(e.delta)
        elif e.type == "response.completed":
            done = e.response
    [streamed] = [item for item in done.output if item.type == "function_call"]
    assert deltas and "".join(deltas) == streamed.arguments and streamed.arguments == call.arguments

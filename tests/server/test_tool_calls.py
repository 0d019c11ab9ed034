"""spec/server.md §7 C (tool calling), D24 and E32 end to end: the real server app under uvicorn, the
official SDKs, and a scripted engine (scripted_llm.py) that writes qwen3_coder calls."""

from __future__ import annotations

import json

import httpx
import pytest

from .conftest import anthropic_client, openai_client

M = "scripted"  # the conftest `scripted` server's name
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "opts": {"type": "object"}},
    "required": ["city"]}}}
ASK = [{"role": "user", "content": "weather in Paris for 3 days, metric"}]
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=opts>\n{\"unit\": \"C\"}\n</parameter>\n"
        "</function>\n</tool_call>")
ARGS = {"city": "Paris", "days": 3, "metric": True, "opts": {"unit": "C"}}
THOUGHT = "The user wants weather.</think>\n\n"


@pytest.fixture(scope="module")
def oc(scripted):
    return openai_client(scripted[1])


@pytest.fixture(scope="module")
def ac(scripted):
    return anthropic_client(scripted[1])


def tool_chunks(oc, **req):
    return [c for c in oc.chat.completions.create(model=M, stream=True, **req) if c.choices]


def test_auto_call_typed_by_schema(oc, say):
    say(THOUGHT + CALL)
    r = oc.chat.completions.create(model=M, messages=ASK, tools=[WEATHER], max_tokens=200)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert c.message.model_extra["reasoning"] == "The user wants weather."
    [call] = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    assert json.loads(call.function.arguments) == ARGS


def test_auto_call_streamed(oc, say):
    say(THOUGHT + CALL, THOUGHT + CALL)
    plain = oc.chat.completions.create(model=M, messages=ASK, tools=[WEATHER], max_tokens=200)
    chunks = tool_chunks(oc, messages=ASK, tools=[WEATHER], max_tokens=200)
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    first = deltas[0]
    assert first.index == 0 and first.id and first.type == "function" and first.function.name == "get_weather"
    assert first.function.arguments == ""
    assert "".join(d.function.arguments or "" for d in deltas) == plain.choices[0].message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning") or "" for c in chunks)
    assert reasoning == "The user wants weather."
    assert not any(c.choices[0].delta.content for c in chunks)  # no markup leaks as content
    say(THOUGHT + CALL)
    with oc.chat.completions.stream(model=M, messages=ASK, tools=[WEATHER], max_tokens=200) as s:
        final = s.get_final_completion()
    assert json.loads(final.choices[0].message.tool_calls[0].function.arguments) == ARGS


def test_parallel_calls(oc, say):
    rome = CALL.replace("Paris", "Rome")
    say(CALL + "\n" + rome, CALL + "\n" + rome)
    r = oc.chat.completions.create(model=M, messages=ASK, tools=[WEATHER], max_tokens=300, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}})
    calls = r.choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    assert len({c.id for c in calls}) == 2
    chunks = tool_chunks(oc, messages=ASK, tools=[WEATHER], max_tokens=300,
                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    starts = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or []) if tc.id]
    assert [s.index for s in starts] == [0, 1] and len({s.id for s in starts}) == 2
    forced = CALL.removeprefix("<tool_call>\n<function=") + "\n" + rome  # required opens the call itself
    say(forced, forced)  # parallel_tool_calls=false under required: one call
    kwargs = {"messages": ASK, "tools": [WEATHER], "max_tokens": 300, "tool_choice": "required",
              "parallel_tool_calls": False}
    r = oc.chat.completions.create(model=M, **kwargs)
    assert [json.loads(c.function.arguments)["city"] for c in r.choices[0].message.tool_calls] == ["Paris"]
    chunks = tool_chunks(oc, **kwargs)
    assert {tc.index for c in chunks for tc in (c.choices[0].delta.tool_calls or [])} == {0}


def test_named_tool_choice_is_forced(scripted, oc, say):
    llm, _ = scripted
    say("<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>")
    r = oc.chat.completions.create(model=M, messages=ASK, tools=[WEATHER], max_tokens=100,
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}
    assert r.choices[0].finish_reason == "stop"  # a forced named tool, as OpenAI reports it
    prompt = llm.tokenizer.decode(llm.prompts[-1], skip_special_tokens=False)
    assert prompt.endswith("<tool_call>\n<function=get_weather>\n")


def test_required_tool_choice(oc, say):
    say("get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>", "I cannot call tools")
    r = oc.chat.completions.create(model=M, messages=ASK, tools=[WEATHER], max_tokens=100, tool_choice="required")
    assert r.choices[0].finish_reason == "tool_calls"
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    failed = oc.chat.completions.create(model=M, messages=ASK, tools=[WEATHER], max_tokens=100,
                                        tool_choice="required")
    c = failed.choices[0]  # an unparsable forced call is reported as the text it is, not as tool_calls
    assert c.finish_reason == "stop" and not c.message.tool_calls and "I cannot call tools" in c.message.content


def test_tool_choice_none_leaves_markup_in_content(oc, say):
    say(CALL)
    r = oc.chat.completions.create(model=M, messages=ASK, tools=[WEATHER], max_tokens=200, tool_choice="none",
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].finish_reason == "stop" and "<function=get_weather>" in r.choices[0].message.content


def test_literal_function_close_inside_a_string_argument(oc, say):
    value = "use </function> and </parameter> literally"
    say(CALL.replace("\nParis\n", f"\n{value}\n"))
    r = oc.chat.completions.create(model=M, messages=ASK, tools=[WEATHER], max_tokens=300,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments)["city"] == value


def test_cut_off_call(oc, say):
    say(CALL, CALL)
    extra = {"chat_template_kwargs": {"enable_thinking": False}}
    r = oc.chat.completions.create(model=M, messages=ASK, tools=[WEATHER], max_tokens=24, extra_body=extra)
    c = r.choices[0]  # non-streaming reports complete calls only: the cut-off one stays text
    assert c.finish_reason == "length" and not c.message.tool_calls and c.message.content.startswith("<tool_call>")
    chunks = tool_chunks(oc, messages=ASK, tools=[WEATHER], max_tokens=24, extra_body=extra)
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    args = "".join(tc.function.arguments or "" for tc in deltas)
    assert deltas[0].function.name == "get_weather"  # a stream already announced the call: it is closed as JSON
    assert chunks[-1].choices[0].finish_reason == "length" and json.loads(args)["city"] == "Paris"


def test_multi_turn_history(scripted, oc, say):
    llm, _ = scripted
    say("It is 18C in Paris.")
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    r = oc.chat.completions.create(model=M, messages=history, tools=[WEATHER], max_tokens=50,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert "18" in r.choices[0].message.content
    prompt = llm.tokenizer.decode(llm.prompts[-1], skip_special_tokens=False)
    assert "<parameter=days>\n3\n</parameter>" in prompt and "<tool_response>\n18C\n</tool_response>" in prompt


def test_anthropic_tool_use(scripted, ac, say):
    tools = [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]
    say(CALL, CALL, CALL, "18C it is")
    m = ac.messages.create(model=M, max_tokens=200, messages=ASK, tools=tools, tool_choice={"type": "any"})
    assert m.stop_reason == "tool_use"
    [block] = [b for b in m.content if b.type == "tool_use"]
    assert block.name == "get_weather" and block.input == ARGS
    with httpx.stream("POST", scripted[1] + "/v1/messages", json={"model": M, "max_tokens": 200, "messages": ASK,
                                                                  "tools": tools, "stream": True}) as r:
        frames = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    starts = [f for f in frames if f["type"] == "content_block_start" and f["content_block"]["type"] == "tool_use"]
    assert starts and starts[0]["content_block"]["input"] == {}
    partial = "".join(f["delta"]["partial_json"] for f in frames
                      if f["type"] == "content_block_delta" and f["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == ARGS
    assert [f for f in frames if f["type"] == "message_delta"][0]["delta"]["stop_reason"] == "tool_use"
    with ac.messages.stream(model=M, max_tokens=200, messages=ASK, tools=tools) as s:
        final = s.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [ARGS]
    followup = ASK + [{"role": "assistant", "content": [{"type": "tool_use", "id": block.id, "name": "get_weather",
                                                         "input": block.input}]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "18C"}]}]
    answer = ac.messages.create(model=M, max_tokens=50, messages=followup, tools=tools, thinking={"type": "disabled"})
    assert answer.content[-1].text == "18C it is" and answer.stop_reason == "end_turn"


def test_responses_function_call(oc, say):
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    say(THOUGHT + CALL, THOUGHT + CALL)
    r = oc.responses.create(model=M, input="weather in Paris", tools=[tool], max_output_tokens=200)
    calls = [o for o in r.output if o.type == "function_call"]
    assert [o.type for o in r.output] == ["reasoning", "function_call"]
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == ARGS
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    events = list(oc.responses.create(model=M, input="weather in Paris", tools=[tool], max_output_tokens=200,
                                      stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(args) == ARGS and done[0].arguments == args
    assert events[-1].type == "response.completed"


def test_stop_strings_do_not_cut_tool_arguments(oc, say):
    extra = {"chat_template_kwargs": {"enable_thinking": False}}
    say(CALL, "Hello world. Bye" + CALL, "Hello world. Bye" + CALL)
    r = oc.chat.completions.create(model=M, messages=ASK, tools=[WEATHER], max_tokens=200, stop=["Paris", "."],
                                   extra_body=extra)
    assert r.choices[0].finish_reason == "tool_calls"
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == ARGS  # "Paris" kept in the call
    r = oc.chat.completions.create(model=M, messages=ASK, tools=[WEATHER], max_tokens=200, stop=["."],
                                   extra_body=extra)
    c = r.choices[0]  # in content the stop string still ends the answer
    assert (c.message.content, c.finish_reason, c.model_extra["stop_reason"]) == ("Hello world", "stop", ".")
    assert not c.message.tool_calls
    chunks = tool_chunks(oc, messages=ASK, tools=[WEATHER], max_tokens=200, stop=["."], extra_body=extra)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello world"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_reasoning_streams_before_content(oc, say):
    """B14's streaming half: every reasoning delta comes before the first content delta, and both equal the
    non-streaming split."""
    say(THOUGHT + "It is sunny.", THOUGHT + "It is sunny.")
    plain = oc.chat.completions.create(model=M, messages=ASK, max_tokens=100).choices[0].message
    kinds, reasoning, content = [], "", ""
    for c in oc.chat.completions.create(model=M, messages=ASK, max_tokens=100, stream=True):
        if not c.choices:
            continue
        d = c.choices[0].delta
        if d.model_extra.get("reasoning"):
            kinds.append("reasoning")
            reasoning += d.model_extra["reasoning"]
        if d.content:
            kinds.append("content")
            content += d.content
    assert kinds == sorted(kinds, key=lambda k: k == "content") and "reasoning" in kinds and "content" in kinds
    assert (reasoning, content) == (plain.model_extra["reasoning"], plain.content) == \
        ("The user wants weather.", "It is sunny.")

"""The qwen3_coder tool-call parser, tool definitions and tool_choice, and the qwen3 reasoning parser
(src/revolta/server/tool_calls.py, tool_schema.py, reasoning.py): complete and streaming parses, every
split point, typed arguments, malformed input. CPU only, no model; the chat template is the preset's.
"""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from revolta.server.reasoning import (
    ReasoningDelta,
    ReasoningParser,
    prompt_opens_thinking,
    split_reasoning,
    start_phase,
)
from revolta.server.tool_calls import (
    ContentDelta,
    ToolCall,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallParser,
    ToolCallStart,
    new_tool_call_id,
    parse_tool_calls,
)
from revolta.server.tool_schema import (
    ToolChoice,
    ToolRequestError,
    ToolSet,
    anthropic_tool_choice_to_openai,
    anthropic_tools_to_openai,
    convert_value,
    resolve_tool_choice,
    responses_tools_to_openai,
    schema_types,
    validate_tool_choice,
)
from revolta.tokenizer import PRESET_CHAT_TEMPLATE, render_chat_template

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "opts": {"type": "object"},
            },
            "required": ["city"],
        },
    },
}
WRITE = {
    "type": "function",
    "function": {
        "name": "write_file",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}, "lines": {"type": "array"}},
        },
    },
}
TOOLS = ToolSet.from_openai([WEATHER, WRITE])
TEMPLATE = PRESET_CHAT_TEMPLATE.read_text(encoding="utf-8")


def call_text(name: str, params: list[tuple[str, str]]) -> str:
    """A call as our chat template renders it."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


PARIS = call_text("get_weather", [("city", "Paris"), ("days", "3"), ("metric", "true"), ("opts", '{"unit": "C"}')])
ROME = call_text("get_weather", [("city", "Rome"), ("days", "1")])
CODE = "def f(x):\n    if x < 3 and y > 2:\n        return '</function>'\n    return \"<tool_call>\" # é🙂\n"
WRITE_CALL = call_text("write_file", [("path", "/tmp/a.py"), ("content", CODE)])

# Sample generations: text before a call, parallel calls, a big string value full of markup,
# unicode, text after a call, a bare <function=...> call, no call at all.
SAMPLES = [
    "I'll check the weather.\n\n" + PARIS,
    PARIS + "\n" + ROME,
    "Writing it now.\n\n" + WRITE_CALL + "\n" + PARIS,
    "Voilà — 天气: <b>bold</b> a < b and c > d.\n\n" + PARIS + "\n\nDone, 🙂.",
    "<function=get_weather>\n<parameter=city>\nKyōto\n</parameter>\n</function>",
    "No tools needed: x<y, </think> <tool and <function is text.",
    "",
]


def sequential_ids():
    counter = itertools.count()
    return lambda: f"call-{next(counter)}"


def run_stream(text: str, pieces: list[str], tools: ToolSet = TOOLS) -> list:
    """Feed `pieces` (which join to `text`) and finish; returns all events."""
    assert "".join(pieces) == text
    parser = ToolCallParser(tools, id_factory=sequential_ids())
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def assemble(events: list) -> tuple[str, list[tuple[str, str, bool]]]:
    """Content and (name, arguments, complete) per call, checking the event protocol on the way."""
    content, calls, open_calls = [], [], {}
    for e in events:
        if isinstance(e, ContentDelta):
            assert e.text, "empty content delta"
            content.append(e.text)
        elif isinstance(e, ToolCallStart):
            assert e.index == len(calls) + len(open_calls) and e.index not in open_calls
            open_calls[e.index] = (e.id, e.name, [])
        elif isinstance(e, ToolCallArgumentsDelta):
            assert e.text and e.index in open_calls
            open_calls[e.index][2].append(e.text)
        elif isinstance(e, ToolCallEnd):
            call_id, name, parts = open_calls.pop(e.index)
            assert e.call == ToolCall(call_id, name, "".join(parts))
            json.loads(e.call.arguments)  # always valid JSON, even for an incomplete call
            calls.append((name, e.call.arguments, e.complete))
        else:
            raise AssertionError(f"unknown event {e!r}")
    assert not open_calls, "a call was never ended"
    return "".join(content), calls


def expected(text: str, tools: ToolSet = TOOLS) -> tuple[str, list[tuple[str, str, bool]]]:
    parsed = parse_tool_calls(text, tools, id_factory=sequential_ids())
    return parsed.content, [(c.name, c.arguments, True) for c in parsed.calls]


def random_pieces(text: str, rng: random.Random, most: int = 7) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, most)
        pieces.append(text[i : i + n])
        i += n
    return pieces


# Complete parses with explicit expectations


def test_weather_call_after_text_is_typed_by_schema():
    parsed = parse_tool_calls(SAMPLES[0], TOOLS)
    assert parsed.content == "I'll check the weather."
    (call,) = parsed.calls
    assert call.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    assert call.arguments == '{"city": "Paris", "days": 3, "metric": true, "opts": {"unit": "C"}}'
    assert json.loads(call.arguments) == {"city": "Paris", "days": 3, "metric": True, "opts": {"unit": "C"}}


def test_parallel_calls_get_distinct_ids_and_drop_separators():
    parsed = parse_tool_calls(SAMPLES[1], TOOLS)
    assert parsed.content == ""
    assert [json.loads(c.arguments)["city"] for c in parsed.calls] == ["Paris", "Rome"]
    assert len({c.id for c in parsed.calls}) == 2
    assert new_tool_call_id() != new_tool_call_id()


def test_string_value_full_of_markup_survives():
    parsed = parse_tool_calls(SAMPLES[2], TOOLS)
    assert parsed.content == "Writing it now."
    assert [c.name for c in parsed.calls] == ["write_file", "get_weather"]
    assert json.loads(parsed.calls[0].arguments) == {"path": "/tmp/a.py", "content": CODE}


def test_text_after_a_call_and_unicode_stay_content():
    parsed = parse_tool_calls(SAMPLES[3], TOOLS)
    assert parsed.content == "Voilà — 天气: <b>bold</b> a < b and c > d.Done, 🙂."
    assert len(parsed.calls) == 1


def test_bare_function_without_tool_call_wrapper():
    parsed = parse_tool_calls(SAMPLES[4], TOOLS)
    assert parsed.content == ""
    assert parsed.calls[0].arguments == '{"city": "Kyōto"}'  # non-ASCII kept, not \\u-escaped


def test_text_without_calls_is_all_content():
    for text in (SAMPLES[5], "", "   ", "a\n\n"):
        assert parse_tool_calls(text, TOOLS) == parse_tool_calls(text, None)
        assert parse_tool_calls(text, TOOLS).content == text
        assert parse_tool_calls(text, TOOLS).calls == ()


@pytest.mark.parametrize(
    "value, stored",
    [
        ("Paris", "Paris"),
        ("\nParis", "\nParis"),  # only one leading newline is markup
        ("Paris\n", "Paris\n"),
        ("\n\n", "\n\n"),
        ("", ""),
        ("  spaced  ", "  spaced  "),  # strings are raw, not stripped
        ("line one\nline two", "line one\nline two"),
        ("a </function> b", "a </function> b"),
        ("x</parameter>y", "x</parameter>y"),
        ("ends with </parameter>", "ends with </parameter>"),
        ("</tool_call><tool_call>", "</tool_call><tool_call>"),
        ("<parameter=evil>", "<parameter=evil>"),
        ('quote " backslash \\ tab \t', 'quote " backslash \\ tab \t'),
    ],
)
def test_string_values_round_trip(value, stored):
    text = call_text("write_file", [("content", value), ("path", "p")])
    (call,) = parse_tool_calls(text, TOOLS).calls
    assert json.loads(call.arguments) == {"content": stored, "path": "p"}
    assert assemble(run_stream(text, list(text)))[1] == [("write_file", call.arguments, True)]


def test_unknown_function_and_unknown_parameters_are_raw_strings():
    text = call_text("lookup", [("n", "3"), ("flag", "true")])
    text += call_text("get_weather", [("city", "X"), ("extra", "7")])
    parsed = parse_tool_calls(text, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("lookup", {"n": "3", "flag": "true"}),
        ("get_weather", {"city": "X", "extra": "7"}),
    ]


def test_call_without_parameters_has_empty_object():
    for text in ("<tool_call>\n<function=get_weather>\n</function>\n</tool_call>",
                 "<tool_call><function=f></tool_call>"):
        (call,) = parse_tool_calls(text, TOOLS).calls
        assert call.arguments == "{}"


def test_lenient_about_missing_closing_tags():
    missing_function = "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</tool_call>after"
    missing_parameter = "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</function>\n</tool_call>"
    missing_tool_call = "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>"
    for text, content in ((missing_function, "after"), (missing_parameter, ""), (missing_tool_call, "")):
        parsed = parse_tool_calls(text, TOOLS)
        assert parsed.content == content, text
        assert [c.arguments for c in parsed.calls] == ['{"days": 2}'], text


def test_repeated_parameter_keeps_both_and_json_takes_the_last():
    text = call_text("get_weather", [("days", "1"), ("days", "2")])
    (call,) = parse_tool_calls(text, TOOLS).calls
    assert call.arguments == '{"days": 1, "days": 2}' and json.loads(call.arguments) == {"days": 2}


# Malformed input: never an exception, never lost text


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',  # hermes JSON form
        "<tool_call>",
        "<tool_call>\n<function=",
        "<tool_call>\n<function=get_weather",
        "<tool_call>\n<function=get\nweather>\n</function>",  # newline in the name
        "<tool_call>\n<function=>\n</function>",  # empty name
        "<function=" + "x" * 300 + ">\n</function>",  # too long for a name
        "<tool_call>\n<function=get_weather>\nprose before the parameters\n</function>",
        "<tool_call>\n<function=get_weather>\n<parameter=\n",
        "text </tool_call> </function> </parameter> <parameter=x>",
        "<tool_call><tool_call>",
    ],
)
def test_malformed_markup_is_content(text):
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed == parse_tool_calls(text, TOOLS)  # deterministic
    assert parsed.calls == ()
    assert parsed.content == text
    assert assemble(run_stream(text, list(text))) == (text, [])


def test_malformed_opener_then_a_real_call():
    text = "<tool_call>\n{json}\n" + PARIS
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.content == "<tool_call>\n{json}"
    assert len(parsed.calls) == 1


@pytest.mark.parametrize(
    "cut",
    [
        PARIS[: PARIS.index("Paris") + 3],  # inside a streamed string value
        PARIS[: PARIS.index("3") + 1],  # inside a typed value
        PARIS[: PARIS.index("</parameter>") + 5],  # inside a closing tag
        PARIS[: PARIS.index("<parameter=days>")],  # between parameters
        PARIS[: PARIS.index("<parameter=days>") + 13],  # inside a parameter tag
        call_text("write_file", [("content", "body")])[:-30],
    ],
)
def test_unterminated_call(cut):
    text = "Before.\n" + cut
    # Complete parse: the call was never finished, so its raw text is content.
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.calls == () and parsed.content == text
    # Streaming: the start was sent, so it ends incomplete with valid JSON of what was written.
    content, calls = assemble(run_stream(text, list(text)))
    assert content == "Before."
    ((name, arguments, complete),) = calls
    assert name == "get_weather" or name == "write_file"
    assert not complete and isinstance(json.loads(arguments), dict)


def test_broken_parameter_tag_after_commit_ends_the_call():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=\nx"
    content, calls = assemble(run_stream(text, list(text)))
    assert calls == [("get_weather", '{"city": "Oslo"}', False)]
    assert parse_tool_calls(text, TOOLS) .content == text


def test_whitespace_after_the_last_call_is_dropped():
    parsed = parse_tool_calls(PARIS + "\n\n  \n", TOOLS)
    assert parsed.content == "" and len(parsed.calls) == 1


# Streaming


@pytest.mark.parametrize("sample", range(len(SAMPLES)))
def test_every_split_point_matches_the_complete_parse(sample):
    text = SAMPLES[sample]
    want = expected(text)
    for k in range(len(text) + 1):
        assert assemble(run_stream(text, [text[:k], text[k:]])) == want, k


@pytest.mark.parametrize("sample", range(len(SAMPLES)))
def test_char_by_char_and_random_chunks_match_the_complete_parse(sample):
    text = SAMPLES[sample]
    want = expected(text)
    assert assemble(run_stream(text, list(text))) == want
    for seed in range(20):
        assert assemble(run_stream(text, random_pieces(text, random.Random(seed)))) == want, seed


def test_three_way_splits_of_a_parallel_call_with_markup():
    text = SAMPLES[2]
    want = expected(text)
    rng = random.Random(7)
    for _ in range(300):
        a, b = sorted(rng.sample(range(len(text) + 1), 2))
        assert assemble(run_stream(text, [text[:a], text[a:b], text[b:]])) == want


def test_stream_event_shapes():
    events = run_stream(SAMPLES[0], list(SAMPLES[0]))
    assert events[0] == ContentDelta("I")
    start = next(e for e in events if isinstance(e, ToolCallStart))
    assert start == ToolCallStart(0, "call-0", "get_weather")
    args = [e.text for e in events if isinstance(e, ToolCallArgumentsDelta)]
    assert args[0] == '{"city": "'  # a string value streams from its first character
    assert "".join(args[:4]) == '{"city": "Par'
    assert ', "days": 3' in args and args[-1] == ', "opts": {"unit": "C"}}'  # typed values arrive whole
    assert isinstance(events[-1], ToolCallEnd) and events[-1].complete


def test_large_string_value_streams_incrementally():
    value = "x" * 5000
    text = call_text("write_file", [("content", value)])
    parser = ToolCallParser(TOOLS)
    streamed = []
    for i in range(0, len(text), 100):
        events = parser.feed(text[i : i + 100])
        streamed.append(sum(len(e.text) for e in events if isinstance(e, ToolCallArgumentsDelta)))
    parser.finish()
    assert sum(1 for n in streamed if n > 0) > 40  # arguments arrive all along, not in one burst


def test_no_partial_tag_leaks_as_content():
    parser = ToolCallParser(TOOLS)
    assert parser.feed("Hello <tool") == [ContentDelta("Hello")]
    assert parser.feed("s> and <func") == [ContentDelta(" <tools> and")]
    assert parser.feed("tional>") == [ContentDelta(" <functional>")]
    assert parser.feed("\n\n") == []  # may separate a call
    assert parser.feed("<tool_call>\n<function=get_weather>\n") == []  # not committed yet
    events = parser.feed("<parameter=city>\n")
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgumentsDelta]
    assert parser.feed("Pa") == [ToolCallArgumentsDelta(0, "Pa")]
    assert parser.feed("ris\n</param") == [ToolCallArgumentsDelta(0, "ris")]
    assert parser.feed("eter>\n</fun") == []  # a literal </parameter> unless a tag follows
    ends = parser.feed("ction>\n</tool_call>\n")
    assert ends[0] == ToolCallArgumentsDelta(0, '"}')
    assert isinstance(ends[1], ToolCallEnd) and ends[1].complete and len(ends) == 2
    assert parser.feed("ok <") == [ContentDelta("ok")]
    assert parser.finish() == [ContentDelta(" <")]
    assert parser.finish() == []
    with pytest.raises(RuntimeError, match="after finish"):
        parser.feed("x")
    assert [c.name for c in parser.calls] == ["get_weather"]


# Typed arguments


@pytest.mark.parametrize(
    "schema, raw, value",
    [
        ({"type": "integer"}, "42", 42),
        ({"type": "integer"}, " -7 \n", -7),
        ({"type": "integer"}, "3.0", 3),
        ({"type": "integer"}, "123456789012345678901234567890", 123456789012345678901234567890),
        ({"type": "integer"}, "3.5", "3.5"),  # fallback: the raw string
        ({"type": "integer"}, "three", "three"),
        ({"type": "integer"}, "٣", "٣"),  # not an ASCII digit
        ({"type": "number"}, "2.5", 2.5),
        ({"type": "number"}, "4.0", 4),
        ({"type": "number"}, "1e3", 1000),
        ({"type": "number"}, "-.5", -0.5),
        ({"type": "number"}, "inf", "inf"),
        ({"type": "number"}, "nan", "nan"),
        ({"type": "number"}, "1e999", "1e999"),
        ({"type": "boolean"}, "true", True),
        ({"type": "boolean"}, "False", False),
        ({"type": "boolean"}, "1", True),
        ({"type": "boolean"}, "yes", "yes"),
        ({"type": "object"}, '{"a": [1, 2]}', {"a": [1, 2]}),
        ({"type": "object"}, "[1]", "[1]"),  # an array is not an object
        ({"type": "object"}, '{"a": NaN}', '{"a": NaN}'),
        ({"type": "object"}, "{'a': 1}", "{'a': 1}"),  # Python repr is not JSON
        ({"type": "array"}, '["x", {"y": null}]', ["x", {"y": None}]),
        ({"type": "array"}, "[" * 100000, "[" * 100000),  # too deep for json: fallback, no crash
        ({"type": "string"}, " 42 ", " 42 "),
        ({"type": "string"}, "null", "null"),
        ({"type": ["integer", "null"]}, "null", None),
        ({"type": ["integer", "null"]}, "None", None),  # how the template renders None
        ({"type": "integer", "nullable": True}, "NULL", None),
        ({"type": ["string", "integer"]}, "5", 5),  # integer outranks string
        ({"type": ["string", "integer"]}, "five", "five"),
        ({"anyOf": [{"type": "boolean"}, {"type": "array"}]}, "[true]", [True]),
        ({"oneOf": [{"type": "number"}, {"type": "string"}]}, "0.25", 0.25),
        ({"enum": [1, 2, 3]}, "2", 2),
        ({"enum": ["a", "b"]}, "a", "a"),
        ({"const": True}, "true", True),
        ({"type": "INT64"}, "8", 8),
        ({"type": "float"}, "8.5", 8.5),
        ({"type": "bool"}, "TRUE", True),
        ({"type": "dict"}, '{"k": 1}', {"k": 1}),
        ({"type": "list"}, "[]", []),
        ({"type": "mystery"}, "7", "7"),  # unknown type: raw
        ({}, "7", "7"),
        ({"description": "no type"}, "[1]", "[1]"),
    ],
)
def test_convert_value(schema, raw, value):
    got = convert_value(raw, schema_types(schema, {}))
    assert got == value and type(got) is type(value)


def test_ref_parameters_are_resolved():
    params = {
        "type": "object",
        "properties": {
            "count": {"$ref": "#/$defs/Count"},
            "point": {"$ref": "#/definitions/Point"},
            "loop": {"$ref": "#/$defs/Loop"},
            "remote": {"$ref": "https://example.com/s.json"},
            "missing": {"$ref": "#/$defs/Nope"},
        },
        "$defs": {"Count": {"type": "integer"}, "Loop": {"$ref": "#/$defs/Loop"}},
        "definitions": {"Point": {"type": "object", "properties": {"x": {"type": "number"}}}},
    }
    tools = ToolSet.from_openai([{"type": "function", "function": {"name": "f", "parameters": params}}])
    text = call_text("f", [("count", "4"), ("point", '{"x": 1.5}'), ("loop", "1"), ("remote", "2"), ("missing", "3")])
    (call,) = parse_tool_calls(text, tools).calls
    assert json.loads(call.arguments) == {"count": 4, "point": {"x": 1.5}, "loop": "1", "remote": "2", "missing": "3"}


def test_additional_properties_type_applies_to_unlisted_parameters():
    params = {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": {"type": "integer"}}
    tools = ToolSet.from_openai([{"type": "function", "function": {"name": "f", "parameters": params}}])
    (call,) = parse_tool_calls(call_text("f", [("a", "1"), ("b", "2")]), tools).calls
    assert json.loads(call.arguments) == {"a": "1", "b": 2}


# Round trip through the real chat template, with hypothesis-generated arguments

ROUND_TRIP_TOOL = {
    "type": "function",
    "function": {
        "name": "everything",
        "parameters": {
            "type": "object",
            "properties": {
                "s": {"type": "string"},
                "i": {"type": "integer"},
                "f": {"type": "number"},
                "b": {"type": "boolean"},
                "n": {"type": ["integer", "null"]},
                "o": {"type": "object"},
                "a": {"type": "array"},
            },
        },
    },
}
ROUND_TRIP_TOOLS = ToolSet.from_openai([ROUND_TRIP_TOOL])
# A string value the format cannot tell from the markup that ends it (no escaping exists).
AMBIGUOUS = re.compile(r"</parameter>\s*(<parameter=|</function>|</tool_call>)|</function>\s*</tool_call>")
FRAGMENTS = ["<", ">", "/", "\n", " ", "=", "a", "é", "🙂", "\\", '"', "</function>", "</parameter>",
             "<parameter=x>", "<tool_call>", "</tool_call>", "<function=f>", "</think>"]
markup_text = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=4)), max_size=12).map("".join)
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20), markup_text,
                      st.floats(allow_nan=False, allow_infinity=False))
json_value = st.recursive(
    json_leaf, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=3), kids, max_size=3),
    max_leaves=6,
)
arguments = st.fixed_dictionaries(
    {},
    optional={
        "s": markup_text,
        "i": st.integers(-10**30, 10**30),
        "f": st.floats(allow_nan=False, allow_infinity=False),
        "b": st.booleans(),
        "n": st.one_of(st.none(), st.integers()),
        "o": st.dictionaries(st.text(max_size=5), json_value, max_size=3),
        "a": st.lists(json_value, max_size=3),
    },
)


def render_assistant(content: str, calls: list[dict]) -> str:
    """The assistant turn our template renders for `calls`, after its (empty) think block."""
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": content,
         "tool_calls": [{"type": "function", "function": {"name": "everything", "arguments": a}} for a in calls]},
    ]
    prompt = render_chat_template(TEMPLATE, messages, [ROUND_TRIP_TOOL],
                                  add_generation_prompt=False)
    turn = prompt[prompt.rindex("<|im_start|>assistant\n") :]
    return turn[turn.index("</think>\n\n") + len("</think>\n\n") : turn.rindex("<|im_end|>")]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(arguments, min_size=1, max_size=3), st.sampled_from(["", "Sure.", "Let me look <b>now</b>."]),
       st.randoms(use_true_random=False))
def test_template_round_trip(calls, content, rng):
    # the format has no escaping: skip values whose rendered text (strings raw, the rest as JSON)
    # holds a closing tag followed by the next tag
    assume(not any(AMBIGUOUS.search(v if isinstance(v, str) else json.dumps(v, ensure_ascii=False))
                   for a in calls for v in a.values()))
    text = render_assistant(content, calls)
    parsed = parse_tool_calls(text, ROUND_TRIP_TOOLS)
    assert parsed.content == content
    assert [json.loads(c.arguments) for c in parsed.calls] == calls
    want = (parsed.content, [(c.name, c.arguments, True) for c in parsed.calls])
    assert assemble(run_stream(text, random_pieces(text, rng, most=12), ROUND_TRIP_TOOLS)) == want


# Tool definitions and tool_choice


@pytest.mark.parametrize(
    "tools, param",
    [
        ([], "tools"),
        ("get_weather", "tools"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"type": "function", "function": {"description": "x"}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": "string"}}], "tools[0].function.parameters"),
        ([{"type": "function", "function": {"name": "f", "description": 3}}], "tools[0].function.description"),
        ([{"type": "web_search"}], "tools[0].type"),
        ([WEATHER, WEATHER], "tools[1].function.name"),
        ([WEATHER, 5], "tools[1]"),
    ],
)
def test_bad_tool_definitions(tools, param):
    with pytest.raises(ToolRequestError) as err:
        ToolSet.from_openai(tools)
    assert err.value.param == param and isinstance(err.value, ValueError)
    assert err.value.message == str(err.value) and "Traceback" not in err.value.message


def test_toolset_basics():
    assert TOOLS.names == ("get_weather", "write_file") and "get_weather" in TOOLS and len(TOOLS) == 2
    assert TOOLS.get("nope") is None and len(ToolSet.from_openai(None)) == 0
    assert TOOLS.get("get_weather").types_of("days") == {"integer"}
    assert ToolSet.from_openai([{"type": "function", "function": {"name": "f"}}]).get("f").types_of("x") == frozenset()


@pytest.mark.parametrize(
    "choice, tools, want",
    [
        (None, TOOLS, ToolChoice("auto")),
        (None, None, ToolChoice("none")),
        ("none", TOOLS, ToolChoice("none")),
        ("none", None, ToolChoice("none")),
        ("auto", TOOLS, ToolChoice("auto")),
        ("required", TOOLS, ToolChoice("required")),
        ({"type": "function", "function": {"name": "write_file"}}, TOOLS, ToolChoice("named", "write_file")),
        ({"type": "function", "name": "get_weather"}, TOOLS, ToolChoice("named", "get_weather")),
    ],
)
def test_tool_choice_accepted(choice, tools, want):
    assert resolve_tool_choice(choice, tools) == want
    assert validate_tool_choice(choice, tools) is None


@pytest.mark.parametrize(
    "choice, tools, words",
    [
        ("required", None, "needs tools"),
        ("auto", None, "needs tools"),
        ("any", TOOLS, "'any' is not supported"),
        ({"type": "function", "function": {"name": "nope"}}, TOOLS, "'nope', which is not in tools"),
        ({"type": "function", "function": {"name": "get_weather"}}, None, "no tools"),
        ({"type": "function", "function": {}}, TOOLS, "needs the function name"),
        ({"type": "tool", "name": "get_weather"}, TOOLS, "must be 'none', 'auto', 'required'"),
        (3, TOOLS, "must be 'none'"),
    ],
)
def test_tool_choice_rejected(choice, tools, words):
    message = validate_tool_choice(choice, tools)
    assert message is not None and words in message
    with pytest.raises(ToolRequestError) as err:
        resolve_tool_choice(choice, tools)
    assert err.value.param == "tool_choice" and err.value.message == message


def test_anthropic_conversion():
    tools = anthropic_tools_to_openai(
        [{"name": "get_weather", "description": "d", "input_schema": {"properties": {"days": {"type": "integer"}}}}]
    )
    assert tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "d",
        "parameters": {"type": "object", "properties": {"days": {"type": "integer"}}}}}]
    assert ToolSet.from_openai(tools).get("get_weather").types_of("days") == {"integer"}
    assert anthropic_tool_choice_to_openai({"type": "any"}) == ("required", None)
    assert anthropic_tool_choice_to_openai({"type": "auto", "disable_parallel_tool_use": True}) == ("auto", False)
    assert anthropic_tool_choice_to_openai({"type": "tool", "name": "f"}) == (
        {"type": "function", "function": {"name": "f"}}, None)
    assert anthropic_tool_choice_to_openai({"type": "none"}) == ("none", None)
    assert anthropic_tool_choice_to_openai(None) == (None, None)
    for bad in ({"type": "tool"}, {"type": "required"}, "auto"):
        with pytest.raises(ToolRequestError, match="tool_choice"):
            anthropic_tool_choice_to_openai(bad)
    for bad, param in (([{"name": "f"}], "tools[0].input_schema"), ([{"input_schema": {}}], "tools[0].name"),
                       ([{"type": "bash_20250124", "name": "bash"}], "tools[0].type"), ({}, "tools")):
        with pytest.raises(ToolRequestError) as err:
            anthropic_tools_to_openai(bad)
        assert err.value.param == param


def test_responses_conversion():
    flat = [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}]
    assert responses_tools_to_openai(flat) == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}]
    with pytest.raises(ToolRequestError) as err:
        responses_tools_to_openai([{"type": "web_search"}])
    assert err.value.param == "tools[0].type"


# Reasoning

THOUGHT = "The user wants weather.\nI should call the tool: a<b, </thin k>.\n"
REASONING_SAMPLES = [
    ("reasoning", THOUGHT + "</think>\n\nIt is sunny in Paris.", THOUGHT.strip(), "It is sunny in Paris."),
    ("reasoning", "<think>\nrepeated tag</think>answer", "repeated tag", "answer"),
    ("reasoning", "cut off by max_tokens, still thinking  \n", "cut off by max_tokens, still thinking", ""),
    ("reasoning", "\n\n</think>\n\n", "", ""),
    ("reasoning", "think <think> literal</think>a</think>b", "think <think> literal", "ab"),
    ("reasoning", "plan\n\n" + PARIS, "plan", PARIS),  # a tool call ends the reasoning
    ("reasoning", "é 🙂 思考\n</think>\n\n答案 🙂", "é 🙂 思考", "答案 🙂"),
    ("content", "Direct answer </think> with <think> kept", "", "Direct answer  with <think> kept"),
    ("content", "  spaced answer\n", "", "  spaced answer\n"),
    ("detect", "  <think>\nmodel opened it\n</think>\n\nans", "model opened it", "ans"),
    ("detect", "no think here <think>", "", "no think here <think>"),
    ("detect", "<thi", "", "<thi"),
    ("detect", "", "", ""),
]


@pytest.mark.parametrize("start, text, reasoning, content", REASONING_SAMPLES)
def test_split_reasoning(start, text, reasoning, content):
    split = split_reasoning(text, start)
    assert (split.reasoning, split.content) == (reasoning, content)
    parser = ReasoningParser(start)
    deltas = [parser.feed(ch) for ch in text] + [parser.finish()]
    assert "".join(d.reasoning for d in deltas) == reasoning
    assert "".join(d.content for d in deltas) == content
    for k in range(len(text) + 1):
        parser = ReasoningParser(start)
        deltas = [parser.feed(text[:k]), parser.feed(text[k:]), parser.finish()]
        assert ("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)) == (reasoning, content), k


def test_tool_call_can_stay_in_reasoning():
    split = split_reasoning("plan <tool_call> more</think>x", "reasoning", tool_call_ends_reasoning=False)
    assert (split.reasoning, split.content) == ("plan <tool_call> more", "x")


def test_reasoning_streams_before_content_and_holds_partial_tags():
    parser = ReasoningParser("reasoning")
    assert parser.feed("<th") == ReasoningDelta()  # may be a repeated <think>
    assert parser.feed("inking hard") == ReasoningDelta(reasoning="<thinking hard")
    assert parser.feed("\n</thi") == ReasoningDelta()
    assert parser.phase == "reasoning"
    assert parser.feed("nk>\n\n") == ReasoningDelta()
    assert parser.phase == "content"
    assert parser.feed("Answer") == ReasoningDelta(content="Answer")
    assert parser.feed(" </") == ReasoningDelta(content=" ")
    assert parser.finish() == ReasoningDelta(content="</")
    with pytest.raises(RuntimeError, match="after finish"):
        parser.feed("x")
    with pytest.raises(ValueError, match="start must be one of"):
        ReasoningParser("thinking")


def test_start_phase_follows_the_rendered_prompt():
    template = TEMPLATE
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>old</think>x"},
                {"role": "user", "content": "again"}]
    on = render_chat_template(template, messages, enable_thinking=True)
    off = render_chat_template(template, messages, enable_thinking=False)
    assert prompt_opens_thinking(on) and not prompt_opens_thinking(off)
    assert start_phase(on, True) == "reasoning" and ReasoningParser.for_prompt(on).phase == "reasoning"
    assert start_phase(off, False) == "content" and ReasoningParser.for_prompt(off, False).phase == "content"
    assert start_phase(off, True) == "detect"  # thinking asked for, but this prompt pre-closed it
    assert start_phase(on, False) == "content"
    assert start_phase(None) == "reasoning"


def test_reasoning_then_tool_calls_streamed_equals_complete():
    text = THOUGHT + "</think>\n\nChecking.\n\n" + PARIS + "\n" + ROME
    split = split_reasoning(text)
    want = expected(split.content)
    assert want[0] == "Checking." and len(want[1]) == 2
    for seed in range(30):
        reasoning_parser, tool_parser = ReasoningParser("reasoning"), ToolCallParser(TOOLS, id_factory=sequential_ids())
        reasoning, events = [], []
        for piece in random_pieces(text, random.Random(seed)):
            delta = reasoning_parser.feed(piece)
            reasoning.append(delta.reasoning)
            events += tool_parser.feed(delta.content)
        delta = reasoning_parser.finish()
        reasoning.append(delta.reasoning)
        events += tool_parser.feed(delta.content) + tool_parser.finish()
        assert "".join(reasoning) == split.reasoning
        assert assemble(events) == want

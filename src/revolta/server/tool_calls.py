"""qwen3_coder tool calls: the parser for the calls the model writes (spec/server.md §4.2).

The chat template (src/revolta/presets/chat_template.jinja) asks for, and re-renders, calls as

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

with string values raw and other values as JSON. Interface (the tool definitions, tool_choice and
value typing live in tool_schema.py):

- `parse_tool_calls(text, toolset)` parses a complete generation into `ParsedToolCalls`.
- `ToolCallParser(toolset)` streams: `feed(delta)` and `finish()` return lists of events
  (`ContentDelta`, `ToolCallStart`, `ToolCallArgumentsDelta`, `ToolCallEnd`).

Parsing rules (the same in both modes; `parse_tool_calls` is feed-everything-then-finish):
- A call opens at `<tool_call>` + optional whitespace + `<function=NAME>`, or at a bare
  `<function=NAME>` (models sometimes drop the wrapper). It is committed, and `ToolCallStart`
  emitted, once the first `<parameter=P>` tag, `</function>` or `</tool_call>` after the name is
  complete. Anything else there (`<tool_call>` followed by JSON, a name with a newline or over
  MAX_NAME_CHARS characters, text before the first parameter) is not a call: the opening tag is
  passed on as content and scanning resumes after it.
- A value ends only at `</parameter>` that is followed, after optional whitespace, by
  `<parameter=`, `</function>`, `</tool_call>` or the end of the text; or at `</function>`
  followed by `</tool_call>` or the end (a value missing its `</parameter>`). So a literal
  `</function>` or `</parameter>` inside a string argument does not cut it short. Exactly one
  leading and one trailing newline of the value (the template's markup) are removed.
- A call is complete at `</function>`, or at `</tool_call>` right after a parameter (lenient about
  a missing `</function>`); a `</tool_call>` after `</function>` is consumed.
- Whitespace just before a committed call and just after a call ends is dropped (the template's
  separators); all other text outside calls is content, unchanged.
- Values are typed by the tool's JSON schema (`convert_value`): see there for the rules and the
  fallback. A function name not in the tools is still a call (the model asked for it; the server
  decides), with every value a raw string, as vLLM does. The same holds for unknown parameters.
- `arguments` is `{` + `"key": value` pairs joined by `, ` + `}` (json.dumps spacing, non-ASCII
  kept), built from the streamed fragments, so their concatenation is the final string exactly.
  A repeated parameter name appears twice in it (JSON parsers keep the last).

Streaming: values whose schema allows only strings (or that have no schema) stream as they arrive,
JSON-escaped; other values are sent whole when they end. Text that may be the start of a tag is held
back until it is decided, so no partial tag reaches content. A call the text ends inside (cut off
by max_tokens, or broken after it was committed) ends with `ToolCallEnd(complete=False)`: its
arguments are still closed into valid JSON, because the start was already sent. `parse_tool_calls`
instead returns such a call's raw text as content and only complete calls, which is the one place
the two modes differ (spec/server.md §4.2: non-streaming can only report fully parsed calls).
Malformed input never raises and no text is lost.

Not handled (known limits): a string value that itself contains `</parameter>` followed by a
parameter/function tag is cut there (the format has no escaping); a value whose `</parameter>` is
missing runs on to the next terminator; nested values inside a parsed object are not re-typed.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Union

from revolta.server._markup import PARTIAL, StreamScanner, find_tag, match_tag, skip_space, space_run_start
from revolta.server.tool_schema import ToolSchema, ToolSet, convert_value

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"

# Longest function or parameter name accepted between `=` and `>`; longer means it is not a tag.
MAX_NAME_CHARS = 256


# Parser events


@dataclass(frozen=True)
class ToolCall:
    """One parsed call.

    Attributes:
        id: unique call id ("chatcmpl-tool-<hex>" by default, see `new_tool_call_id`).
        name: the function name as written (possibly not in the tools).
        arguments: a JSON object as a string, e.g. '{"city": "Paris", "days": 3}'.
    """

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ContentDelta:
    """Text outside tool calls."""

    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A call was committed: send id, type "function", name and arguments "" for `index`."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgumentsDelta:
    """The next fragment of call `index`'s arguments; the fragments concatenate to the final string."""

    index: int
    text: str


@dataclass(frozen=True)
class ToolCallEnd:
    """Call `index` is over.

    Attributes:
        index: as in ToolCallStart.
        call: the call with its full arguments (the concatenated fragments).
        complete: False when the text ended inside the call or broke it after it was committed;
            its arguments are still valid JSON, but hold only what was written.
        raw: the call's source text (including the whitespace dropped before it), which
            `parse_tool_calls` returns as content for an incomplete call.
    """

    index: int
    call: ToolCall
    complete: bool
    raw: str


ToolCallEvent = Union[ContentDelta, ToolCallStart, ToolCallArgumentsDelta, ToolCallEnd]


@dataclass(frozen=True)
class ParsedToolCalls:
    """A complete generation, parsed.

    Attributes:
        content: all text outside complete calls, in order ("" when none; the server maps "" to
            null where the API wants it).
        calls: the complete calls in order (list position = index in the API response).
    """

    content: str
    calls: tuple[ToolCall, ...]


def new_tool_call_id() -> str:
    """A fresh call id in vLLM's form, `chatcmpl-tool-<32 hex>`."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _json_escape(text: str) -> str:
    """Text as the inside of a JSON string; escaping is per character, so pieces concatenate."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


_BAD = "bad"


def _read_name(text: str, i: int) -> tuple[str, int] | str:
    """The tag name in text[i:] up to `>`: (name, index after `>`), PARTIAL or _BAD."""
    end = text.find(">", i, i + MAX_NAME_CHARS + 1)
    if end == -1:
        seen = text[i : i + MAX_NAME_CHARS + 1]
        return _BAD if len(seen) > MAX_NAME_CHARS or "\n" in seen or "<" in seen else PARTIAL
    name = text[i:end].strip()
    if not name or "\n" in name or "<" in name:
        return _BAD
    return name, end + 1


def _value_end(text: str, i: int, final: bool) -> tuple[str | None, int]:
    """Whether the `<` at text[i] ends a parameter value: ("param" | "call", length of the closing
    tag), (PARTIAL, 0) when the text ends before it is decided, or (None, 0)."""
    for closer, kind, followers in (
        (PARAMETER_CLOSE, "param", (PARAMETER_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE)),
        (FUNCTION_CLOSE, "call", (TOOL_CALL_CLOSE,)),
    ):
        if text.startswith(closer, i):
            j = skip_space(text, i + len(closer))
            if j == len(text):
                return (kind, len(closer)) if final else (PARTIAL, 0)
            follow = match_tag(text, j, followers)
            if follow == PARTIAL:
                return (None, 0) if final else (PARTIAL, 0)
            return (kind, len(closer)) if follow else (None, 0)
        if not final and len(text) - i < len(closer) and closer.startswith(text[i:]):
            return PARTIAL, 0
    return None, 0


class ToolCallParser(StreamScanner):
    """Streaming qwen3_coder parser for one generated choice (rules: module docstring).

    Usage: `events = parser.feed(delta)` for each text delta, then `parser.finish()` once. Both
    return a list of ToolCallEvent in output order, with adjacent content (and adjacent argument
    fragments of one call) merged. Per call the order is ToolCallStart, ToolCallArgumentsDelta...,
    ToolCallEnd; indexes count from 0 in commit order. Never raises on model output; feeding after
    finish() is a RuntimeError.
    """

    def __init__(self, tools: ToolSet | None = None, *, id_factory: Callable[[], str] = new_tool_call_id):
        super().__init__()
        self._tools = tools if tools is not None else ToolSet(MappingProxyType({}))
        self._id_factory = id_factory
        self._state = "content"
        self._events: list[ToolCallEvent] = []
        self._calls: list[ToolCall] = []
        self._drop_space = False  # after a call: the separator whitespace is not content
        self._opener = ""  # the tag that opened the header being read
        self._opener_at = 0  # its index in _buf (whitespace before it sits at 0)
        # The open call.
        self._index = -1
        self._id = ""
        self._name = ""
        self._schema: ToolSchema | None = None
        self._args: list[str] = []
        self._raw: list[str] = []
        self._num_params = 0
        # The open parameter value.
        self._key_prefix = ""
        self._types: frozenset[str] = frozenset()
        self._streams = False
        self._value_started = False
        self._value: list[str] = []

    @property
    def calls(self) -> tuple[ToolCall, ...]:
        """The calls ended so far, complete or not, in index order."""
        return tuple(self._calls)

    def feed(self, text: str) -> list[ToolCallEvent]:
        """Parse the next piece of generated text; returns the events it decides."""
        self._scan(text)
        return self._decided()

    def finish(self) -> list[ToolCallEvent]:
        """The text is over: flush held text and close a call left open (complete=False)."""
        self._scan_final()
        return self._decided()

    def _decided(self) -> list[ToolCallEvent]:
        events, self._events = self._events, []
        return events

    # The states; with final=True every step settles and the machine ends in "content".

    def _step(self, final: bool) -> bool:
        return getattr(self, f"_step_{self._state}")(final)

    def _take(self, n: int) -> str:
        taken = super()._take(n)
        if self._index >= 0:  # inside a call: keep its source for ToolCallEnd.raw
            self._raw.append(taken)
        return taken

    def _emit(self, event: ToolCallEvent) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(event, ContentDelta) and isinstance(last, ContentDelta):
            self._events[-1] = ContentDelta(last.text + event.text)
        elif (
            isinstance(event, ToolCallArgumentsDelta)
            and isinstance(last, ToolCallArgumentsDelta)
            and last.index == event.index
        ):
            self._events[-1] = ToolCallArgumentsDelta(event.index, last.text + event.text)
        else:
            self._events.append(event)

    def _content(self, text: str) -> None:
        if text:
            self._emit(ContentDelta(text))

    def _arguments(self, text: str) -> None:
        if text:
            self._args.append(text)
            self._emit(ToolCallArgumentsDelta(self._index, text))

    def _step_content(self, final: bool) -> bool:
        if self._drop_space:
            if not self._drop_leading_space():
                return False
            self._drop_space = False
        pos, tag = find_tag(self._buf, (TOOL_CALL_OPEN, FUNCTION_OPEN))
        if tag is None and final:  # a cut-off tag at the very end is plain text
            self._content(self._take(len(self._buf)))
            return False
        # Whitespace before a possible call is held: it is dropped if a call is committed.
        space = space_run_start(self._buf, pos)
        self._content(self._take(space))
        if tag is None:
            return False
        self._opener, self._opener_at = tag, pos - space
        self._state = "header"
        return True

    def _step_header(self, final: bool) -> bool:
        buf = self._buf
        i = self._opener_at + len(self._opener)
        if self._opener == TOOL_CALL_OPEN:
            i = skip_space(buf, i)
            found = match_tag(buf, i, (FUNCTION_OPEN,))
            if found != FUNCTION_OPEN:
                return self._not_a_call() if found is None or final else False
            i += len(FUNCTION_OPEN)
        name = _read_name(buf, i)
        if name == PARTIAL:
            return self._not_a_call() if final else False
        if name == _BAD:
            return self._not_a_call()
        fname, i = name
        i = skip_space(buf, i)
        tag = match_tag(buf, i, (PARAMETER_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE))
        if tag == PARAMETER_OPEN:
            param = _read_name(buf, i + len(PARAMETER_OPEN))
            if param == PARTIAL:
                return self._not_a_call() if final else False
            if param == _BAD:
                return self._not_a_call()
            pname, end = param
            self._commit(fname, end)
            self._begin_param(pname)
            return True
        if tag is None:
            return self._not_a_call()
        if tag == PARTIAL:
            return self._not_a_call() if final else False
        self._commit(fname, i + len(tag))
        self._end_call(complete=True)
        self._state = "after_call" if tag == FUNCTION_CLOSE else "content"
        self._drop_space = True
        return True

    def _not_a_call(self) -> bool:
        """The opening tag starts no call: it is content, and scanning resumes after it."""
        self._content(self._take(self._opener_at + len(self._opener)))
        self._state = "content"
        return True

    def _commit(self, name: str, header_end: int) -> None:
        self._index = len(self._calls)
        self._id = self._id_factory()
        self._name = name
        self._schema = self._tools.get(name)
        self._args, self._raw, self._num_params = [], [], 0
        self._take(header_end)
        self._emit(ToolCallStart(self._index, self._id, name))

    def _begin_param(self, name: str) -> None:
        prefix = "{" if self._num_params == 0 else ", "
        self._num_params += 1
        self._key_prefix = f"{prefix}{json.dumps(name, ensure_ascii=False)}: "
        self._types = self._schema.types_of(name) if self._schema is not None else frozenset()
        self._streams = self._types <= {"string"}
        self._value_started = False
        self._value = []
        if self._streams:
            self._arguments(self._key_prefix + '"')
        self._state = "value"

    def _value_text(self, text: str) -> None:
        if self._streams:
            self._arguments(_json_escape(text))
        elif text:
            self._value.append(text)

    def _end_param(self) -> None:
        if self._streams:
            self._arguments('"')
        else:
            value = convert_value("".join(self._value), self._types)
            self._arguments(self._key_prefix + json.dumps(value, ensure_ascii=False))

    def _end_call(self, complete: bool) -> None:
        self._arguments("}" if self._num_params else "{}")
        call = ToolCall(self._id, self._name, "".join(self._args))
        self._calls.append(call)
        self._emit(ToolCallEnd(self._index, call, complete, "".join(self._raw)))
        self._index = -1
        self._raw = []

    def _abandon_call(self) -> None:
        """End the open call as incomplete, with the rest of the text as its raw source."""
        self._take(len(self._buf))
        self._end_call(complete=False)
        self._state = "content"

    def _step_value(self, final: bool) -> bool:
        if not self._value_started:
            if not self._buf and not final:
                return False
            if self._buf.startswith("\n"):  # the template's newline after <parameter=NAME>
                self._take(1)
            self._value_started = True
        buf = self._buf
        i = buf.find("<")
        while i != -1:
            kind, closer = _value_end(buf, i, final)
            if kind == PARTIAL:
                break
            if kind is not None:
                value = self._take(i)
                self._take(closer)
                self._value_text(value[:-1] if value.endswith("\n") else value)
                self._end_param()
                if kind == "call":
                    self._end_call(complete=True)
                    self._state, self._drop_space = "after_call", True
                else:
                    self._state = "body"
                return True
            i = buf.find("<", i + 1)
        hold = len(buf) if i == -1 else i
        if hold and buf[hold - 1] == "\n":  # may be the template's newline before </parameter>
            hold -= 1
        self._value_text(self._take(hold))
        if final:
            self._end_param()
            self._abandon_call()
        return False

    def _step_body(self, final: bool) -> bool:
        i = skip_space(self._buf, 0)
        tag = match_tag(self._buf, i, (PARAMETER_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE))
        if tag == PARAMETER_OPEN:
            param = _read_name(self._buf, i + len(PARAMETER_OPEN))
            if param == PARTIAL and not final:
                return False
            if isinstance(param, tuple):
                self._take(param[1])
                self._begin_param(param[0])
                return True
            tag = None
        if tag == PARTIAL and not final:
            return False
        if tag in (FUNCTION_CLOSE, TOOL_CALL_CLOSE):
            self._take(i + len(tag))
            self._end_call(complete=True)
            self._state, self._drop_space = ("after_call" if tag == FUNCTION_CLOSE else "content"), True
            return True
        if final:
            self._abandon_call()
            return False
        # A broken parameter tag inside a committed call: end the call there; the rest is content.
        self._end_call(complete=False)
        self._state = "content"
        return True

    def _step_after_call(self, final: bool) -> bool:
        i = skip_space(self._buf, 0)
        tag = match_tag(self._buf, i, (TOOL_CALL_CLOSE,))
        if tag == PARTIAL and not final:
            return False
        # A cut-off `</tool_call>` at the very end is markup of the finished call, not content.
        self._take(len(self._buf) if tag == PARTIAL else i + len(TOOL_CALL_CLOSE) if tag else i)
        self._state, self._drop_space = "content", True
        return True


def parse_tool_calls(
    text: str, tools: ToolSet | None = None, *, id_factory: Callable[[], str] = new_tool_call_id
) -> ParsedToolCalls:
    """Parse a complete generation (rules: module docstring). Incomplete calls come back as content
    (their raw text, in place); only complete calls are returned. Never raises on model output."""
    parser = ToolCallParser(tools, id_factory=id_factory)
    content: list[str] = []
    calls: list[ToolCall] = []
    for event in parser.feed(text) + parser.finish():
        if isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, ToolCallEnd):
            if event.complete:
                calls.append(event.call)
            else:
                content.append(event.raw)
    return ParsedToolCalls("".join(content), tuple(calls))

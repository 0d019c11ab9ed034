"""Model text of one choice -> reasoning, content and tool calls, incrementally.

`ChoiceParser.update(output)` feeds what a cumulative CompletionOutput adds and returns a Delta
(new reasoning, content, tool-call fragments); on the last output it also flushes what the parsers
held back. Text goes through the qwen3 reasoning parser first, then its content part through the
qwen3_coder tool-call parser. The accumulated `reasoning`, `content` and `tool_calls` are the
non-streaming answer, so both modes come from the same code. The one difference (spec/server.md
§4.2): a call the text ends inside was already announced on a stream, so it stays a call there,
while a non-streaming answer reports only complete calls and keeps the rest as content.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.request import CompletionOutput
from ..tokenizer import StopChecker
from .chat_prompt import RenderedPrompt
from .reasoning import ReasoningParser
from .tool_calls import ContentDelta, ToolCall, ToolCallArgumentsDelta, ToolCallEnd, ToolCallParser, ToolCallStart

__all__ = ["ChoiceParser", "Delta", "ToolCall", "ToolCallDelta"]


@dataclass
class ToolCallDelta:
    index: int
    arguments: str = ""
    id: str | None = None  # set on the first delta of a call, with the name
    name: str | None = None


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def extend(self, other: "Delta") -> "Delta":
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


class ChoiceParser:
    """Splits one choice's text (see the module docstring).

    Args:
        prompt: the rendered prompt (its thinking state, tools, and forced tool-call opening).
        parse_reasoning: split `<think>` reasoning (the server's --reasoning-parser).
        parse_tools: parse qwen3_coder calls (--tool-call-parser, and tool_choice is not "none").
        streaming: keep calls cut off by the end of the text as calls (their start was sent).
        stop: stop strings matched here, in content only, instead of by the engine: with tools, a
            stop string inside a call's arguments must not cut the call. `stopped` is the match.
        include_stop: keep the matched stop string in the content.
    """

    def __init__(self, prompt: RenderedPrompt, parse_reasoning: bool = True, parse_tools: bool = True,
                 streaming: bool = False, stop: tuple[str, ...] = (), include_stop: bool = False):
        self._reasoning = ReasoningParser.for_prompt(prompt.text, prompt.enable_thinking and parse_reasoning,
                                                     tool_call_ends_reasoning=parse_tools)
        self._tools = ToolCallParser(prompt.tools.toolset) if parse_tools else None
        self._streaming = streaming
        self._parallel = prompt.tools.parallel
        self._pending = prompt.tools.forced_prefix  # the call opening the prompt ends with is model text too
        self._sent = 0  # characters of the cumulative text already fed
        self.reasoning_text = ""
        self.content_text = ""
        self.tool_calls: list[ToolCall] = []
        self._stop = StopChecker(stop, include_stop) if stop else None

    @property
    def stopped(self) -> str | None:
        """The stop string this parser matched in the content (the choice is over), else None."""
        return self._stop.stop if self._stop is not None else None

    def update(self, c: CompletionOutput) -> Delta:
        """Feed what `c` (a cumulative output of this choice) adds; finish when it is the last one."""
        if self.stopped is not None:
            return Delta()
        text, self._pending = self._pending + c.text[self._sent:], ""
        self._sent = len(c.text)
        split = self._reasoning.feed(text)
        delta = self._split(split.reasoning, split.content, final=False)
        if c.finish_reason is not None and self.stopped is None:
            split = self._reasoning.finish()
            delta.extend(self._split(split.reasoning, split.content, final=True))
            if self._stop is not None:
                tail = self._stop.flush()
                delta.content += tail
                self.content_text += tail
        return delta

    def _split(self, reasoning: str, content: str, final: bool) -> Delta:
        self.reasoning_text += reasoning
        if self._tools is None:
            self.content_text += content
            return Delta(reasoning=reasoning, content=content)
        events = self._tools.feed(content) if content else []
        if final:
            events += self._tools.finish()
        delta = Delta(reasoning=reasoning)
        for e in events:
            if self.stopped is not None:  # everything after a stop string is dropped
                break
            if isinstance(e, ContentDelta):
                delta.content += self._stop.feed(e.text) if self._stop is not None else e.text
                continue
            if self._stop is not None:  # held-back content comes before the call
                delta.content += self._stop.flush()
            if not self._parallel and getattr(e, "index", 0) > 0:  # parallel_tool_calls=false: the first call only
                continue
            if isinstance(e, ToolCallStart):
                delta.tool_calls.append(ToolCallDelta(e.index, "", e.id, e.name))
            elif isinstance(e, ToolCallArgumentsDelta):
                delta.tool_calls.append(ToolCallDelta(e.index, e.text))
            elif isinstance(e, ToolCallEnd):
                if e.complete or self._streaming:
                    self.tool_calls.append(e.call)
                else:  # non-streaming: a cut-off call is the text the model wrote
                    delta.content += e.raw
        self.content_text += delta.content
        return delta

    @property
    def reasoning(self) -> str | None:
        return self.reasoning_text or None

    @property
    def content(self) -> str | None:
        return self.content_text or None

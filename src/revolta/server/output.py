"""Model text of one choice -> reasoning, content and tool calls, incrementally.

`ChoiceParser.feed(text_delta)` returns what the new text adds (a Delta); `finish()` flushes what the
parsers held back. The accumulated `reasoning`, `content` and `tool_calls` are the non-streaming
result, so streaming and non-streaming answers come from the same code.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from ..request import CompletionOutput
from .chat_prompt import RenderedPrompt


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


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ChoiceParser:
    """Splits one choice's text. Plain pass-through of content for now."""

    def __init__(self, prompt: RenderedPrompt | None, parse_reasoning: bool = True, parse_tools: bool = True):
        self.reasoning_text = ""
        self.content_text = ""
        self.tool_calls: list[ToolCall] = []
        self._pending = prompt.tools.forced_prefix if prompt is not None else ""
        self._sent = 0  # characters of the cumulative text already fed

    def feed(self, text: str) -> Delta:
        text, self._pending = self._pending + text, ""
        self.content_text += text
        return Delta(content=text)

    def finish(self) -> Delta:
        return self.feed("")

    def update(self, c: CompletionOutput) -> Delta:
        """Feed what `c` (a cumulative output of this choice) adds; finish when it is the last one."""
        delta = self.feed(c.text[self._sent:])
        self._sent = len(c.text)
        if c.finish_reason is not None:
            delta.extend(self.finish())
        return delta

    @property
    def reasoning(self) -> str | None:
        return self.reasoning_text or None

    @property
    def content(self) -> str | None:
        return self.content_text or None

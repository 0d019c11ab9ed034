"""qwen3 reasoning: split `<think>...</think>` reasoning from the answer (spec/server.md §4.3).

Our chat template ends the generation prompt with `<|im_start|>assistant\\n<think>\\n` when thinking
is on (the default), so the model starts *inside* the block and writes `reasoning</think>\\n\\nanswer`
with no opening tag; with `enable_thinking=False` it writes a pre-closed `<think>\\n\\n</think>\\n\\n`
and the output is all answer. Interface:

- `ReasoningParser.for_prompt(prompt, enable_thinking)` picks the start phase from the rendered
  prompt; `ReasoningParser(start)` takes it directly.
- `parser.feed(delta)` / `parser.finish()` return a `ReasoningDelta(reasoning, content)`.
- `split_reasoning(text, start)` splits a complete generation into a `ReasoningSplit`.

Rules (the same in both modes; `split_reasoning` is feed-everything-then-finish):
- Phases: "reasoning" (the prompt opened `<think>`), "content" (thinking off: nothing is
  reasoning) and "detect" (thinking on but the prompt did not open the block: a `<think>` at the
  start of the output, after optional whitespace, opens it; any other start means content).
- In "reasoning", one `<think>` at the very start is absorbed (the model repeating the prompt's
  tag). `</think>` ends the reasoning. So does `<tool_call>` when `tool_call_ends_reasoning`
  (the default, as in vLLM): the tag stays in the content for the tool-call parser.
  A generation that never closes the block is all reasoning (e.g. cut off by max_tokens).
- Reasoning text has its leading and trailing whitespace removed (the template re-renders it
  trimmed, so history round-trips); content right after `</think>` has its leading whitespace
  removed (the template's `\\n\\n` separator).
- In content every `</think>` is dropped (a duplicate close tag is markup, not answer); all other
  text, including a later `<think>`, is content unchanged.

Streaming holds back text that may be the start of a tag, and whitespace that may turn out to be
the end of the reasoning, until it is decided; nothing partial leaks and no text is lost.
"""

from __future__ import annotations

from dataclasses import dataclass

from revolta.server._markup import PARTIAL, StreamScanner, find_tag, match_tag, skip_space, space_run_start

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_CALL_OPEN = "<tool_call>"

PHASES = ("reasoning", "content", "detect")


@dataclass(frozen=True)
class ReasoningDelta:
    """What one feed()/finish() decided: new reasoning text and new content text (either may be "")."""

    reasoning: str = ""
    content: str = ""


@dataclass(frozen=True)
class ReasoningSplit:
    """A complete generation, split ("" for an absent part; the server maps "" to null)."""

    reasoning: str
    content: str


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether the prompt leaves a `<think>` block open for the model (our template with thinking on)."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


def start_phase(prompt: str | None, enable_thinking: bool = True) -> str:
    """The phase a generation starts in: "content" when thinking is off, else "reasoning" when the
    prompt opened the block (or no prompt is given: our template always opens it), else "detect"."""
    if not enable_thinking:
        return "content"
    if prompt is None or prompt_opens_thinking(prompt):
        return "reasoning"
    return "detect"


class ReasoningParser(StreamScanner):
    """Streaming qwen3 reasoning parser for one generated choice (rules: module docstring).

    Args:
        start: "reasoning", "content" or "detect" (see `start_phase`).
        tool_call_ends_reasoning: a `<tool_call>` inside the reasoning ends it (keep True when the
            request has tools; False leaves such text in the reasoning).
    """

    def __init__(self, start: str = "reasoning", *, tool_call_ends_reasoning: bool = True):
        if start not in PHASES:
            raise ValueError(f"start must be one of {PHASES}, got {start!r}")
        super().__init__()
        self._phase = start
        self._ends = (THINK_CLOSE, TOOL_CALL_OPEN) if tool_call_ends_reasoning else (THINK_CLOSE,)
        self._absorb_open = start == "reasoning"  # one repeated <think> at the start is markup
        self._reasoning_started = False  # leading whitespace of the reasoning is dropped until then
        self._drop_space = False  # right after </think>
        self._reasoning: list[str] = []
        self._content: list[str] = []

    @classmethod
    def for_prompt(cls, prompt: str | None, enable_thinking: bool = True, **kwargs: bool) -> ReasoningParser:
        """A parser for a generation that continues `prompt` (the rendered chat prompt)."""
        return cls(start_phase(prompt, enable_thinking), **kwargs)

    @property
    def phase(self) -> str:
        """"reasoning" while the reasoning is open, "content" after it (or with thinking off),
        "detect" while the start is undecided."""
        return self._phase

    def feed(self, text: str) -> ReasoningDelta:
        """Parse the next piece of generated text."""
        self._scan(text)
        return self._decided()

    def finish(self) -> ReasoningDelta:
        """The text is over: flush what was held back."""
        self._scan_final()
        return self._decided()

    def _decided(self) -> ReasoningDelta:
        out = ReasoningDelta("".join(self._reasoning), "".join(self._content))
        self._reasoning, self._content = [], []
        return out

    def _step(self, final: bool) -> bool:
        if self._phase == "detect":
            return self._step_detect(final)
        return self._step_reasoning(final) if self._phase == "reasoning" else self._step_content(final)

    def _step_detect(self, final: bool) -> bool:
        i = skip_space(self._buf, 0)
        tag = match_tag(self._buf, i, (THINK_OPEN,))
        if tag == PARTIAL and not final:
            return False
        if tag == THINK_OPEN:
            self._take(i + len(THINK_OPEN))
            self._phase = "reasoning"
        else:
            self._phase = "content"  # the held text is content, unchanged
        return True

    def _step_reasoning(self, final: bool) -> bool:
        if not self._reasoning_started:
            if not self._drop_leading_space():
                return False
            if self._absorb_open:
                tag = match_tag(self._buf, 0, (THINK_OPEN,))
                if tag == PARTIAL and not final:
                    return False
                self._absorb_open = False
                if tag == THINK_OPEN:
                    self._take(len(THINK_OPEN))
                    return True
            self._reasoning_started = True
        pos, tag = find_tag(self._buf, self._ends)
        if tag is None and final:  # never closed: all of it is reasoning
            self._reasoning.append(self._take(space_run_start(self._buf, len(self._buf))))
            self._take(len(self._buf))
            return False
        # Whitespace before a possible end tag is held: it is dropped if the reasoning ends there.
        self._reasoning.append(self._take(space_run_start(self._buf, pos)))
        if tag is None:
            return False
        self._take(skip_space(self._buf, 0))
        if tag == THINK_CLOSE:
            self._take(len(THINK_CLOSE))
            self._drop_space = True
        self._phase = "content"
        return True

    def _step_content(self, final: bool) -> bool:
        if self._drop_space:
            if not self._drop_leading_space():
                return False
            self._drop_space = False
        pos, tag = find_tag(self._buf, (THINK_CLOSE,))
        if tag is None and final:
            self._content.append(self._take(len(self._buf)))
            return False
        self._content.append(self._take(pos))
        if tag is None:
            return False
        self._take(len(THINK_CLOSE))
        return True


def split_reasoning(text: str, start: str = "reasoning", *, tool_call_ends_reasoning: bool = True) -> ReasoningSplit:
    """Split a complete generation (rules: module docstring)."""
    parser = ReasoningParser(start, tool_call_ends_reasoning=tool_call_ends_reasoning)
    first, last = parser.feed(text), parser.finish()
    return ReasoningSplit(first.reasoning + last.reasoning, first.content + last.content)

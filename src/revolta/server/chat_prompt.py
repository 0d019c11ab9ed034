"""Conversations -> prompt tokens: message normalisation, tool definitions and tool_choice, media.

All three chat-like routes (Chat Completions, Responses, Anthropic Messages) convert their input to
OpenAI-style messages and tools first and then share this module, so validation and templating are
the same everywhere. tool_choice "required" and a named tool open the assistant turn with the start
of a call (`<tool_call>\\n<function=`), which the output parser then reads as if the model had written
it; a grammar (tool_grammar.py, with xgrammar) makes the rest of the call follow the tool's schema.
Media go through the LLM's own path (`chat_prompt` resolves the URLs, `media_footprint` prices them from
their headers, `process_prompt` decodes and expands the placeholders) on worker threads, with the media
budget (media_budget.py) admitted in between; the token counts include the media and every `MediaError`
becomes a 400 naming its `param`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from jinja2 import TemplateError

from ..multimodal.media import MediaError
from ..tokenizer import resolve_generation_prompt
from .config import ServerConfig
from .errors import bad_request
from .heap_trim import TRIM_MIN_BYTES, heap_trimmer
from .media_budget import MediaBudget
from .params import check_prompt_length
from .reasoning import prompt_opens_thinking
from .tool_schema import ToolRequestError, ToolSet, resolve_tool_choice

_TEXT_PARTS = ("text", "input_text", "output_text")
_VISUAL_PARTS = {"image_url": "image", "video_url": "video"}
_AUDIO_PARTS = ("input_audio", "audio_url")


CALL_OPEN = "<tool_call>\n<function="  # the opening of a qwen3_coder call, up to the tool name
# chat_template_kwargs entries that the request's own fields set (passing both would be a TypeError)
_REQUEST_FIELDS = ("tools", "enable_thinking", "add_generation_prompt", "continue_final_message")

@dataclass(frozen=True)
class ToolSetup:
    """The request's tools (OpenAI function shape) and how the output must use them."""

    tools: tuple[dict[str, Any], ...] = ()
    choice: str = "none"  # none | auto | required | named
    named: str | None = None
    parallel: bool = True
    toolset: ToolSet | None = None  # parameter types for the output parser

    @property
    def parse(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def forced_prefix(self) -> str:
        if self.choice == "named":
            return f"{CALL_OPEN}{self.named}>\n"
        return CALL_OPEN if self.choice == "required" else ""


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    token_ids: list[int]  # what the prompt costs: each media placeholder expanded to its pad tokens
    enable_thinking: bool  # whether the model starts inside a <think> block
    tools: ToolSetup
    processed: Any = None  # LLM.process_prompt's result when the prompt has media (decoded once, here)

    @property
    def engine_prompt(self) -> Any:
        """What `LLM.add_request` takes for this prompt."""
        return self.processed if self.processed is not None else {"prompt_token_ids": self.token_ids}


def tool_setup(tools: Sequence[Any] | None, tool_choice: Any, parallel: bool = True) -> ToolSetup:
    """Validate OpenAI-shaped tools and tool_choice (tool_schema.py's rules); a mistake is a 400."""
    try:
        toolset = ToolSet.from_openai(tools)
        choice = resolve_tool_choice(tool_choice, toolset if tools is not None else None)
    except ToolRequestError as e:
        raise bad_request(e.message, e.param) from None
    return ToolSetup(tuple(tools or ()), choice.mode, choice.name, parallel, toolset)


def generation_prompt(add_generation_prompt: bool | None, continue_final_message: bool, tools: ToolSetup) -> bool:
    """vLLM's add_generation_prompt / continue_final_message pair, resolved; a combination that cannot work is a 400."""
    try:
        add = resolve_generation_prompt(add_generation_prompt, continue_final_message)
    except ValueError as e:
        raise bad_request(str(e), "continue_final_message") from None
    if tools.forced_prefix and not add:  # its grammar expects the call to open a new assistant turn
        raise bad_request(f"tool_choice {tools.choice!r} opens a new assistant turn with a tool call, so it needs "
                          "add_generation_prompt and no continue_final_message; use tool_choice 'auto' or 'none'",
                          "tool_choice")
    return add


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-style messages -> the template's shape. Media parts keep their URL; `LLM.chat_prompt` resolves
    them (multimodal/sources.py), so the server and the library accept and refuse exactly the same sources."""
    out = []
    for i, message in enumerate(messages):
        m = {k: v for k, v in message.items() if v is not None}
        if m.get("role") == "developer":
            m["role"] = "system"
        content = m.get("content")
        if isinstance(content, list):
            m["content"] = [_part(part, f"messages[{i}].content[{j}]") for j, part in enumerate(content)]
        out.append(m)
    return out


def _part(part: Any, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind in _TEXT_PARTS:
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.text must be a string")
        return {"type": "text", "text": part["text"]}
    if kind in _VISUAL_PARTS:
        value = part.get(kind)
        url = value.get("url") if isinstance(value, Mapping) else value
        if not isinstance(url, str) or not url:
            raise bad_request(f"{where}.{kind}.url must be a non-empty string: a data:<type>;base64,<data> URL or "
                              "a file:// URL under --allowed-local-media-path", _VISUAL_PARTS[kind])
        return {"type": kind, kind: {"url": url}}  # `detail` has no meaning for this model's processor
    if kind in _AUDIO_PARTS:
        return dict(part)  # the library refuses it with vLLM's "At most 0 audio(s)" message
    raise bad_request(f"{where}: Unsupported chat content part type {kind!r}; use text, image_url or video_url")


class PromptRenderer:
    """Renders and tokenizes conversations with the served model's chat template; decodes their media within the
    media budget (media_budget.py)."""

    def __init__(self, llm: Any, config: ServerConfig, media_budget: MediaBudget):
        self._llm, self._config, self.media_budget = llm, config, media_budget
        self.tokenizer = llm.get_tokenizer()
        self._trim_heap = heap_trimmer()  # after large decodes: their freed buffers leave the RSS (heap_trim.py)

    def _template(self, messages: list[dict[str, Any]], tools: ToolSetup, enable_thinking: bool,
                  template_kwargs: Mapping[str, Any], add_generation_prompt: bool,
                  continue_final_message: bool) -> tuple[Any, list[int] | None, Any]:
        """(prompt, token ids, None) for text; (prompt with its media sources resolved, None, media footprint
        priced from the headers) with media, which are not decoded yet. Runs on a worker thread."""
        kwargs = {k: v for k, v in template_kwargs.items() if k not in _REQUEST_FIELDS}
        try:  # allow_local_files=False: files only under --allowed-local-media-path
            prompt = self._llm.chat_prompt(messages, allow_local_files=False, tools=list(tools.tools) or None,
                                           enable_thinking=enable_thinking, add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, **kwargs)
        except MediaError as e:
            raise bad_request(str(e), e.param) from None
        except (TemplateError, ValueError, TypeError) as e:
            raise bad_request(f"The chat template could not render the messages: {e}", "messages") from None
        suffix = tools.forced_prefix if add_generation_prompt else ""
        if isinstance(prompt, str):
            return prompt + suffix, self.tokenizer.encode(prompt + suffix), None
        prompt = {**prompt, "prompt": prompt["prompt"] + suffix}
        try:
            return prompt, None, self._llm.media_footprint(prompt)
        except MediaError as e:  # the header is bad: the loader's own message
            raise bad_request(str(e), e.param) from None

    def _process(self, prompt: Mapping[str, Any], trim: bool) -> Any:
        """Decode and place the media (worker thread): LLM.process_prompt's result. trim: hand the freed decode
        buffers back to the OS afterwards, also when decoding failed."""
        try:
            return self._llm.process_prompt(prompt)
        except ValueError as e:  # MediaError: corrupt data, too many items, over a pixel limit
            raise bad_request(str(e), getattr(e, "param", None)) from None
        finally:
            if trim and self._trim_heap is not None:
                self._trim_heap()

    async def render(self, messages: list[dict[str, Any]], tools: ToolSetup,
                     template_kwargs: Mapping[str, Any] | None = None, enable_thinking: bool | None = None,
                     add_generation_prompt: bool | None = None, check_length: bool = True,
                     request: Request | None = None, continue_final_message: bool = False) -> RenderedPrompt:
        """Render, tokenize and (with media) decode a conversation. Media wait for the media budget first; the
        bytes they keep stay charged until `request`'s HTTP exchange ends (None: released on return).

        continue_final_message leaves the final assistant message open (prefill; `render_chat_template`): the
        output continues it, as reasoning if the message left a `<think>` block open, else as answer text;
        add_generation_prompt None means "unless continue_final_message"."""
        template_kwargs = dict(template_kwargs or {})
        add_generation_prompt = generation_prompt(add_generation_prompt, continue_final_message, tools)
        if enable_thinking is None:
            enable_thinking = template_kwargs.get("enable_thinking", True) is not False
        if tools.forced_prefix:  # the forced call opens the turn, so no reasoning block first
            enable_thinking = False
        prompt, ids, footprint = await asyncio.to_thread(self._template, messages, tools, enable_thinking,
                                                         template_kwargs, add_generation_prompt,
                                                         continue_final_message)
        if footprint is None:
            text, processed = prompt, None
        else:
            hold = await self.media_budget.admit(footprint, request)
            try:
                processed = await asyncio.to_thread(self._process, prompt, footprint.peak >= TRIM_MIN_BYTES)
                mm = processed.mm_prompt
                hold.settle(sum(it.frames.nbytes for it in mm.items) if mm is not None else 0)
            finally:
                if request is None:
                    hold.release()
            text, ids = prompt["prompt"], processed.prompt_token_ids
        if continue_final_message:  # the parser starts where the message left off, not where a new turn would
            enable_thinking = prompt_opens_thinking(text)
        if check_length:
            check_prompt_length(len(ids), self._config.max_model_len)
        return RenderedPrompt(text, ids, enable_thinking, tools, processed)

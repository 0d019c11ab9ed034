"""Conversations -> prompt tokens: message normalisation, tool definitions and tool_choice, media checks.

All three chat-like routes (Chat Completions, Responses, Anthropic Messages) convert their input to
OpenAI-style messages and tools first and then share this module, so validation and templating are
the same everywhere. Without constrained decoding, tool_choice "required" and a named tool are
enforced by opening the assistant turn with the start of a call (`<tool_call>\\n<function=`), which
the output parser then reads as if the model had written it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from .config import ServerConfig
from .errors import bad_request
from .media import decode_image, read_media_url
from .params import check_prompt_length
from .tool_schema import ToolRequestError, ToolSet, resolve_tool_choice

_TEXT_PARTS = ("text", "input_text", "output_text")
_MEDIA_PARTS = {"image_url": "image", "video_url": "video", "input_audio": "audio", "audio_url": "audio"}


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
            return f"<tool_call>\n<function={self.named}>\n"
        return "<tool_call>\n<function=" if self.choice == "required" else ""


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    token_ids: list[int]
    enable_thinking: bool  # whether the model starts inside a <think> block
    tools: ToolSetup


def tool_setup(tools: Sequence[Any] | None, tool_choice: Any, parallel: bool = True) -> ToolSetup:
    """Validate OpenAI-shaped tools and tool_choice (tool_schema.py's rules); a mistake is a 400."""
    try:
        toolset = ToolSet.from_openai(tools)
        choice = resolve_tool_choice(tool_choice, toolset if tools is not None else None)
    except ToolRequestError as e:
        raise bad_request(e.message, e.param) from None
    return ToolSetup(tuple(tools or ()), choice.mode, choice.name, parallel, toolset)


def normalize_messages(messages: Sequence[Mapping[str, Any]], config: ServerConfig) -> list[dict[str, Any]]:
    """OpenAI-style messages -> the template's shape; media parts are checked (and refused, see below)."""
    out, counts = [], {"image": 0, "video": 0, "audio": 0}
    media: list[tuple[str, str, str]] = []  # (modality, url, where)
    for i, message in enumerate(messages):
        m = {k: v for k, v in message.items() if v is not None}
        if m.get("role") == "developer":
            m["role"] = "system"
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind in _TEXT_PARTS:
                    if not isinstance(part.get("text"), str):
                        raise bad_request(f"{where}.text must be a string")
                    parts.append({"type": "text", "text": part["text"]})
                elif kind in _MEDIA_PARTS:
                    modality = _MEDIA_PARTS[kind]
                    counts[modality] += 1
                    url = part.get(kind, {}).get("url") if isinstance(part.get(kind), Mapping) else part.get(kind)
                    media.append((modality, url, where))
                    parts.append({"type": kind})
                else:
                    raise bad_request(f"{where}: Unsupported chat content part type {kind!r}; use text, "
                                      "image_url or video_url")
            m["content"] = parts
        out.append(m)
    _check_media(counts, media, config)
    return out


def _check_media(counts: dict[str, int], media: list[tuple[str, str, str]], config: ServerConfig) -> None:
    for modality in ("image", "video", "audio"):
        limit = config.limit_mm_per_prompt.get(modality, 0)
        if counts[modality] > limit:
            hint = " Set --limit-mm-per-prompt to increase this limit." if modality != "audio" else \
                " This model has no audio input."
            raise bad_request(f"At most {limit} {modality}(s) may be provided in one prompt.{hint}", modality)
    for modality, url, where in media:
        data = read_media_url(url, where, config.allowed_local_media_path)
        if modality == "image":
            decode_image(data, where)
    if media:  # decoded fine, but LLM.add_request takes no multi_modal_data yet (the multimodal issue)
        raise bad_request(f"{media[0][2]}: this server's engine does not take {media[0][0]} input yet; send "
                          "text only", media[0][0])


class PromptRenderer:
    """Renders and tokenizes conversations with the served model's chat template."""

    def __init__(self, llm: Any, config: ServerConfig):
        self._llm, self._config = llm, config
        self.tokenizer = llm.get_tokenizer()

    def _render(self, messages: list[dict[str, Any]], tools: ToolSetup, enable_thinking: bool,
                template_kwargs: Mapping[str, Any], add_generation_prompt: bool) -> str:
        kwargs = {k: v for k, v in template_kwargs.items() if k not in ("tools", "enable_thinking")}
        try:
            text = self._llm.render_chat(messages, tools=list(tools.tools) or None,
                                         enable_thinking=enable_thinking,
                                         add_generation_prompt=add_generation_prompt, **kwargs)
        except (TemplateError, ValueError, TypeError) as e:
            raise bad_request(f"The chat template could not render the messages: {e}", "messages") from None
        return text + tools.forced_prefix if add_generation_prompt else text

    async def render(self, messages: list[dict[str, Any]], tools: ToolSetup,
                     template_kwargs: Mapping[str, Any] | None = None, enable_thinking: bool | None = None,
                     add_generation_prompt: bool = True, check_length: bool = True) -> RenderedPrompt:
        template_kwargs = dict(template_kwargs or {})
        if enable_thinking is None:
            enable_thinking = template_kwargs.get("enable_thinking", True) is not False
        if tools.forced_prefix:  # the forced call opens the turn, so no reasoning block first
            enable_thinking = False
        text = self._render(messages, tools, enable_thinking, template_kwargs, add_generation_prompt)
        ids = await asyncio.to_thread(self.tokenizer.encode, text)
        if check_length:
            check_prompt_length(len(ids), self._config.max_model_len)
        return RenderedPrompt(text, ids, enable_thinking, tools)

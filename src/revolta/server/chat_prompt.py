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

_TEXT_PARTS = ("text", "input_text", "output_text")
_MEDIA_PARTS = {"image_url": "image", "video_url": "video", "input_audio": "audio", "audio_url": "audio"}


@dataclass(frozen=True)
class ToolSetup:
    """The request's tools (OpenAI function shape) and how the output must use them."""

    tools: tuple[dict[str, Any], ...] = ()
    choice: str = "none"  # none | auto | required | named
    named: str | None = None
    parallel: bool = True

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


def tool_setup(tools: Sequence[Any] | None, tool_choice: Any, parallel: bool = True,
               param: str = "tools") -> ToolSetup:
    """Validate OpenAI-shaped tools and tool_choice (`param` prefixes messages, e.g. for Responses)."""
    if tools is not None and len(tools) == 0:
        raise bad_request("tools must not be an empty array; omit it to send no tools", param)
    checked = []
    for i, tool in enumerate(tools or ()):
        where = f"{param}[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise bad_request(f"{where}: only tools of type 'function' are supported", param)
        fn = tool.get("function")
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn.get("name"):
            raise bad_request(f"{where}.function.name is required (a non-empty string)", param)
        if "parameters" in fn and fn["parameters"] is not None and not isinstance(fn["parameters"], Mapping):
            raise bad_request(f"{where}.function.parameters must be a JSON Schema object", param)
        checked.append({"type": "function", "function": dict(fn)})
    names = [t["function"]["name"] for t in checked]
    if tool_choice is None:
        return ToolSetup(tuple(checked), "auto" if checked else "none", None, parallel)
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or a named function, got "
                              f"{tool_choice!r}", "tool_choice")
        if tool_choice != "none" and not checked:
            raise bad_request(f"tool_choice={tool_choice!r} needs tools; pass the tools to choose from",
                              "tool_choice")
        return ToolSetup(tuple(checked), tool_choice, None, parallel)
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function") if isinstance(tool_choice.get("function"), Mapping) else tool_choice
        name = fn.get("name")
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request("a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                              "tool_choice")
        if name not in names:
            raise bad_request(f"tool_choice names the function {name!r}, which is not in tools "
                              f"({', '.join(names) or 'none given'})", "tool_choice")
        return ToolSetup(tuple(checked), "named", name, parallel)
    raise bad_request("tool_choice must be a string or an object", "tool_choice")


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

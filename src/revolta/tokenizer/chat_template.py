"""Chat templates rendered as Hugging Face renders them (the checkpoint's jinja template, sandboxed)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

logger = logging.getLogger(__name__)


class ChatTemplateError(ValueError):
    """Raised by a chat template through `raise_exception(message)`."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
) -> str:
    # Hugging Face's override: keep non-ASCII and <>& as they are (jinja's own tojson escapes them
    # for HTML), with json.dumps' default ", " / ": " separators, which the model saw in training.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def compile_chat_template(template: str):
    """Compile a chat template in a sandboxed jinja2 environment configured like Hugging Face's.

    Args:
        template: jinja source.
    Returns:
        jinja2.Template: call `.render(messages=..., ...)`.
    """
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def _decode_arguments(arguments: Any) -> Any:
    # Templates iterate `arguments` as a mapping; OpenAI clients send it as a JSON string.
    if not isinstance(arguments, str):
        return arguments
    try:
        decoded = json.loads(arguments)
    except json.JSONDecodeError:
        decoded = None
    if not isinstance(decoded, dict):
        # vLLM's choice (spec/server.md §1.2): a malformed history entry must not brick the conversation.
        logger.warning("tool call arguments are not a JSON object, rendering them as {}: %.80r", arguments)
        return {}
    return decoded


def _prepare_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """Copy one message into the shape Qwen templates read: dict arguments, `reasoning_content`."""
    out = dict(message)
    if "reasoning_content" not in out and isinstance(out.get("reasoning"), str):
        out["reasoning_content"] = out["reasoning"]
    if out.get("tool_calls"):
        calls = []
        for call in out["tool_calls"]:
            call = dict(call)
            if isinstance(call.get("function"), Mapping):
                function = dict(call["function"])
                function["arguments"] = _decode_arguments(function.get("arguments", {}))
                call["function"] = function
            elif "arguments" in call:
                call["arguments"] = _decode_arguments(call["arguments"])
            calls.append(call)
        out["tool_calls"] = calls
    return out


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    enable_thinking: bool = True,
    **kwargs: Any,
) -> str:
    """Render `messages` (and `tools`) with a jinja chat template, as `transformers` would.

    Args:
        template: jinja source (the checkpoint's, or the preset).
        messages: [{role, content, ...}]; content is a str or a list of parts
            {type: text|image|image_url|video|video_url, ...}; assistant `tool_calls` arguments may be a
            dict or a JSON string; `reasoning` is accepted as an alias of `reasoning_content`.
        tools: OpenAI-style tool definitions, or None.
        add_generation_prompt: end with the opening of an assistant turn.
        enable_thinking: False pre-closes the think block of the generation prompt.
        **kwargs: more template variables (preserve_thinking, add_vision_id, special tokens, ...).
    Returns:
        str: the prompt text (special tokens as text; encode it with `Tokenizer.encode`).
    """
    return compile_chat_template(template).render(
        messages=[_prepare_message(m) for m in messages],
        tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
        **kwargs,
    )


# The tokenizer

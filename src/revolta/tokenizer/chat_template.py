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


def resolve_generation_prompt(add_generation_prompt: bool | None, continue_final_message: bool) -> bool:
    """Whether to end with a new assistant header: None means "unless continuing the final message".

    Raises:
        ValueError: both are true (vLLM refuses the pair too: a new turn cannot also continue the last one).
    """
    if add_generation_prompt is None:
        return not continue_final_message
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true: pass "
                         "add_generation_prompt=False to continue the final assistant message")
    return bool(add_generation_prompt)


# Placed after the text to continue, then cut off with everything the template renders after it (the end-of-turn
# token, later parts). The space after it shows whether the template trims the message's text: if it survives,
# the template keeps the text's own trailing whitespace too; if not, the whitespace goes (as transformers does).
_CONTINUE_MARK = "<|revolta_continue_final_message|>"
_CONTINUE_PAD = " "


def _mark_final(message: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The final message with the continuation mark after its text, and that text (for its trailing whitespace).

    A string content that opens `<think>` and never closes it continues the reasoning: it becomes
    `reasoning_content`, which Qwen templates render right after `<think>\n`, so the model goes on thinking.
    Otherwise the answer text is continued (after the message's reasoning, rendered closed).
    """
    if message.get("role") != "assistant":
        raise ValueError("continue_final_message continues the last message, which must be the assistant's, but "
                         f"it is a {message.get('role')!r} message; append the assistant text to continue, or "
                         "drop continue_final_message to start a new reply")
    if message.get("tool_calls"):
        raise ValueError("continue_final_message continues text, but the final assistant message has tool_calls "
                         "(they would render after the cut and be lost); send their results as tool messages")
    out = dict(message)
    content = out.get("content")
    mark = _CONTINUE_MARK + _CONTINUE_PAD
    if isinstance(content, str) and "<think>" in content and "</think>" not in content \
            and not isinstance(out.get("reasoning_content"), str) and not content.split("<think>")[0].strip():
        reasoning = content.split("<think>", 1)[1]
        out.update(content="", reasoning_content=reasoning + mark)
        return out, reasoning
    if content is None or isinstance(content, str):
        out["content"] = (content or "") + mark
        return out, content or ""
    parts = [dict(p) if isinstance(p, Mapping) else p for p in content]
    for part in reversed(parts):  # the last text part, as transformers picks it
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            text = part["text"]
            part["text"] = text + mark
            out["content"] = parts
            return out, text
    out["content"] = parts + [{"type": "text", "text": mark}]
    return out, ""


def _cut_at_mark(rendered: str, text: str) -> str:
    """`rendered` up to the continuation mark, without what the template renders after the message's text."""
    at = rendered.rfind(_CONTINUE_MARK)
    if at < 0 or rendered.find(_CONTINUE_MARK) != at:
        raise ValueError("continue_final_message: the chat template did not render the final message's text "
                         "exactly once, so there is no place to continue from; use a template that renders it")
    head = rendered[:at]
    # An all-whitespace text trims to nothing: then what precedes the mark is the template's own, and stays.
    trailing = text[len(text.rstrip()):] if text.strip() else ""
    if rendered.startswith(_CONTINUE_PAD, at + len(_CONTINUE_MARK)) or not trailing:
        return head
    return head.removesuffix(trailing)  # the template trims the text, so the prompt must not keep its whitespace


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool | None = None,
    enable_thinking: bool = True,
    continue_final_message: bool = False,
    **kwargs: Any,
) -> str:
    """Render `messages` (and `tools`) with a jinja chat template, as `transformers` would.

    Args:
        template: jinja source (the checkpoint's, or the preset).
        messages: [{role, content, ...}]; content is a str or a list of parts
            {type: text|image|image_url|video|video_url, ...}; assistant `tool_calls` arguments may be a
            dict or a JSON string; `reasoning` is accepted as an alias of `reasoning_content`.
        tools: OpenAI-style tool definitions, or None.
        add_generation_prompt: end with the opening of an assistant turn; None (default): unless
            continue_final_message.
        enable_thinking: False pre-closes the think block of the generation prompt (no effect when continuing).
        continue_final_message: leave the final (assistant) message open so that generation continues it
            (vLLM's and transformers' prefill): the conversation is rendered without a generation prompt and
            cut right after that message's text, dropping the template's end of turn. Its reasoning
            (`reasoning_content`, or a closed `<think>` block in content) stays closed before it, so with
            Qwen templates the model continues the answer, not the reasoning; a content that opens `<think>`
            without closing it continues the reasoning instead. Trailing whitespace of the text is kept only if
            the template keeps it (the preset trims it, as transformers' cut does).
        **kwargs: more template variables (preserve_thinking, add_vision_id, special tokens, ...).
    Returns:
        str: the prompt text (special tokens as text; encode it with `Tokenizer.encode`).
    Raises:
        ValueError: continue_final_message with add_generation_prompt=True, with a last message that is not the
            assistant's, or with a final message that has tool_calls.
    """
    add_generation_prompt = resolve_generation_prompt(add_generation_prompt, continue_final_message)
    prepared = [_prepare_message(m) for m in messages]
    text = ""
    if continue_final_message:
        if not prepared:
            raise ValueError("continue_final_message needs a conversation ending with an assistant message")
        prepared[-1], text = _mark_final(prepared[-1])
    rendered = compile_chat_template(template).render(
        messages=prepared,
        tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
        **kwargs,
    )
    return _cut_at_mark(rendered, text) if continue_final_message else rendered

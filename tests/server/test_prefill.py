"""Assistant prefill over HTTP: vLLM's continue_final_message / add_generation_prompt on chat completions and
/tokenize, and Anthropic's trailing assistant message. The real server app on a ScriptedLLM (scripted_llm.py):
the prompt the engine got is checked exactly, and the answer must be only the continuation."""

from __future__ import annotations

import httpx
import pytest

from .conftest import anthropic_client, openai_client

M = "scripted"
ASK = [{"role": "user", "content": "2+2?"}]
PREFILL = [*ASK, {"role": "assistant", "content": "The answer is"}]
HEAD = "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
OPEN = HEAD + "<think>\n\n</think>\n\nThe answer is"  # the prefill left open: no <|im_end|>, no new header


@pytest.fixture(scope="module")
def oc(scripted):
    return openai_client(scripted[1])


@pytest.fixture(scope="module")
def ac(scripted):
    return anthropic_client(scripted[1])


@pytest.mark.parametrize("extra", [{"continue_final_message": True, "add_generation_prompt": False},
                                   {"continue_final_message": True}])  # omitted: false when continuing
def test_chat_continues_the_final_message(oc, say, extra):
    say(" 4.")
    r = oc.chat.completions.create(model=M, messages=PREFILL, max_tokens=20, extra_body=extra)
    assert say.prompt() == OPEN
    message = r.choices[0].message
    assert message.content == " 4." and message.model_extra["reasoning"] is None  # thinking on, yet no reasoning
    say(" 4.")
    chunks = list(oc.chat.completions.create(model=M, messages=PREFILL, max_tokens=20, stream=True, extra_body=extra))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " 4."


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])  # the prefill decides, not the header's flag
def test_chat_continues_open_reasoning(oc, say, kwargs):
    """A prefill that opens <think> without closing it continues the reasoning."""
    say("Let me add.</think>\n\n4")
    messages = [*ASK, {"role": "assistant", "content": "<think>\nFirst"}]
    r = oc.chat.completions.create(model=M, messages=messages, max_tokens=20,
                                   extra_body={"continue_final_message": True, "chat_template_kwargs": kwargs})
    assert say.prompt() == HEAD + "<think>\nFirst"
    assert r.choices[0].message.model_extra["reasoning"] == "Let me add."
    assert r.choices[0].message.content == "4"


def test_add_generation_prompt_false_renders_no_header(oc, say):
    say("x")
    oc.chat.completions.create(model=M, messages=ASK, max_tokens=5, extra_body={"add_generation_prompt": False})
    assert say.prompt() == "<|im_start|>user\n2+2?<|im_end|>\n"


@pytest.mark.parametrize("messages, extra, says, param", [
    (PREFILL, {"continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message and add_generation_prompt cannot both be true", "continue_final_message"),
    (ASK, {"continue_final_message": True, "add_generation_prompt": False},
     "must be the assistant's, but it is a 'user' message", "messages"),
    (PREFILL, {"continue_final_message": True, "tool_choice": "required",
               "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
     "needs add_generation_prompt and no continue_final_message", "tool_choice"),
])  # fmt: skip
def test_impossible_combinations_are_400(scripted, messages, extra, says, param):
    r = httpx.post(scripted[1] + "/v1/chat/completions", json={"model": M, "messages": messages, **extra}, timeout=10)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert says in error["message"] and error["param"] == param


def test_tokenize_counts_the_open_prompt(scripted):
    tok = scripted[0].tokenizer
    r = httpx.post(scripted[1] + "/tokenize", json={"model": M, "messages": PREFILL, "continue_final_message": True,
                                                    "add_generation_prompt": False}, timeout=10)
    assert r.status_code == 200 and r.json()["tokens"] == tok.encode(OPEN)


def test_anthropic_prefill_returns_only_the_continuation(ac, say):
    say(" 4.")
    r = ac.messages.create(model=M, max_tokens=20, messages=PREFILL)
    assert say.prompt() == OPEN
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == " 4."
    assert r.stop_reason == "end_turn"
    assert ac.messages.count_tokens(model=M, messages=PREFILL).input_tokens == r.usage.input_tokens
    say(" 4.")
    with ac.messages.stream(model=M, max_tokens=20, messages=PREFILL) as s:
        events = list(s)
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["text"] and final.content[0].text == " 4."
    assert not any(e.type == "content_block_start" and e.content_block.type == "thinking" for e in events)


def test_anthropic_without_prefill_opens_a_new_turn(ac, say):
    say("Hi.")
    ac.messages.create(model=M, max_tokens=20, messages=ASK)
    assert say.prompt() == HEAD + "<think>\n"

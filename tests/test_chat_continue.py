"""Assistant prefill: `continue_final_message` / `add_generation_prompt` rendering with the preset chat template
(exact strings), its errors, and parity with transformers' `continue_final_message` cut. No tokenizer needed."""

from __future__ import annotations

import pytest

from revolta.tokenizer import PRESET_CHAT_TEMPLATE, render_chat_template

TEMPLATE = PRESET_CHAT_TEMPLATE.read_text()
USER = [{"role": "user", "content": "2+2?"}]
HEAD = "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
CLOSED = "<think>\n\n</think>\n\n"  # the empty, closed reasoning block the template renders before the answer


def render(messages, **kwargs):
    return render_chat_template(TEMPLATE, messages, **kwargs)


def prefill(content, **fields):
    return USER + [{"role": "assistant", "content": content, **fields}]


def test_generation_prompt_modes():
    assert render(USER) == HEAD + "<think>\n"
    assert render(USER, add_generation_prompt=True) == HEAD + "<think>\n"
    assert render(USER, add_generation_prompt=False) == "<|im_start|>user\n2+2?<|im_end|>\n"
    done = prefill("4")  # a finished assistant turn, rendered closed
    assert render(done, add_generation_prompt=False) == HEAD + CLOSED + "4<|im_end|>\n"


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("content, tail", [
    ("The answer is", CLOSED + "The answer is"),
    ("The answer is  \n", CLOSED + "The answer is"),  # the template trims the text, so the cut does too
    ("", CLOSED),  # an empty prefill still skips the reasoning: the answer starts at once
    ([{"type": "text", "text": "A"}, {"type": "text", "text": "B"}], CLOSED + "AB"),
    ("r</think>\n\nSo", "<think>\nr\n</think>\n\nSo"),  # given reasoning stays, closed
    ("<think>\nFirst I", "<think>\nFirst I"),  # an unclosed <think> continues the reasoning itself
    ("<think>\n", "<think>\n"),
])  # fmt: skip
def test_continue_final_message_cuts_after_the_text(content, tail, thinking):
    """The end of turn and anything after it are gone; enable_thinking only shapes a new turn's header."""
    out = render(prefill(content), continue_final_message=True, enable_thinking=thinking)
    assert out == HEAD + tail
    assert render(prefill(content), continue_final_message=True, add_generation_prompt=False,
                  enable_thinking=thinking) == out


def test_continue_keeps_reasoning_content_closed():
    out = render(prefill("x", reasoning_content="think more"), continue_final_message=True)
    assert out == HEAD + "<think>\nthink more\n</think>\n\nx"


def test_continue_errors_name_the_fix():
    with pytest.raises(ValueError, match="cannot both be true: pass add_generation_prompt=False"):
        render(prefill("x"), continue_final_message=True, add_generation_prompt=True)
    with pytest.raises(ValueError, match="must be the assistant's, but it is a 'user' message"):
        render(USER, continue_final_message=True)
    call = {"function": {"name": "f", "arguments": {}}}
    with pytest.raises(ValueError, match="has tool_calls"):
        render(prefill("x", tool_calls=[call]), continue_final_message=True)
    with pytest.raises(ValueError, match="did not render the final message's text"):
        render_chat_template("{% for m in messages %}{{ m.role }}{% endfor %}", prefill("x"),
                             continue_final_message=True)


def test_matches_transformers_continue_final_message():
    chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    conversations = [
        prefill("The answer is"),
        prefill("The answer is \n"),
        prefill("x", reasoning_content="r"),
        prefill([{"type": "text", "text": "A"}, {"type": "text", "text": "B "}]),
        [{"role": "system", "content": "s"}, *prefill("1"), {"role": "user", "content": "again"},
         {"role": "assistant", "content": "Sure,"}],
    ]  # fmt: skip
    for messages in conversations:
        hf, _ = chat_utils.render_jinja_template([messages], chat_template=TEMPLATE, continue_final_message=True)
        assert render(messages, continue_final_message=True) == hf[0]

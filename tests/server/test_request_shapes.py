"""Request shapes the official SDKs send that once slipped through: a non-text `system` block on /v1/messages
(Anthropic takes text blocks only) and several prompts in one streamed /v1/completions request (vLLM streams
them, choice index = prompt * n + sample). The real server app on a ScriptedLLM (scripted_llm.py)."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from .conftest import anthropic_client, openai_client

M = "scripted"
HI = [{"role": "user", "content": "hi"}]
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


@pytest.fixture(scope="module")
def ac(scripted):
    return anthropic_client(scripted[1])


@pytest.fixture(scope="module")
def oc(scripted):
    return openai_client(scripted[1])


@pytest.mark.parametrize("block", [IMAGE, {"type": "document", "source": {"type": "text", "data": "x"}}])
def test_system_takes_text_blocks_only(ac, say, block):
    system = [{"type": "text", "text": "Be brief."}, block]
    for call in (lambda: ac.messages.create(model=M, max_tokens=4, system=system, messages=HI),
                 lambda: ac.messages.create(model=M, max_tokens=4, system=system, messages=HI, stream=True),
                 lambda: ac.messages.count_tokens(model=M, system=system, messages=HI)):
        with pytest.raises(anthropic.BadRequestError) as e:
            call()
        assert e.value.type == "invalid_request_error"
        assert "system[1]" in e.value.message and repr(block["type"]) in e.value.message
    say("Ok.")  # text blocks, cache_control and all, still reach the prompt
    cached = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": " Answer in French."}]
    answer = ac.messages.create(model=M, max_tokens=4, system=cached, messages=HI, thinking={"type": "disabled"})
    assert [(b.type, b.text) for b in answer.content] == [("text", "Ok.")]
    assert "Be brief. Answer in French." in say.prompt()


def _chunks(scripted, body: dict) -> list[dict]:
    with httpx.stream("POST", scripted[1] + "/v1/completions", json={"model": M, "stream": True, **body},
                      timeout=30) as r:
        assert r.status_code == 200, r.read()
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_completions_stream_several_prompts(scripted, say, oc):
    """Two prompts x n=2: each choice streams under index prompt * n + sample, one usage chunk sums all."""
    tok = scripted[0].tokenizer
    texts = ["alpha beta", "gamma", "delta epsilon zeta", "eta"]  # prompts are submitted in order, samples in turn
    say(*texts)
    chunks = _chunks(scripted, {"prompt": ["one", "two three"], "n": 2, "max_tokens": 16,
                                "stream_options": {"include_usage": True}})
    *choice_chunks, usage = chunks
    assert usage["choices"] == [] and all(c.get("usage") is None for c in choice_chunks)
    by_index: dict[int, str] = {}
    finished = set()
    for c in choice_chunks:
        [choice] = c["choices"]
        assert choice["index"] not in finished  # nothing after a choice's finish
        by_index[choice["index"]] = by_index.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"] is not None:
            finished.add(choice["index"])
    assert finished == {0, 1, 2, 3}
    prompt_tokens = len(tok.encode("one")) + len(tok.encode("two three"))
    assert by_index == dict(enumerate(texts))
    assert usage["usage"]["prompt_tokens"] == prompt_tokens
    assert usage["usage"]["completion_tokens"] == sum(len(tok.encode(t)) for t in texts)
    # token-id prompts too, through the SDK, and the first choice of each prompt is that prompt's own
    say("x y", "z")
    ids = [tok.encode("one"), tok.encode("two three")]
    streamed = list(oc.completions.create(model=M, prompt=ids, max_tokens=16, stream=True))
    text = {}
    for c in streamed:
        for choice in c.choices:
            text[choice.index] = text.get(choice.index, "") + choice.text
    assert text == {0: "x y", 1: "z"}
    assert scripted[0].prompts[-2:] == ids

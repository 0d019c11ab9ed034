"""The engine thread's failure handling and the body-size cap, on the real app with a scripted engine."""

from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest

from .conftest import run_scripted

ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def scripted():
    with run_scripted(max_body_bytes=100_000) as s:
        yield s


def test_a_failing_step_fails_only_its_requests(scripted):
    llm, url = scripted
    oc = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    real_step = llm.step

    def failing_step():
        llm.step = real_step  # fail once
        raise RuntimeError("simulated kernel failure")

    llm.scripts.extend(["doomed", "fine"])
    llm.step = failing_step
    with pytest.raises(openai.InternalServerError) as e:
        oc.chat.completions.create(model="scripted", messages=ASK, max_tokens=8)
    assert "simulated kernel failure" in e.value.message
    r = oc.chat.completions.create(model="scripted", messages=ASK, max_tokens=8,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == "fine"


def test_body_size_cap_is_413(scripted):
    _, url = scripted
    big = {"model": "scripted", "max_tokens": 1, "messages": [{"role": "user", "content": "x" * 200_000}]}
    r = httpx.post(url + "/v1/chat/completions", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    with pytest.raises(anthropic.APIStatusError) as e:
        anthropic.Anthropic(base_url=url, api_key="x", max_retries=0).messages.create(**big)
    assert e.value.status_code == 413 and e.value.type == "request_too_large"


def test_dead_engine_loop_turns_health_503(scripted):
    """Last in the module: it kills the loop."""
    llm, url = scripted
    assert httpx.get(url + "/health").status_code == 200

    def broken() -> bool:
        raise SystemError("engine state corrupted")

    llm.has_unfinished_requests = broken
    deadline = time.monotonic() + 5
    while httpx.get(url + "/health").status_code != 503:
        assert time.monotonic() < deadline, "/health did not report the dead engine"
        time.sleep(0.1)
    r = httpx.post(url + "/v1/chat/completions", json={"model": "scripted", "messages": ASK, "max_tokens": 1})
    assert r.status_code == 503 and "not running" in r.json()["error"]["message"]

"""spec/server.md §7 check 1 (after the engine is killed, /health is 503) and the queue-limit part of check 45
(overload beyond --max-pending-requests is a prompt 503, `overloaded_error` on /v1/messages), against a real
`revolta serve` subprocess of the embedded default: one server with a queue limit of one request, whose engine
loop the fault hook (`x-revolta-kill-engine`, --enable-fault-injection) kills in the last test."""

from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest

from .conftest import MODEL, run_server

ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def limited():
    with run_server("--max-pending-requests", "1", "--sse-keep-alive-interval", "0") as s:
        yield s


def _clients(url: str) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    return (openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0),
            anthropic.Anthropic(base_url=url, api_key="x", max_retries=0))


def _sdks_see_503(oc: openai.OpenAI, ac: anthropic.Anthropic) -> None:
    """Both SDKs raise their 503 error: openai's InternalServerError, anthropic's `overloaded_error`."""
    with pytest.raises(openai.InternalServerError) as e:
        oc.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    assert e.value.status_code == 503
    with pytest.raises(anthropic.APIStatusError) as e:
        ac.messages.create(model=MODEL, max_tokens=2, messages=ASK)
    assert e.value.status_code == 503 and e.value.type == "overloaded_error"


def _next_frame(lines) -> str:
    return next(line for line in lines if line)  # SSE events are separated by blank lines


def test_overload_beyond_the_queue_limit_is_503(limited):
    oc, ac = _clients(limited.url)
    body = {"model": MODEL, "messages": ASK, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", limited.url + "/v1/chat/completions", json=body, timeout=60) as first:
        lines = first.iter_lines()  # kept: dropping the iterator would close the connection
        assert _next_frame(lines).startswith("data:")  # the one allowed request is in flight
        start = time.monotonic()
        r = httpx.post(limited.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "max-pending-requests" in r.json()["error"]["message"]
        _sdks_see_503(oc, ac)
        assert time.monotonic() - start < 2  # refused at once, not after the running request
        assert _next_frame(lines).startswith("data:")  # the running stream is unharmed
    deadline = time.monotonic() + 5  # leaving the stream aborts it; then there is room again
    while (r := httpx.post(limited.url + "/v1/chat/completions",
                           json={**body, "stream": False, "max_tokens": 2}, timeout=30)).status_code == 503:
        assert time.monotonic() < deadline, "the aborted stream still holds the queue slot"
        time.sleep(0.05)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_killed_engine_turns_health_503(limited):
    """Last in the module: it kills the engine loop (the process stays up and answers every route)."""
    oc, ac = _clients(limited.url)
    assert httpx.get(limited.url + "/health").status_code == 200
    r = httpx.post(limited.url + "/v1/chat/completions", headers={"x-revolta-kill-engine": "1"},
                   json={"model": MODEL, "messages": ASK, "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and "not running" in r.json()["error"]["message"]  # answered, not left hanging
    deadline = time.monotonic() + 5
    while (h := httpx.get(limited.url + "/health")).status_code != 503:
        assert time.monotonic() < deadline, "/health did not report the dead engine"
        time.sleep(0.1)
    assert h.content == b""
    _sdks_see_503(oc, ac)
    assert oc.models.list().data[0].id == MODEL  # the HTTP side keeps answering
    assert limited.proc.poll() is None
    assert "the engine loop died" in limited.log()

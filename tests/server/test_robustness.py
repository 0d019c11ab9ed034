"""spec/server.md §7 D30 and H: API keys, keep-alive comments, disconnects freeing the cache, concurrency.

This module runs its own server with --api-key and a tiny --sse-keep-alive-interval.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest

from .conftest import MODEL, run_server, sse_lines

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
HI = [{"role": "user", "content": "hi"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def srv():
    with run_server("--api-key", KEY, "--sse-keep-alive-interval", "0.05") as s:
        yield s


@pytest.fixture(scope="module")
def clients(srv):
    return (openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0),
            anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0))


def idle_state(srv) -> tuple[float, float]:
    return srv.metric("vllm:num_requests_running", AUTH), srv.metric("revolta:kv_cache_free_blocks", AUTH)


def wait_for_idle(srv, free_blocks: float, within_s: float = 2.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        running, free = idle_state(srv)
        if running == 0 and free == free_blocks and srv.metric("vllm:num_requests_waiting", AUTH) == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"not back to idle within {within_s} s: running={running}, free blocks {free} "
                         f"(want {free_blocks})")


def long_messages(srv, tokens: int = 1500) -> list[dict]:
    text = "word " * tokens
    assert httpx.post(srv.url + "/tokenize", json={"prompt": text}, headers=AUTH).json()["count"] >= tokens
    return [{"role": "user", "content": text}]


# ---- D30: authentication ----------------------------------------------------------------------
def test_api_key(srv, clients):
    oc, ac = clients
    chat = {"model": MODEL, "messages": HI, "max_tokens": 1}
    msg = {"model": MODEL, "messages": HI, "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
        r = httpx.post(srv.url + "/v1/chat/completions", json=chat, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
        r = httpx.post(srv.url + "/v1/messages", json=msg, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.post(srv.url + "/v1/messages/count_tokens", json=msg, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(srv.url + "/metrics", headers=headers).status_code == 401
    for headers in (AUTH, {"x-api-key": KEY}):
        assert httpx.post(srv.url + "/v1/chat/completions", json=chat, headers=headers).status_code == 200
        assert httpx.post(srv.url + "/v1/messages", json=msg, headers=headers).status_code == 200
    assert httpx.get(srv.url + "/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0).messages.create(**msg)
    assert e.value.type == "authentication_error"
    assert oc.models.list().data[0].id == MODEL and ac.messages.create(**msg).usage.input_tokens > 0


# ---- H43: keep-alive on a slow prefill --------------------------------------------------------
@pytest.mark.parametrize("route", ["chat", "completions", "responses", "messages"])
def test_keep_alive_before_first_token(srv, route):
    messages = long_messages(srv)
    body = {"chat": {"messages": messages, "max_tokens": 2},
            "completions": {"prompt": messages[0]["content"], "max_tokens": 2},
            "responses": {"input": messages[0]["content"], "max_output_tokens": 2},
            "messages": {"messages": messages, "max_tokens": 2}}[route]
    path = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses",
            "messages": "/v1/messages"}[route]
    with httpx.stream("POST", srv.url + path, json={"model": MODEL, "stream": True, "temperature": 0, **body},
                      headers=AUTH) as r:
        lines = sse_lines(r)
    comments = [i for i, line in enumerate(lines) if line.startswith(":")]
    assert comments and all(lines[i] == ": keep-alive" for i in comments)
    # a comment arrives before the first token's frame (the prefill is silent for more than 0.05 s)
    token_marks = {"chat": '"delta": {"reasoning"', "completions": '"text": ', "responses": "reasoning_text.delta",
                   "messages": "thinking_delta"}
    first_token = next(i for i, line in enumerate(lines) if token_marks[route] in line)
    assert comments[0] < first_token
    for i in comments:  # only ever between whole events
        assert i == 0 or not lines[i - 1].startswith("event:")


def test_sdks_parse_streams_with_keep_alive(srv, clients):
    oc, ac = clients
    messages = long_messages(srv, 800)
    text = "".join(c.choices[0].delta.content or "" for c in oc.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0, stream=True, extra_body=NO_THINK) if c.choices)
    plain = oc.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                       extra_body=NO_THINK)
    assert text
    assert text == plain.choices[0].message.content
    with ac.messages.stream(model=MODEL, max_tokens=3, messages=messages) as s:
        assert s.get_final_message().usage.output_tokens == 3


# ---- H44: disconnects abort and free the cache ------------------------------------------------
def test_disconnect_mid_stream_frees_cache(srv, clients):
    oc, _ = clients
    oc.chat.completions.create(model=MODEL, messages=HI, max_tokens=1)
    running, baseline = idle_state(srv)
    assert running == 0
    aborted_before = srv.metric('vllm:request_success_total{model_name="revolta-default",finished_reason="abort"}',
                                AUTH)
    for _ in range(5):
        with httpx.stream("POST", srv.url + "/v1/chat/completions", headers=AUTH,
                          json={"model": MODEL, "messages": HI, "max_tokens": 1000, "ignore_eos": True,
                                "stream": True}) as r:
            data = 0
            for line in r.iter_lines():
                data += line.startswith("data:")
                if data == 5:
                    break
        wait_for_idle(srv, baseline)
    aborted = srv.metric('vllm:request_success_total{model_name="revolta-default",finished_reason="abort"}', AUTH)
    assert aborted == aborted_before + 5
    assert oc.chat.completions.create(model=MODEL, messages=HI, max_tokens=2).choices[0].finish_reason


def test_disconnect_during_prefill_and_non_stream(srv, clients):
    oc, _ = clients
    messages = long_messages(srv)
    oc.chat.completions.create(model=MODEL, messages=HI, max_tokens=1)
    _, baseline = idle_state(srv)
    with httpx.stream("POST", srv.url + "/v1/chat/completions", headers=AUTH,
                      json={"model": MODEL, "messages": messages, "max_tokens": 1000, "stream": True}) as r:
        next(r.iter_lines())  # the role chunk: the engine is still prefilling; then the iterator is dropped
    wait_for_idle(srv, baseline)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/chat/completions", headers=AUTH, timeout=0.5,
                   json={"model": MODEL, "messages": HI, "max_tokens": 1000, "ignore_eos": True})
    wait_for_idle(srv, baseline)
    assert oc.chat.completions.create(model=MODEL, messages=HI, max_tokens=2).choices[0].finish_reason


# ---- H45: concurrency -------------------------------------------------------------------------
def test_concurrent_streams_are_independent(srv, clients):
    oc, _ = clients
    prompts = [f"question number {i}" for i in range(8)]
    solo = [oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=4,
                                       temperature=0, extra_body=NO_THINK).choices[0].message.content
            for p in prompts]
    assert all(solo)

    def stream(i: int) -> tuple[str, str]:
        route = ("chat", "messages", "responses")[i % 3]
        messages = [{"role": "user", "content": prompts[i]}]
        path, body = {"chat": ("/v1/chat/completions", {"messages": messages, "max_tokens": 4}),
                      "messages": ("/v1/messages", {"messages": messages, "max_tokens": 4}),
                      "responses": ("/v1/responses", {"input": prompts[i], "max_output_tokens": 4})}[route]
        with httpx.stream("POST", srv.url + path, headers=AUTH, timeout=60,
                          json={"model": MODEL, "temperature": 0, "stream": True, **NO_THINK, **body}) as r:
            lines = [line for line in sse_lines(r) if not line.startswith(":")]
        text, ident = "", None
        for line in lines:
            if not line.startswith("data: {"):
                continue
            d = json.loads(line[6:])
            if route == "chat":
                ident = d["id"]
                text += "".join(c["delta"].get("content") or "" for c in d["choices"])
            elif route == "messages":
                ident = ident or d.get("message", {}).get("id")
                text += d.get("delta", {}).get("text", "") if d["type"] == "content_block_delta" else ""
            else:
                ident = ident or d.get("response", {}).get("id")
                text += d["delta"] if d["type"] == "response.output_text.delta" else ""
        if route == "chat":
            assert lines[-1] == "data: [DONE]"
        else:
            ends = ("event: message_stop",) if route == "messages" else \
                ("event: response.completed", "event: response.incomplete")
            assert lines[-2] in ends, lines[-2:]
        return ident, text

    def plain(i: int) -> tuple[str, str]:
        r = oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompts[i]}],
                                       max_tokens=4, temperature=0, extra_body=NO_THINK)
        return r.id, r.choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        streams = [pool.submit(stream, i) for i in range(8)]
        plains = [pool.submit(plain, i) for i in range(8)]
        results = [f.result() for f in streams] + [f.result() for f in plains]
    assert len({ident for ident, _ in results}) == 16
    assert [text for _, text in results] == solo + solo

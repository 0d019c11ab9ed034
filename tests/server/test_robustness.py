"""spec/server.md §7 D30 and H44-H45: API keys, disconnects freeing the cache, concurrency (keep-alive: H43 in
test_keep_alive.py).

This module runs its own server with --api-key and a tiny --sse-keep-alive-interval (the first thing a stream
sends during a prefill is then a comment, which the prefill-disconnect test waits for).
"""

from __future__ import annotations

import json
import re
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


# ---- H44: disconnects abort and free the cache ------------------------------------------------
REPEATS = 20  # spec/server.md §7 H44: no KV-cache creep after 20 repetitions
ABORT_METRIC = 'vllm:request_success_total{model_name="revolta-default",finished_reason="abort"}'
ABORT_LOG = re.compile(r"Request [0-9a-f]+ aborted\.")


def aborts(srv) -> tuple[float, int]:
    """Aborts as /metrics counts them and as the server log reports them ("Request <id> aborted.")."""
    return srv.metric(ABORT_METRIC, AUTH), len(ABORT_LOG.findall(srv.log()))


def check_aborted(srv, oc, baseline: float, before: tuple[float, int], k: int) -> None:
    """Within 2 s of the k-th disconnect: nothing running or waiting, every block free again, the abort on /metrics
    and in the log; then a new request succeeds."""
    wait_for_idle(srv, baseline)
    assert aborts(srv) == (before[0] + k, before[1] + k)
    assert oc.chat.completions.create(model=MODEL, messages=HI, max_tokens=1).choices[0].finish_reason


def test_disconnect_mid_stream_frees_cache(srv, clients):
    oc, _ = clients
    oc.chat.completions.create(model=MODEL, messages=HI, max_tokens=1)
    running, baseline = idle_state(srv)
    assert running == 0
    before = aborts(srv)
    for k in range(1, REPEATS + 1):
        with httpx.stream("POST", srv.url + "/v1/chat/completions", headers=AUTH,
                          json={"model": MODEL, "messages": HI, "max_tokens": 1000, "ignore_eos": True,
                                "stream": True}) as r:
            data = 0
            for line in r.iter_lines():
                data += line.startswith("data:")
                if data == 5:
                    break
        assert data == 5
        check_aborted(srv, oc, baseline, before, k)
    assert idle_state(srv) == (0, baseline)  # no creep


def test_disconnect_during_prefill_and_non_stream(srv, clients):
    oc, _ = clients
    oc.chat.completions.create(model=MODEL, messages=HI, max_tokens=1)
    _, baseline = idle_state(srv)
    before = aborts(srv)
    for k in range(1, REPEATS // 2 + 1):  # 20 disconnects in all, alternating the two kinds
        # a prompt of its own each time (a prefix-cache hit would make the prefill instant): the client leaves at the
        # first keep-alive comment, while the engine is still prefilling and nothing else has been sent
        messages = [{"role": "user", "content": f"{k} " + "word " * 300}]
        with httpx.stream("POST", srv.url + "/v1/chat/completions", headers=AUTH,
                          json={"model": MODEL, "messages": messages, "max_tokens": 1000, "ignore_eos": True,
                                "stream": True}) as r:
            first = next(line for line in r.iter_lines() if line)
        assert first == ": keep-alive"
        check_aborted(srv, oc, baseline, before, 2 * k - 1)
        with pytest.raises(httpx.ReadTimeout):  # the client gives up on a long non-streaming answer
            httpx.post(srv.url + "/v1/chat/completions", headers=AUTH, timeout=0.3,
                       json={"model": MODEL, "messages": HI, "max_tokens": 1000, "ignore_eos": True})
        check_aborted(srv, oc, baseline, before, 2 * k)
    assert idle_state(srv) == (0, baseline)


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

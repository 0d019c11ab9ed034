"""spec/server.md §7 D30 and H44-H45: API keys, disconnects freeing the cache, concurrency (keep-alive: H43 in
test_keep_alive.py).

This module runs its own server with --api-key and a tiny --sse-keep-alive-interval (the first thing a stream
sends during a prefill is then a comment, which the prefill-disconnect test waits for).
"""

from __future__ import annotations

import base64
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest

from .conftest import MODEL, run_server, sse_lines
from .test_media import png as media_png

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
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city"]}


def mixed_request(i: int, route: str, stream: bool) -> tuple[str, dict]:
    """Request i on `route`: odd ones carry the weather tool, every fourth (2, 6) a 64x64 PNG."""
    text, tool, picture = f"question number {i}", i % 2 == 1, i % 4 == 2
    png = base64.b64encode(media_png(seed=i)).decode()
    if route == "chat":
        content = [{"type": "text", "text": text}] + \
            ([{"type": "image_url", "image_url": {"url": "data:image/png;base64," + png}}] if picture else [])
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4}
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
        path = "/v1/chat/completions"
    elif route == "messages":
        content = ([{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}]
                   if picture else []) + [{"type": "text", "text": text}]
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4}
        tools = [{"name": "get_weather", "input_schema": PARAMS}]
        path = "/v1/messages"
    else:
        content = [{"type": "input_text", "text": text}] + \
            ([{"type": "input_image", "image_url": "data:image/png;base64," + png}] if picture else [])
        body = {"input": [{"role": "user", "content": content}], "max_output_tokens": 4}
        tools = [{"type": "function", "name": "get_weather", "parameters": PARAMS}]
        path = "/v1/responses"
    return path, {"model": MODEL, "temperature": 0, "stream": stream, **NO_THINK, **body,
                  **({"tools": tools} if tool else {})}


def answer(route: str, r: httpx.Response) -> tuple[str, str]:
    """(id, text) of a non-streaming answer."""
    d = r.json()
    assert r.status_code == 200, d
    if route == "chat":
        return d["id"], d["choices"][0]["message"]["content"] or ""
    if route == "messages":
        return d["id"], "".join(b.get("text", "") for b in d["content"])
    return d["id"], "".join(p["text"] for item in d["output"] if item["type"] == "message" for p in item["content"])


def streamed_answer(route: str, r: httpx.Response) -> tuple[str, str]:
    """(id, text) of a stream, which must end as its API says."""
    assert r.status_code == 200
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


def test_concurrent_streams_are_independent(srv):
    """8 streams (chat, messages, responses; with and without a tool and an image) and 8 non-streaming chat requests
    at once: all finish, ids are unique, and each greedy answer equals the same request's answer run alone."""
    streams = [(("chat", "messages", "responses")[i % 3], i) for i in range(8)]
    plains = [("chat", i) for i in range(8)]

    def run(route: str, i: int, stream: bool) -> tuple[str, str]:
        path, body = mixed_request(i, route, stream)
        if not stream:
            return answer(route, httpx.post(srv.url + path, headers=AUTH, timeout=120, json=body))
        with httpx.stream("POST", srv.url + path, headers=AUTH, timeout=120, json=body) as r:
            return streamed_answer(route, r)

    solo = [run(route, i, False)[1] for route, i in streams + plains]
    assert all(solo)
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(run, route, i, True) for route, i in streams] + \
            [pool.submit(run, route, i, False) for route, i in plains]
        results = [f.result() for f in futures]
    assert len({ident for ident, _ in results}) == 16
    assert [text for _, text in results] == solo

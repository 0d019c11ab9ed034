"""spec/server.md §7 H43: `: keep-alive` comments during a long prefill on all four streaming endpoints, parsed by the
official SDKs, with the same content as without them; none at --sse-keep-alive-interval 0.

One server (--sse-keep-alive-interval 1, --max-num-seqs 1) gets one long prompt on chat, completions (the same
token ids), responses and messages at once. The first request admitted runs the whole prefill; the other three wait
in the queue behind it (one sequence at a time) and then hit the prefix cache. Every client so sits through the
whole prefill before its first frame, the silence the comments exist for, at the price of one prefill.

The spec's prompt is 60-80K tokens, and CI runs 70,000 (a CPU prefill of ~35 s on the embedded default with
the vectorised QSA prefill path; REVOLTA_KEEPALIVE_TOKENS sets another size).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import anthropic
import httpx
import openai
import pytest

from .conftest import MODEL, run_server

try:  # the HTTP library the SDKs are built on: httpx2 in openai>=3.5x / anthropic>=2.1x, httpx before
    import httpx2 as sdk_http
except ImportError:
    sdk_http = httpx

PROMPT_TOKENS = int(os.environ.get("REVOLTA_KEEPALIVE_TOKENS", "70000"))
MAX_TOKENS = 4
TIMEOUT_S = 1200  # the whole prefill happens before the first byte of a body


class _TeeStream(sdk_http.SyncByteStream):
    def __init__(self, inner: Any, tee: "Tee"):
        self.inner, self.tee = inner, tee

    def __iter__(self):
        for chunk in self.inner:
            if not self.tee.raw:
                self.tee.first_at = time.monotonic()
            self.tee.raw += chunk
            yield chunk

    def close(self) -> None:
        self.inner.close()


class Tee(sdk_http.BaseTransport):
    """An HTTP transport that keeps the raw bytes of the response body an SDK parses (the SSE stream as sent)."""

    def __init__(self) -> None:
        self.inner = sdk_http.HTTPTransport()
        self.raw = bytearray()
        self.sent_at = self.first_at = 0.0

    def handle_request(self, request: Any) -> Any:
        self.sent_at = time.monotonic()
        response = self.inner.handle_request(request)
        return sdk_http.Response(response.status_code, headers=response.headers, extensions=response.extensions,
                              stream=_TeeStream(response.stream, self))

    def lines(self) -> list[str]:
        return [line for line in self.raw.decode().splitlines() if line]

    @property
    def silence_s(self) -> float:
        """From sending the request to the first byte of its body."""
        return self.first_at - self.sent_at


def sdk_clients(url: str, transport: Any = None) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    oc = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT_S,
                       http_client=sdk_http.Client(transport=transport, timeout=TIMEOUT_S))
    ac = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=TIMEOUT_S,
                             http_client=sdk_http.Client(transport=transport, timeout=TIMEOUT_S))
    return oc, ac


# Each endpoint: the answer's text (reasoning and content in order) from an SDK, streamed or not.
def chat(oc, ac, p: dict[str, Any], stream: bool) -> str:
    kwargs = {"model": MODEL, "messages": p["messages"], "max_tokens": MAX_TOKENS, "temperature": 0}
    if not stream:
        m = oc.chat.completions.create(**kwargs).choices[0].message
        return (getattr(m, "reasoning", None) or "") + (m.content or "")
    text = ""
    for chunk in oc.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            text += (getattr(c.delta, "reasoning", None) or "") + (c.delta.content or "")
    return text


def completions(oc, ac, p: dict[str, Any], stream: bool) -> str:
    kwargs = {"model": MODEL, "prompt": p["ids"], "max_tokens": MAX_TOKENS, "temperature": 0}
    if not stream:
        return oc.completions.create(**kwargs).choices[0].text
    return "".join(c.choices[0].text for c in oc.completions.create(**kwargs, stream=True) if c.choices)


def responses(oc, ac, p: dict[str, Any], stream: bool) -> str:
    kwargs = {"model": MODEL, "input": p["text"], "max_output_tokens": MAX_TOKENS, "temperature": 0}
    if not stream:
        r = oc.responses.create(**kwargs)
        return "".join(part.text for item in r.output if item.type in ("reasoning", "message")
                       for part in item.content)
    return "".join(e.delta for e in oc.responses.create(**kwargs, stream=True)
                   if e.type in ("response.reasoning_text.delta", "response.output_text.delta"))


def messages(oc, ac, p: dict[str, Any], stream: bool) -> str:
    # anthropic 2.x has no temperature argument any more; the server still reads the field
    kwargs = {"model": MODEL, "messages": p["messages"], "max_tokens": MAX_TOKENS, "extra_body": {"temperature": 0}}
    if stream:
        with ac.messages.stream(**kwargs) as s:
            message = s.get_final_message()
    else:
        message = ac.messages.create(**kwargs)
    return "".join(getattr(b, "thinking", None) or getattr(b, "text", "") for b in message.content)


ROUTES: dict[str, Callable[..., str]] = {"chat": chat, "completions": completions, "responses": responses,
                                         "messages": messages}


def long_prompt(url: str, tokens: int, nonce: str) -> dict[str, Any]:
    """One user message of about `tokens` tokens, and the token ids the chat template makes of it."""
    text = nonce + " " + "word " * tokens
    msgs = [{"role": "user", "content": text}]
    ids = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": msgs}, timeout=60).json()["tokens"]
    assert len(ids) >= tokens
    return {"text": text, "messages": msgs, "ids": ids}


@pytest.fixture(scope="module")
def keep_alive_server():
    # short steps (1,024-token prefill chunks): the engine thread accepts a request between two steps, so a
    # request arriving during a long step would get no response headers, hence no comments, until that step ends
    with run_server("--sse-keep-alive-interval", "1", "--max-num-seqs", "1", "--max-num-batched-tokens", "1024",
                    "--max-model-len", str(PROMPT_TOKENS + 512)) as s:
        yield s


def test_keep_alive_during_a_long_prefill_on_every_endpoint(keep_alive_server):
    url = keep_alive_server.url
    prompt = long_prompt(url, PROMPT_TOKENS, "keep-alive")
    tees = {route: Tee() for route in ROUTES}
    start = time.monotonic()
    first_byte: dict[str, float] = {}

    def run(route: str) -> str:
        oc, ac = sdk_clients(url, tees[route])
        return ROUTES[route](oc, ac, prompt, True)

    with ThreadPoolExecutor(len(ROUTES)) as pool:
        streamed = dict(zip(ROUTES, pool.map(run, ROUTES)))
    elapsed = time.monotonic() - start
    for route, tee in tees.items():
        lines = tee.lines()
        comments = [i for i, line in enumerate(lines) if line.startswith(":")]
        frames = [i for i, line in enumerate(lines) if line.startswith(("data:", "event:"))]
        assert comments and frames and comments[0] == 0 < frames[0], (route, lines[:5])  # a comment before any frame
        assert all(lines[i] == ": keep-alive" for i in comments)
        assert all(not lines[i - 1].startswith("event:") for i in comments if i)  # only between whole events
        first_byte[route] = frames[0]
    # the plain (keep-alive-free) answers, from the prefix cache now: the same text, so the comments changed nothing
    oc, ac = sdk_clients(url)
    for route, fn in ROUTES.items():
        assert streamed[route] and streamed[route] == fn(oc, ac, prompt, False), route
    print(f"{PROMPT_TOKENS}-token prompt on 4 endpoints: {elapsed:.1f} s; comments before the first frame: "
          f"{first_byte}")


def test_no_comments_at_interval_zero(server):
    """The session server runs with --sse-keep-alive-interval 0: four streams whose prefill keeps them silent for
    over a second carry no comment at all. ~1,800-token prompts: a ~1,000-token prompt that reached the engine
    alone (not batched with the other three) prefilled in 0.96 s on the CI machine, too short to show anything."""
    prompts = {route: long_prompt(server.url, 1800, f"quiet {route}") for route in ROUTES}
    tees = {route: Tee() for route in ROUTES}
    barrier = threading.Barrier(len(ROUTES))

    def run(route: str) -> str:
        oc, ac = sdk_clients(server.url, tees[route])
        barrier.wait()
        return ROUTES[route](oc, ac, prompts[route], True)

    with ThreadPoolExecutor(len(ROUTES)) as pool:
        texts = list(pool.map(run, ROUTES))
    assert all(texts)
    silence = {route: round(tee.silence_s, 2) for route, tee in tees.items()}
    for route, tee in tees.items():
        lines = tee.lines()
        assert lines and not [line for line in lines if line.startswith(":")], route
        assert tee.silence_s > 1.0, silence  # long enough that an interval of 1 s would have sent a comment

"""vLLM's development routes on a real `revolta serve --enable-dev-endpoints` (embedded default, CPU):
/sleep?level=, /wake_up, /is_sleeping, /pause (wait or abort in-flight requests, or keep them), /resume,
/is_paused. Greedy completions after a sleep or a pause equal those before, token for token; a request
sent while the engine sleeps gets 503 + Retry-After; without the flag every one of these paths is 404.
Sleep with a request in flight (abort / wait) is tested through LLM (tests/test_sleep_pause.py); the
server hands those outputs to their streams the same way as a pause's (EngineLoop.deliver).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from .conftest import MODEL, run_scripted, run_server

BODY = {"model": MODEL, "prompt": "Hello there", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def dev():
    with run_server("--enable-dev-endpoints", "--sse-keep-alive-interval", "0", "--kv-cache-gib", "0.05") as s:
        yield s


def complete(url: str, **overrides) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={**BODY, **overrides}, timeout=TIMEOUT_S)


def text_of(url: str, **overrides) -> str:
    r = complete(url, **overrides)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


class Stream(threading.Thread):
    """A streamed completion read on a thread: `started` is set at its first text, `chunks` collects
    (text, finish_reason)."""

    def __init__(self, url: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.started = threading.Event()
        self.chunks: list[tuple[str, str | None]] = []
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            body = {**BODY, "max_tokens": self.max_tokens, "stream": True}
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=TIMEOUT_S) as r:
                for line in r.iter_lines():
                    payload = line.removeprefix("data: ")
                    if not line or payload == "[DONE]":
                        continue
                    choice = json.loads(payload)["choices"][0]
                    self.chunks.append((choice["text"], choice["finish_reason"]))
                    self.started.set()
        except BaseException as e:  # noqa: BLE001 (reported by `result`)
            self.error = e
            self.started.set()

    def result(self) -> tuple[str, str | None]:
        self.join(TIMEOUT_S)
        assert not self.is_alive() and self.error is None, self.error
        return "".join(t for t, _ in self.chunks), self.chunks[-1][1]


def get(url: str, path: str) -> dict:
    r = httpx.get(url + path, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


def post(url: str, path: str) -> httpx.Response:
    return httpx.post(url + path, timeout=TIMEOUT_S)


def test_routes_are_404_without_the_flag():
    with run_scripted() as (_, url):
        for method, path in [("POST", "/sleep?level=1"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                             ("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused")]:
            assert httpx.request(method, url + path, timeout=30).status_code == 404, path


def test_sleep_levels_and_requests_while_asleep(dev):
    url = dev.url
    reference = text_of(url)
    assert post(url, "/sleep?level=7").status_code == 400
    for level in (1, 2):
        assert get(url, "/is_sleeping") == {"is_sleeping": False}
        r = post(url, f"/sleep?level={level}")
        assert r.status_code == 200 and r.json()["level"] == level, r.text
        assert get(url, "/is_sleeping") == {"is_sleeping": True}
        refused = complete(url)
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) > 0, refused.text
        assert httpx.get(url + "/health", timeout=30).status_code == 200  # asleep, not dead
        assert post(url, "/wake_up").status_code == 200
        assert get(url, "/is_sleeping") == {"is_sleeping": False}
        assert text_of(url) == reference, level


@pytest.mark.parametrize("query, max_tokens, mode", [("wait_for_inflight_requests=false", 400, "abort"),
                                                     ("wait_for_inflight_requests=true&clear_cache=false", 5, "wait"),
                                                     ("mode=keep", 8, "keep")])
def test_pause_modes(dev, query, max_tokens, mode):
    url = dev.url
    reference = text_of(url)
    kept_reference = text_of(url, max_tokens=max_tokens) if mode == "keep" else None
    stream = Stream(url, max_tokens=max_tokens)
    assert stream.started.wait(TIMEOUT_S)
    assert post(url, "/pause?" + query).status_code == 200
    assert get(url, "/is_paused") == {"is_paused": True}
    waiting = Stream(url, max_tokens=5)  # accepted while paused: it waits for /resume
    time.sleep(1.0)
    assert not waiting.chunks
    if mode == "abort":
        assert stream.result()[1] == "abort"
    elif mode == "wait":
        assert stream.result() == (reference, "length")  # it finished before the pause returned
    else:
        assert stream.is_alive()  # frozen mid-way
    assert post(url, "/resume").status_code == 200
    assert get(url, "/is_paused") == {"is_paused": False}
    if mode == "keep":
        assert stream.result() == (kept_reference, "length")  # continued where it stood
    assert waiting.result() == (reference, "length")

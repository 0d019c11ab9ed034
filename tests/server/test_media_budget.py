"""Issue 26 item 3: the host-memory budget for decoded media (server/media_budget.py).

The queue policy on its own (first come first served, the wait bound, leaving the queue), then a real `revolta
serve` with a 64 MiB budget: one image priced above it is a 400 naming the size, the budget and the flag; a burst
of 64 concurrent image requests each priced 48 MiB (3000 x 2000 px) finishes or is refused with 503 + Retry-After,
while the server's peak RSS grows by less than the budget + 64 MiB (without the guard the same burst grew it by
~280 MiB on the 2-core CI machine: six worker threads decoding at once); every hold goes back when its request ends,
also when it fails or its client leaves mid-stream.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import time

import httpx
import pytest
from PIL import Image

from revolta.server.media_budget import MediaBudget, resolve_budget

from .conftest import MODEL, run_server

MiB = 2**20
BUDGET_MIB = 64
SLACK_MIB = 64  # allocations besides the decode: 64 connections, bodies, the engine's step, allocator slack


def test_queue_policy():
    async def main():
        budget = MediaBudget(100, wait_timeout_s=0.3)
        a = await budget.acquire(60)
        big = asyncio.ensure_future(budget.acquire(50))  # does not fit: waits
        small = asyncio.ensure_future(budget.acquire(10))  # would fit, but queues behind `big` (no overtaking)
        await asyncio.sleep(0.05)
        assert not big.done() and not small.done() and budget.num_waiting == 2
        a.settle(40)  # what a decoded request keeps: 40 + 50 + 10 fit
        b, c = await big, await small
        assert budget.used == 100 and budget.num_waiting == 0
        with pytest.raises(asyncio.TimeoutError):
            await budget.acquire(1)  # full: the wait bound ends it
        assert budget.num_waiting == 0
        leaving = asyncio.ensure_future(budget.acquire(30))
        await asyncio.sleep(0.05)
        leaving.cancel()  # a client that leaves while waiting leaves the queue
        await asyncio.sleep(0)
        for hold in (a, b, c, c):  # release is idempotent
            hold.release()
        assert budget.used == 0 and budget.num_waiting == 0

    asyncio.run(main())
    assert resolve_budget(None, available=8 * 2**30) == (2 * 2**30, "25% of MemAvailable 8.0 GiB")
    assert resolve_budget(0.5)[0] == 2**29


def png(width: int, height: int, seed: int = 0) -> bytes:
    """A flat-colour PNG: a few KB on the wire, width x height x 3 bytes once decoded."""
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (seed % 256, 90, 160)).save(buf, format="PNG")
    return buf.getvalue()


def body(data: bytes, **extra) -> dict:
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    return {"model": MODEL, "max_tokens": 1, **extra, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": url}}]}]}


def media_used(server) -> float:
    return server.metric("revolta:media_memory_used_bytes")


def wait_released(server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while media_used(server) != 0:
        assert time.monotonic() < deadline, f"{media_used(server)} media bytes still held"
        time.sleep(0.05)


def peak_rss_since_reset(pid: int, reset: bool = False) -> int:
    """VmHWM (peak resident bytes); `reset` sets it back to the current RSS (clear_refs 5, Linux)."""
    if reset:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


@pytest.fixture(scope="module")
def small_budget():
    # 256 x 256 px after resizing (64 pads an image) keeps the 64 requests' prefill short; decoding stays full size
    with run_server("--sse-keep-alive-interval", "0", "--max-media-memory-gib", str(BUDGET_MIB / 1024),
                    "--media-wait-timeout", "5", "--mm-processor-kwargs", '{"max_pixels": 65536}') as s:
        yield s


def test_one_item_over_the_budget_is_a_400_naming_size_budget_and_flag(small_budget):
    r = httpx.post(small_budget.url + "/v1/chat/completions", json=body(png(4000, 3000)), timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "image", error
    assert "image 0 (4000x3000 px) needs 91.7 MiB of host memory" in error["message"], error  # 12 Mpx x 8 B + kept
    assert "64.0 MiB" in error["message"] and "--max-media-memory-gib" in error["message"]
    ok = httpx.post(small_budget.url + "/v1/chat/completions", json=body(png(64, 64)), timeout=60)
    assert ok.status_code == 200, ok.text
    wait_released(small_budget)


def test_64_concurrent_image_requests_finish_or_get_503_with_rss_bounded(small_budget):
    bodies = [body(png(3000, 2000, seed=k)) for k in range(64)]  # priced 48 MiB each: one decodes at a time
    pid = small_budget.proc.pid
    with httpx.Client(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
        client.post(small_budget.url + "/v1/chat/completions", json=bodies[0])  # warm the decode path
        start = peak_rss_since_reset(pid, reset=True)
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            responses = list(pool.map(lambda b: client.post(small_budget.url + "/v1/chat/completions", json=b),
                                      bodies))
        peak = peak_rss_since_reset(pid)
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503} and codes.count(200) >= 1, codes
    for r in responses:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1" and "--max-media-memory-gib" in r.json()["error"]["message"]
    assert small_budget.metric("revolta:media_requests_refused_total") >= codes.count(503)
    growth = (peak - start) / MiB
    assert growth < BUDGET_MIB + SLACK_MIB, f"server RSS grew {growth:.0f} MiB during the burst ({codes.count(503)} " \
                                            "refused)"
    wait_released(small_budget)
    assert small_budget.metric("revolta:media_requests_waiting") == 0
    r = httpx.post(small_budget.url + "/v1/chat/completions", json=bodies[1], timeout=60)
    assert r.status_code == 200, r.text  # the server is unharmed


def test_holds_go_back_when_a_request_fails_is_refused_or_its_client_leaves(small_budget):
    url = small_budget.url + "/v1/chat/completions"
    data = png(1000, 1000)
    # held while streaming, released when the client leaves mid-stream
    stream_body = body(data, max_tokens=2000, ignore_eos=True, stream=True)
    with httpx.stream("POST", url, json=stream_body, timeout=60) as r:
        lines = (line for line in r.iter_lines() if line)
        assert next(lines).startswith("data:")
        assert media_used(small_budget) > 0  # the resized frames of a running request
    wait_released(small_budget)
    # an engine failure mid-request (fault injection), and a 400 after the media were decoded
    r = httpx.post(url, json=body(data, max_tokens=8, ignore_eos=True),
                   headers={"x-revolta-fail-after-tokens": "2"}, timeout=60)
    assert r.status_code == 500, r.text
    wait_released(small_budget)
    r = httpx.post(url, json=body(data, max_tokens=10**6), timeout=60)
    assert r.status_code == 400, r.text
    wait_released(small_budget)

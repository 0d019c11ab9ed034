"""The host-memory guard for media: decoded image and video bytes of the requests in flight stay under a budget.

Policy (spec'd by issue 26; every rule below is tested in tests/server/test_media_budget.py):

* Budget: `--max-media-memory-gib`; by default DEFAULT_FRACTION of MemAvailable when the server starts (the
  model, and on CPU the KV cache, are already in memory by then). The startup summary prints it and its source.
* Price: before a request's media are decoded it is charged their footprint's `peak` (multimodal/footprint.py,
  priced from the headers: the item decoding at full source size plus every resized frame kept so far). Once
  decoded, the charge drops to `held`, the resized uint8 frames the request keeps while it waits and runs.
* Admission is first come, first served: a request that does not fit waits behind those before it, so a large
  request is not overtaken forever by small ones. Still waiting after `--media-wait-timeout` seconds: 503 with
  Retry-After. A client that disconnects while waiting leaves the queue.
* A request that could never fit is a 400 at once: one item, or all items together, priced above the whole
  budget. The message names the size, the budget and the flag.
* Release: whatever the request holds is given back when its HTTP exchange ends, however it ends (finished,
  failed, aborted, client gone, refused after decoding): `MediaReleaseMiddleware` wraps every request in one
  `finally`, so no route has a path that leaks budget. A finished request's frames are gone by then (the engine
  drops a request when it finishes or is aborted).

Not covered: encoded request bodies (each bounded by the body-size limit), the vision tower's float input (built
for one engine step at a time) and text prompts. Decoding itself runs on worker threads (chat_prompt.py), which
hand the C heap's free pages back after a large decode (heap_trim.py), so RSS follows the budget.
All state lives on the event loop's thread: no locks.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
from collections.abc import Callable
from typing import Any

from fastapi import Request

from ..multimodal.footprint import MediaFootprint
from .disconnect import unless_disconnected
from .errors import APIError, bad_request

logger = logging.getLogger(__name__)

GiB = 2**30
DEFAULT_FRACTION = 0.25  # of MemAvailable: the rest stays for bodies, tokenization, the engine and the OS
FALLBACK_BYTES = 4 * GiB  # where MemAvailable cannot be read (not Linux)
RETRY_AFTER_S = 1  # as --max-pending-requests answers: a burst clears as requests finish
_HOLDS_KEY = "revolta.media_holds"  # ASGI scope key: the holds of one HTTP request


def mem_available() -> int | None:
    """The kernel's estimate of memory available without swapping (bytes), or None where it is not known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def resolve_budget(gib: float | None, available: int | None = None) -> tuple[int, str]:
    """(budget bytes, where it came from) for `--max-media-memory-gib` (None = the default)."""
    available = mem_available() if available is None else available
    if gib is not None:
        if available is not None and gib * GiB > available:
            logger.warning("--max-media-memory-gib %g is more than the %.1f GiB of MemAvailable: a burst of media "
                           "could get the server killed for memory; lower it", gib, available / GiB)
        return int(gib * GiB), "--max-media-memory-gib"
    if available is None:
        return FALLBACK_BYTES, "fallback: MemAvailable unknown"
    return int(available * DEFAULT_FRACTION), f"{DEFAULT_FRACTION:.0%} of MemAvailable {available / GiB:.1f} GiB"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class MediaHold:
    """The bytes one request is charged; `settle` moves the charge to what it keeps, `release` gives it back."""

    def __init__(self, budget: MediaBudget, nbytes: int):
        self._budget, self.nbytes = budget, nbytes

    def settle(self, nbytes: int) -> None:
        """The charge becomes `nbytes` (what the decoded request keeps); a smaller charge admits waiters."""
        self._budget.used += nbytes - self.nbytes
        self.nbytes = nbytes
        self._budget.grant()

    def release(self) -> None:
        """Give the charge back (idempotent)."""
        self.settle(0)


class MediaBudget:
    """Bytes of decoded media in flight, under `capacity`, with a FIFO of requests waiting for room."""

    def __init__(self, capacity: int, wait_timeout_s: float, source: str = ""):
        if capacity <= 0:
            raise ValueError(f"--max-media-memory-gib must be > 0 (got {capacity} bytes); it bounds the decoded "
                             "image and video bytes held at once")
        self.capacity, self.wait_timeout_s, self.source = capacity, wait_timeout_s, source
        self.used = 0
        self.refused = 0  # requests that waited past the timeout (503)
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    @property
    def num_waiting(self) -> int:
        return sum(1 for _, fut in self._waiters if not fut.done())

    def describe(self) -> dict[str, Any]:
        return {"max_media_memory_gib": round(self.capacity / GiB, 3), "max_media_memory_source": self.source,
                "media_wait_timeout_s": self.wait_timeout_s}

    async def acquire(self, nbytes: int) -> MediaHold:
        """A hold of `nbytes`, once the requests before it are admitted and it fits; raises asyncio.TimeoutError
        after `wait_timeout_s` (the caller's 503). Cancelling the wait leaves the queue."""
        if not self._waiters and self.used + nbytes <= self.capacity:
            self.used += nbytes
            return MediaHold(self, nbytes)
        fut = asyncio.get_running_loop().create_future()
        entry = (nbytes, fut)
        self._waiters.append(entry)
        try:
            return await asyncio.wait_for(fut, self.wait_timeout_s)
        except BaseException:
            if fut.done() and not fut.cancelled():  # granted as the wait ended: give it back
                fut.result().release()
            elif entry in self._waiters:
                self._waiters.remove(entry)
            self.grant()  # the head may have changed
            raise

    def grant(self) -> None:
        """Admit waiters from the head of the queue while they fit."""
        while self._waiters:
            nbytes, fut = self._waiters[0]
            if fut.done():  # timed out or cancelled meanwhile
                self._waiters.popleft()
                continue
            if self.used + nbytes > self.capacity:
                return
            self._waiters.popleft()
            self.used += nbytes
            fut.set_result(MediaHold(self, nbytes))

    async def admit(self, footprint: MediaFootprint, request: Request | None) -> MediaHold:
        """The HTTP side of `acquire`: 400 for media that can never fit, 503 + Retry-After past the wait bound,
        499 if the client leaves while waiting. The hold is released when `request`'s exchange ends
        (MediaReleaseMiddleware); without a request the caller releases it."""
        self._refuse_oversized(footprint)
        wait = self.acquire(footprint.peak)
        try:
            hold = await (wait if request is None else unless_disconnected(
                request, wait, "the client closed the connection while waiting for media budget"))
        except asyncio.TimeoutError:  # the builtin TimeoutError from Python 3.11 on
            self.refused += 1
            raise APIError(503, f"The server is short of memory for media: {_mib(footprint.peak)} to decode this "
                                f"request's media did not free up within {self.wait_timeout_s:g} s (the media "
                                f"budget, --max-media-memory-gib, is {_mib(self.capacity)}, {_mib(self.used)} in "
                                "use); retry later", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        if request is not None:
            request.scope.setdefault(_HOLDS_KEY, []).append(hold)
        return hold

    def _refuse_oversized(self, footprint: MediaFootprint) -> None:
        fix = (f"the media budget is {_mib(self.capacity)} (--max-media-memory-gib "
               f"{self.capacity / GiB:.4g}); send smaller media or raise --max-media-memory-gib")
        for item in footprint.items:
            if item.decode_bytes + item.held_bytes > self.capacity:
                raise bad_request(f"{item.describe()} needs {_mib(item.decode_bytes + item.held_bytes)} of host "
                                  f"memory to decode, more than the whole media budget: {fix}", item.modality)
        if footprint.peak > self.capacity:
            raise bad_request(f"the request's {len(footprint.items)} media items need {_mib(footprint.peak)} of host "
                              f"memory to decode, more than the whole media budget: {fix}",
                              footprint.items[0].modality)

    def metric_lines(self, labels: str) -> list[str]:
        """Prometheus gauges for /metrics (`labels` as metrics.py writes them)."""
        out = []
        for name, value, text, kind in (
                ("revolta:media_memory_budget_bytes", self.capacity, "The media budget (--max-media-memory-gib).",
                 "gauge"),
                ("revolta:media_memory_used_bytes", self.used, "Decoded media bytes charged to requests in flight.",
                 "gauge"),
                ("revolta:media_requests_waiting", self.num_waiting, "Requests waiting for media budget.", "gauge"),
                ("revolta:media_requests_refused_total", self.refused,
                 "Requests refused with 503 after waiting for media budget.", "counter")):
            out += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name}{{{labels}}} {value}"]
        return out


class MediaReleaseMiddleware:
    """Pure ASGI: gives back every media hold of a request once its exchange has ended, however it ended."""

    def __init__(self, app: Callable[..., Any]):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        holds: list[MediaHold] = scope.setdefault(_HOLDS_KEY, [])
        try:
            await self.app(scope, receive, send)
        finally:
            for hold in holds:
                hold.release()

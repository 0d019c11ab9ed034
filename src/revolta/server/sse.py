"""Server-sent events: frame builders, the idle keep-alive wrapper, and the streaming response.

Frames are whole strings (an `event:` line and its `data:` line together), so a keep-alive comment
can only ever land between two events, never inside one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from starlette.responses import StreamingResponse

KEEP_ALIVE = ": keep-alive\n\n"
DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def data_frame(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def event_frame(event: str, payload: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def with_keep_alive(frames: AsyncIterator[str], interval: float) -> AsyncIterator[str]:
    """Yield `frames`, plus a comment whenever they have been silent for `interval` seconds (0 = never).

    One pending `__anext__` task is kept across timeouts (asyncio.wait, not wait_for, which would
    cancel the generator mid-step); leaving early cancels it and closes `frames`, whose own
    finally-blocks abort the engine request.
    """
    it = frames.__aiter__()
    if interval <= 0:
        try:
            async for frame in it:
                yield frame
        finally:
            await it.aclose()
        return
    pending: asyncio.Task | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield KEEP_ALIVE
                continue
            task, pending = pending, None
            try:
                frame = task.result()
            except StopAsyncIteration:
                return
            yield frame
    finally:
        if pending is not None:
            pending.cancel()
            try:
                await pending
            except (asyncio.CancelledError, Exception):  # the frames generator's own error is moot now
                pass
        await it.aclose()


async def merged(sources: Sequence[AsyncIterator[str]]) -> AsyncIterator[str]:
    """The frames of all `sources` as each comes (one source's order kept; ties go to the earlier source), e.g.
    the prompts of one streamed /v1/completions request. A source's error ends the whole; leaving early
    cancels the pending steps and closes every source, whose finally-blocks abort their engine requests."""
    iterators = [source.__aiter__() for source in sources]
    pending = {asyncio.ensure_future(it.__anext__()): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                try:
                    frame = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(iterators[i].__anext__())] = i
                yield frame
    finally:
        for task in pending:
            task.cancel()
        for task in pending:
            try:
                await task
            except (asyncio.CancelledError, Exception):  # a source's own error is moot now
                pass
        for it in iterators:
            await it.aclose()


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that runs `on_close` however it ends. A client that leaves before the body
    iteration starts leaves the frames generator unstarted, so its own finally-blocks never run."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _after(ready: Callable[[], Awaitable[None]], frames: AsyncIterator[str]) -> AsyncIterator[str]:
    """`frames`, started only once `ready()` returns (a cancelled wait leaves them unstarted: on_close)."""
    await ready()
    it = frames.__aiter__()
    try:
        async for frame in it:
            yield frame
    finally:
        await it.aclose()


def sse_response(frames: AsyncIterator[str], interval: float, on_close: Callable[[], None],
                 ready: Callable[[], Awaitable[None]] | None = None) -> StreamingResponse:
    """An event stream of `frames` with keep-alive comments; `on_close` (e.g. aborting the engine
    request, which must be idempotent) runs when the response ends for any reason. With `ready`
    (e.g. RequestStream.started), the first frame waits for it: until then only comments are sent."""
    body = frames if ready is None else _after(ready, frames)
    return _ClosingStreamingResponse(with_keep_alive(body, interval), on_close)

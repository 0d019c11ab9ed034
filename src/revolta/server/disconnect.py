"""Awaiting work on behalf of a client that may leave: the work is cancelled when it does."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

from .errors import APIError

T = TypeVar("T")


async def unless_disconnected(request: Request, work: Awaitable[T],
                              message: str = "the client closed the connection") -> T:
    """Await `work`, cancelling it (and so aborting its engine request, or leaving a queue) if the client goes away
    first: a 499 with `message`. The request body must have been read already."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task not in done:
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        raise APIError(499, message)
    return task.result()

"""Errors that cross layers (a leaf module: anything may import it)."""

from __future__ import annotations


class FatalEngineError(RuntimeError):
    """The engine cannot go on (a process it depends on died or stalled): every request fails and the engine
    stops; `revolta serve` turns /health to 503 and exits with a non-zero status (server/engine_loop.py)."""

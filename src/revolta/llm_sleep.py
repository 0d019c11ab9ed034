"""LLM.sleep / wake_up and LLM.pause / resume: what happens to the requests in flight (vLLM's modes).

    llm.sleep(level=1, mode="abort")   # or "wait"; levels 0, 1, 2 (engine/sleep.py frees the memory)
    llm.wake_up()
    llm.pause(mode="abort", clear_cache=True)   # or "wait" / "keep"; vLLM's /pause options
    llm.resume()

Modes, for the requests added with `add_request` (or an unfinished `stream`) when the call comes:
- "abort": each ends at once with finish_reason "abort"; its last output (the tokens so far) is returned;
- "wait": the engine steps until every one has finished; the outputs of those steps are returned (and passed
  to `on_outputs` step by step, so a server can stream them);
- "keep" (pause only): they stay in the engine with their cache blocks and continue on resume(), bitwise as
  if never paused. Sleep drops the KV cache, so it has no "keep".

While asleep, `add_request` and `generate` raise EngineAsleepError (the server answers 503 with Retry-After).
While paused, requests may be added (they wait, as in vLLM), but `step` and `generate` raise until resume().
The sleep preflight runs before any request is touched: a refusal (SleepRefused: host memory short) leaves
the engine serving with its requests as they were.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .engine.request import RequestOutput

if TYPE_CHECKING:
    from .engine.engine import Engine
    from .engine.request import Request

OnOutputs = Callable[[list[RequestOutput]], None]
SLEEP_MODES = ("abort", "wait")
PAUSE_MODES = ("abort", "wait", "keep")


class SleepPauseMixin:
    """LLM's sleep and pause methods (kept apart from llm.py, which drives generation)."""

    engine: Engine
    _live: dict[str, list[Request]]

    def sleep(self, level: int = 1, mode: str = "abort", on_outputs: OnOutputs | None = None) -> list[RequestOutput]:
        """Free device memory until `wake_up()`: level 1 moves the weights to host memory and drops the KV cache
        and CUDA graphs; level 2 also drops the weights (wake_up reloads them from the checkpoint); level 0 frees
        nothing and only stops serving. The prefix cache is forgotten (levels 1 and 2). Requests in flight are
        aborted or waited for (`mode`); returns their outputs. Raises SleepRefused, changing nothing, when the
        host memory for the copies is short. A no-op returning [] when already asleep."""
        if mode not in SLEEP_MODES:
            raise ValueError(f"sleep mode={mode!r} must be one of {SLEEP_MODES} (sleep drops the KV cache, so "
                             "requests cannot be kept; pause(mode='keep') can)")
        if self.engine.sleep_level is not None:
            return []
        self.engine.check_sleep(level)  # before any request is touched
        outputs = self._drain(mode, on_outputs)
        self.engine.sleep(level)
        return outputs

    def wake_up(self) -> None:
        """Take the device memory back after `sleep` (weights, a zeroed KV cache, CUDA graphs); a no-op when awake."""
        self.engine.wake_up()

    def is_sleeping(self) -> bool:
        return self.engine.sleep_level is not None

    def pause(self, mode: str = "abort", clear_cache: bool = True,
              on_outputs: OnOutputs | None = None) -> list[RequestOutput]:
        """Stop generating until `resume()` (vLLM's pause_generation): requests in flight are aborted, waited for
        or kept (`mode`); clear_cache forgets the prefix cache (GPU and CPU tier). Returns the outputs of the
        aborted or finished requests. A no-op returning [] when already paused."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode={mode!r} must be one of {PAUSE_MODES}")
        if self.engine.paused:
            return []
        outputs = [] if mode == "keep" else self._drain(mode, on_outputs)
        self.engine.pause(clear_cache=clear_cache)
        return outputs

    def resume(self) -> None:
        """Generate again after `pause`: kept and newly added requests continue from where they are."""
        self.engine.resume()

    def is_paused(self) -> bool:
        return self.engine.paused

    def _drain(self, mode: str, on_outputs: OnOutputs | None) -> list[RequestOutput]:
        """Abort every request in flight, or step until all have finished; their outputs."""
        outputs: list[RequestOutput] = []
        if mode == "abort":
            for rid, group in list(self._live.items()):
                for r in group:
                    r.abort()
                outputs += [r.output() for r in group]
                self.abort_request(rid)
            if on_outputs is not None and outputs:
                on_outputs(outputs)
            return outputs
        paused, self.engine.paused = self.engine.paused, False  # a paused engine does not step: not during the drain
        try:
            while self.engine.has_unfinished():
                step = self.step()
                outputs += step
                if on_outputs is not None and step:
                    on_outputs(step)
        finally:
            self.engine.paused = paused
        return outputs

"""EngineLoop: the one thread that owns the (not thread-safe) LLM, and the asyncio side of it.

Handlers `await submit(...)` a prompt: the loop thread calls `LLM.add_request` and answers at once,
so a prompt the LLM rejects is a 400 before any response starts. The thread then alternates between
draining its command queue (adds, aborts) and `LLM.step()`, and hands every RequestOutput to the
request's asyncio queue with `call_soon_threadsafe`. A failing step fails the requests of that step
only; the loop keeps serving the rest (and new requests). A FatalEngineError (a process the engine
needs, such as the PLE worker, died or stalled; raised by a step or by the idle health check) stops
the loop instead: every request fails with its message (503), /health turns 503 and `on_fatal` is
called (`revolta serve` then exits with a non-zero status).

`call(fn)` runs `fn()` on the loop thread between steps (the dev routes' sleep and pause, dev_routes.py);
`deliver` hands the outputs such a call produced (aborted or drained requests) to their streams. A paused
or sleeping LLM is not stepped; while it sleeps, new requests are refused with 503 and Retry-After.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine.request import RequestOutput
from ..engine.sampling import SamplingParams
from ..errors import FatalEngineError

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 0.5  # how long the idle thread blocks on its queue before re-checking `stop`
ASLEEP_RETRY_AFTER_S = 10  # the Retry-After of a request refused while the engine sleeps


class InjectedEngineDeath(RuntimeError):
    """What the loop thread raises on a `kill()` (--enable-fault-injection): a stand-in for a bug in the loop."""


class RequestFailed(Exception):
    """A request the engine failed after accepting it (reported to that request only)."""

    def __init__(self, message: str, status: int = 500, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers


def asleep_error() -> RequestFailed:
    return RequestFailed("the engine is asleep (/sleep): requests are refused until /wake_up; retry later", 503,
                         headers={"Retry-After": str(ASLEEP_RETRY_AFTER_S)})


@dataclass
class EngineStats:
    """A snapshot the loop thread publishes after each step (read by /metrics and /health)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    block_size: int = 0  # tokens per KV block: a prefix-cache hit (usage cached_tokens) is a multiple of it
    prefix_caching: bool = False
    speculative: bool = False  # the engine drafts; the counters below sum every verify round
    num_spec_rounds: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()
    spec_paused: bool = False  # the adaptive policy decodes plainly: drafting does not pay at this batch size
    spec_paused_steps: int = 0  # decode steps run without drafting by the policy's choice
    spec_speedup: float | None = None  # its estimate of tokens/s drafting over plain (None: not measured)
    async_steps: int = 0  # decode steps planned before the previous step's tokens were read (--async-scheduling)


@dataclass(frozen=True)
class Fault:
    """A test hook (--enable-fault-injection): fail the request with `status` once it has `after_tokens`."""

    after_tokens: int
    status: int = 500


@dataclass
class _Sink:
    """Where one request's outputs go: its asyncio queue on the server's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    n: int
    fault: Fault | None = None
    finished: set[int] = field(default_factory=set)

    def put(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class RequestStream:
    """One accepted request: iterate for RequestOutputs (cumulative per completion index).

    Leaving the iteration early (client gone, error, cancellation) aborts the request in the engine,
    which frees its cache blocks; `close()` does the same and is idempotent.
    """

    def __init__(self, engine: "EngineLoop", request_id: str, sink: _Sink):
        self.request_id, self._engine, self._sink = request_id, engine, sink
        self.done = False
        self._finished: set[int] = set()  # completion indexes seen finished (reader side)
        self._head: Any = None  # the first item, taken off the queue by `started`
        self.num_cached_tokens = 0  # the prefix-cache hit the engine reported for the prompt (usage details)

    async def started(self) -> None:
        """Wait until the engine has something for this request: its first output, or its failure.

        A stream's opening frames wait for this, so that a queue wait and the prefill are covered by
        keep-alive comments alone (spec/server.md §7 H43), as vLLM sends its role chunk only with the
        first output. What arrived is kept for the iteration.
        """
        if self._head is None and not self.done:
            self._head = await self._sink.queue.get()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.done:
                head, self._head = self._head, None
                batch = [head if head is not None else await self._sink.queue.get()]
                while not self._sink.queue.empty():
                    batch.append(self._sink.queue.get_nowait())
                latest: dict[int, RequestOutput] = {}  # a slow reader skips intermediate cumulative outputs
                for item in batch:
                    if isinstance(item, BaseException):
                        self.done = True  # the loop already dropped the request
                        raise item
                    latest[item.outputs[0].index] = item
                    self.num_cached_tokens = getattr(item, "num_cached_tokens", None) or self.num_cached_tokens
                    if item.finished:
                        self._finished.add(item.outputs[0].index)
                self.done = len(self._finished) >= self._sink.n
                for out in latest.values():
                    yield out
        finally:
            self.close()

    def close(self) -> None:
        if not self.done:
            self.done = True
            self._engine.abort(self.request_id)


class EngineLoop:
    """Runs `llm` on a dedicated thread; `submit` / `abort` may be called from the event loop."""

    def __init__(self, llm: Any, on_output: Callable[[RequestOutput, float], None] | None = None,
                 on_finish: Callable[[str, str], None] | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None):
        self.llm = llm
        self._on_output, self._on_finish, self._on_fatal = on_output, on_finish, on_fatal
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats = EngineStats()
        self.dead: BaseException | None = None

    # ---- event-loop side ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="revolta-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        """Requests accepted and not yet finished or aborted."""
        return len(self._sinks)

    async def submit(self, prompt: Any, params: SamplingParams, fault: Fault | None = None) -> RequestStream:
        """Queue a prompt for `LLM.add_request` ({"prompt_token_ids": [...]} or a processed prompt); raises
        what add_request raises (ValueError: a client error)."""
        if not self.alive:
            raise RequestFailed("the engine is not running", status=503)
        if self.asleep:
            raise asleep_error()
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future = loop.create_future()
        request_id = uuid.uuid4().hex
        sink = _Sink(loop, asyncio.Queue(), params.n, fault)
        self._commands.put(("add", request_id, prompt, params, sink, accepted))
        if not self.alive:  # the thread died after the check above: nobody else will answer this add
            self._refuse_queued_adds()
        try:
            await accepted
        except asyncio.CancelledError:  # the client left before the engine answered
            self.abort(request_id)
            raise
        return RequestStream(self, request_id, sink)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    @property
    def asleep(self) -> bool:
        is_sleeping = getattr(self.llm, "is_sleeping", None)  # a scripted LLM (tests) has none
        return is_sleeping is not None and is_sleeping()

    def _held(self) -> bool:
        """The LLM must not step: paused or asleep."""
        is_paused = getattr(self.llm, "is_paused", None)
        return self.asleep or (is_paused is not None and is_paused())

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on the loop thread between two steps and return its result (or raise its exception)."""
        if not self.alive:
            raise RequestFailed("the engine is not running", status=503)
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        self._commands.put(("call", fn, done))
        return await done

    def kill(self) -> None:
        """Make the loop thread die as it would on a bug in the loop itself (a fault-injection hook)."""
        self._commands.put(("die",))

    # ---- engine thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            check_health = getattr(self.llm, "check_health", None)
            while not self._stop.is_set():
                self._drain_commands(block=not self.llm.has_unfinished_requests() or self._held())
                if check_health is not None:
                    check_health()  # an idle engine notices a dead helper process too
                if self.llm.has_unfinished_requests() and not self._held():
                    self._publish_stats()  # what the commands changed shows now, not after a long (prefill) step
                    self._step()
                self._publish_stats()
        except BaseException as e:  # a bug in the loop itself, or a fatal engine error: fail everyone, /health 503
            fatal = isinstance(e, FatalEngineError)
            if fatal:
                logger.error("the engine stopped: %s", e)
            else:
                logger.exception("the engine loop died")
            self.dead = e
            for rid, sink in list(self._sinks.items()):
                sink.put(RequestFailed(f"the engine stopped: {e}", status=503) if fatal else
                         RequestFailed("the engine stopped; retry later", status=500))
                if fatal:
                    self.llm.abort_request(rid)  # every cache block goes back; the engine does not run again
            self._sinks.clear()
            self._refuse_queued_adds()
            if fatal and self._on_fatal is not None:
                self._on_fatal(e)

    def _refuse_queued_adds(self) -> None:
        """After the thread died: answer every request still queued for it with a 503 (else it waits forever)."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                sink, accepted = cmd[4], cmd[5]
                sink.loop.call_soon_threadsafe(_settle, accepted, RequestFailed("the engine is not running", 503))
            elif cmd[0] == "call":
                _answer(cmd[2], None, RequestFailed("the engine is not running", 503))

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=_IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, request_id, prompt, params, sink, accepted = cmd
            if self.asleep:  # it went to sleep after the submitter checked
                sink.loop.call_soon_threadsafe(_settle, accepted, asleep_error())
                return
            try:
                self.llm.add_request(prompt, params, request_id=request_id)
            except Exception as e:  # the LLM's own validation: the submitter turns it into a 400
                sink.loop.call_soon_threadsafe(_settle, accepted, e)
                return
            self._sinks[request_id] = sink
            sink.loop.call_soon_threadsafe(_settle, accepted, None)
        elif cmd[0] == "call":
            _, fn, done = cmd
            try:
                result = fn()
            except FatalEngineError as e:  # a step of a drain met it: answer, then stop the loop as _run does
                _answer(done, None, RequestFailed(f"the engine stopped: {e}", 503))
                raise
            except Exception as e:  # the caller's error (a refused sleep, a bad mode): the route answers it
                _answer(done, None, e)
                return
            _answer(done, result, None)
        elif cmd[0] == "die":
            raise InjectedEngineDeath("engine loop killed by request (--enable-fault-injection)")
        elif cmd[0] == "abort":
            request_id = cmd[1]
            if self._sinks.pop(request_id, None) is not None:
                self.llm.abort_request(request_id)
                logger.info("Request %s aborted.", request_id)
                if self._on_finish:
                    self._on_finish(request_id, "abort")

    def _step(self) -> None:
        live = set(self._sinks)
        try:
            outputs = self.llm.step()
        except FatalEngineError:
            raise  # _run stops the loop
        except Exception as e:  # fail this step's requests, keep serving
            logger.exception("engine step failed; failing %d request(s)", len(live))
            for rid in live:
                self._fail(rid, RequestFailed(f"the engine failed while generating: {e}"))
            return
        self.deliver(outputs)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to their requests' streams (loop thread only): a step's, or what a pause or sleep
        returned for the requests it aborted or drained."""
        now = time.time()
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if self._on_output:
                self._on_output(out, now)
            completion = out.outputs[0]
            if sink.fault is not None and len(completion.token_ids) >= sink.fault.after_tokens:
                self._fail(out.request_id, RequestFailed(
                    f"injected fault after {len(completion.token_ids)} tokens (--enable-fault-injection)",
                    sink.fault.status))
                continue
            sink.put(out)
            if out.finished:
                sink.finished.add(completion.index)
                if len(sink.finished) >= sink.n:
                    del self._sinks[out.request_id]
                    if self._on_finish:
                        self._on_finish(out.request_id, completion.finish_reason or "stop")

    def _fail(self, request_id: str, error: RequestFailed) -> None:
        sink = self._sinks.pop(request_id, None)
        self.llm.abort_request(request_id)
        if sink is not None:
            sink.put(error)
            if self._on_finish:
                self._on_finish(request_id, "error")

    def _publish_stats(self) -> None:
        read = getattr(self.llm, "engine_stats", None)  # a scripted LLM (tests) has none
        if read is None:
            return
        st = read()
        spec = st.spec
        self.stats = EngineStats(num_running=st.num_running, num_waiting=st.num_waiting,
                                 kv_cache_usage=st.kv_cache_usage, num_free_blocks=st.num_free_blocks,
                                 block_size=st.block_size, prefix_caching=st.prefix_caching,
                                 speculative=spec is not None,
                                 num_spec_rounds=spec.num_rounds if spec else 0,
                                 num_draft_tokens=spec.num_draft_tokens if spec else 0,
                                 num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
                                 accepted_per_position=tuple(spec.accepted_per_position) if spec else (),
                                 spec_paused=st.spec_paused,
                                 spec_paused_steps=st.spec_paused_steps,
                                 spec_speedup=st.spec_speedup, async_steps=st.async_steps)


def _answer(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """Resolve a `call` future from the loop thread."""
    def resolve() -> None:
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    future.get_loop().call_soon_threadsafe(resolve)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the submitter was cancelled meanwhile
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)

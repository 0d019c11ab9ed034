"""The GPU process's side of the "disk" placement: the PLE worker process, shared memory, the watchdog.

Per step (spec/engine.md §6.3), before a forward or a graph replay that reads PLE rows, `stage(inputs)`:
1. copies the step's token ids, cu_seqlens and each sequence's n-gram history (the first PLE layer's
   context ids of its slot; EOS for a sequence starting at token 0) to the host, one small copy;
2. writes them to the request segment and sends ("gather", step, T, B) to the worker, which hashes
   the ids into row ids (ple/ngram_host.py), reads the rows from its maps of the shard files and
   writes them to one response segment per PLE layer;
3. waits for ("done", step) on the host, with a watchdog: the worker's exit is seen within
   POLL_S, and a worker that sends nothing (no reply, no heartbeat) for `worker_timeout_s` is killed;
   either way the step raises PLEWorkerError, a FatalEngineError: the engine stops, its requests fail;
4. copies the rows into each layer's StagedRows buffer on the device (from page-locked shared memory,
   asynchronously on the compute stream).
So a CUDA graph replays only once its rows are in place; nothing on the device ever waits for the worker.
The segments are unlinked as soon as the worker has mapped them, so nothing is left in /dev/shm if
either process is killed; the worker exits when its connection closes.
"""

from __future__ import annotations

import logging
import mmap
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
import weakref
from multiprocessing.connection import Connection
from pathlib import Path

import torch
from torch import Tensor, nn

from ..cache.storage import CacheStorage
from ..errors import FatalEngineError
from ..units import human_bytes
from .load import ple_embeddings
from .placement import PLEOptions
from .table import StagedRows, pin_host_memory

logger = logging.getLogger(__name__)

POLL_S = 0.05
DEFAULT_CAPACITY = 8192  # tokens per forward when the caller does not say (ModelRunner without an engine)


class PLEWorkerError(FatalEngineError):
    """The PLE worker process died, stalled or failed: the engine cannot look up PLE rows any more."""


class _Segment:
    """A POSIX shared-memory segment of `nbytes`, mapped here; `unlink` removes its name (the mappings stay)."""

    def __init__(self, nbytes: int):
        self.name = f"revolta-ple-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.path = f"/dev/shm/{self.name}"
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:  # reserve the pages now: a full /dev/shm would otherwise be a SIGBUS at the first write
                os.posix_fallocate(fd, 0, max(nbytes, 1))
            except OSError as e:
                os.unlink(self.path)
                raise RuntimeError(f"the PLE worker needs {nbytes / 2**20:.0f} MiB of shared memory in /dev/shm ({e}); "
                                   "give the container more (docker run --shm-size) or lower "
                                   "max_num_batched_tokens") from None
            self.map = mmap.mmap(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)[:nbytes]

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _package_root() -> str:
    return str(Path(__file__).resolve().parents[2])  # the directory holding the `revolta` package


def _stop(proc: subprocess.Popen, conn: Connection, segments: list[_Segment], unpin: list) -> None:
    """Finaliser: end the worker (politely, then by force) and drop the segments' names and pins."""
    try:
        conn.send(("stop",))
    except OSError:
        pass
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    conn.close()
    for seg in segments:
        seg.unlink()
    for f in unpin:
        f()


def has_disk_tables(model: nn.Module) -> bool:
    return any(isinstance(emb.table, StagedRows) for _, _, emb in ple_embeddings(model))


class DiskRowFeeder:
    """Starts the PLE worker for `model`'s disk-placed tables and feeds every step's rows (module docstring).

    capacity: the most tokens one forward runs (the engine's token budget plus verify rows).
    """

    def __init__(self, model: nn.Module, storage: CacheStorage, capacity: int = DEFAULT_CAPACITY,
                 options: PLEOptions | None = None):
        self.options = options or PLEOptions.from_env()
        layers = [(idx, emb) for _, idx, emb in ple_embeddings(model) if isinstance(emb.table, StagedRows)]
        if not layers:
            raise ValueError("the model has no disk-placed PLE table")
        first = layers[0][1]
        self.eos, self.order, self.capacity = model.cfg.text.eos_token_id, first.order, capacity
        self.history = storage.ple[layers[0][0]].context_ids  # [slots, n-1]: every PLE layer keeps the same ids
        self.tables = [emb.table for _, emb in layers]
        self.step, self.error = 0, None
        self.request = _Segment(8 * (2 * capacity + 1 + capacity * (self.order - 1)))
        self.responses, self.rows, unpin = [], [], []
        for t in self.tables:
            buffer = t.allocate(capacity)  # [capacity, heads * width] on the device
            seg = _Segment(buffer.numel() * buffer.element_size())
            self.responses.append(seg)
            self.rows.append(seg.tensor.view(buffer.dtype).view(buffer.shape))
            if buffer.is_cuda:  # page-locked, so the copy to the device runs asynchronously
                unpin.append(pin_host_memory(seg.tensor))
        self._copied: torch.cuda.Event | None = None
        init = {"eos": self.eos, "order": self.order, "max_tokens": capacity, "request": self.request.name,
                "threads": self.options.disk_threads, "release_pages": self.options.release_pages,
                "prefault": self.options.prefault,
                "layers": [{"layout": emb.table.layout, "multipliers": emb.layer_multipliers.tolist(),
                            "sizes": emb.ngram_heads_vocab_sizes.tolist(), "offsets": emb.ngram_heads_offsets.tolist(),
                            "heads_per_ngram": emb.heads_per_ngram, "response": seg.name,
                            "row_range": list(emb.table.row_range)}
                           for (_, emb), seg in zip(layers, self.responses)]}
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([_package_root(), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, "-m", "revolta.ple.worker", str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self.conn = Connection(ours.detach())
        segments = [self.request, *self.responses]
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.conn, segments, unpin)
        try:
            self.conn.send(init)
            reply = self._wait(self.options.worker_startup_timeout_s, "starting")
        finally:
            for seg in segments:  # mapped on both sides now (or never will be): no names left behind
                seg.unlink()
        if reply[0] != "ready":
            self._fail(f"the PLE worker could not start:\n{reply[2]}")
        info, (lo, hi), rows = reply[1], self.tables[0].row_range, self.tables[0].layout.rows
        share = "" if (lo, hi) == (0, rows) else f" (rows [{lo:,}, {hi:,}) of {rows:,})"
        logger.info("PLE worker process pid %d: %s of checkpoint shards mapped%s, %d gather threads%s; buffers for "
                    "%d tokens", info["pid"], human_bytes(info["mapped_bytes"]), share, self.options.disk_threads,
                    ", page release on" if self.options.release_pages else "", capacity)

    @property
    def pid(self) -> int:
        return self.proc.pid

    # ---- per step --------------------------------------------------------------------------------
    def stage(self, input_ids: Tensor, cu_seqlens: Tensor, slots: Tensor, has_initial_state: Tensor) -> None:
        """Gather the rows of a step (its device inputs, graph padding included) into the layers' buffers."""
        self.check_health()
        T, B = input_ids.shape[0], slots.shape[0]
        if T > self.capacity:
            raise RuntimeError(f"a forward of {T} tokens exceeds the {self.capacity} the PLE worker's buffers hold")
        hist = self.history[slots.long()].to(input_ids.device)
        hist = torch.where(has_initial_state[:, None].to(hist.device), hist, torch.full_like(hist, self.eos))
        packed = torch.cat([input_ids.long(), cu_seqlens.long(), hist.reshape(-1).long()]).cpu()  # the one sync
        n, req = self.capacity, self.request.tensor.view(torch.int64)
        req[:T] = packed[:T]
        req[n:n + B + 1] = packed[T:T + B + 1]
        req[2 * n + 1:2 * n + 1 + hist.numel()] = packed[T + B + 1:]
        if self._copied is not None:
            self._copied.synchronize()  # the last step's rows have left the response segments
        self.step += 1
        self._send(("gather", self.step, T, B))
        reply = self._wait(self.options.worker_timeout_s, f"gathering the rows of {T} tokens")
        if reply[0] != "done" or reply[1] != self.step:
            self._fail(f"the PLE worker failed while gathering rows:\n{reply[2] if len(reply) > 2 else reply}")
        for t, rows in zip(self.tables, self.rows):
            t.buffer[:T].copy_(rows[:T], non_blocking=True)
        if self.tables[0].buffer.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def check_health(self) -> None:
        """Raise the worker's failure (remembered once seen), or PLEWorkerError if it has exited meanwhile."""
        if self.error is not None:
            raise self.error
        if self.proc.poll() is not None:
            self._fail(self._exited("idle"))

    def close(self) -> None:
        self._finalizer()

    # ---- watchdog --------------------------------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        try:
            self.conn.send(msg)
        except OSError:  # the worker's end is closed: it is exiting (its exit status names why)
            self._reap()
            self._fail(self._exited("receiving a request"))

    def _wait(self, timeout: float, what: str) -> tuple:
        """The worker's next message other than a heartbeat; PLEWorkerError on its exit or `timeout` s of silence."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                ready = self.conn.poll(POLL_S)
                msg = self.conn.recv() if ready else None
            except (EOFError, OSError):  # the worker closed its end: it is exiting
                self._reap()
                self._fail(self._exited(what))
            if msg is not None and msg[0] == "beat":
                deadline = time.monotonic() + timeout
            elif msg is not None:
                return msg
            elif self.proc.poll() is not None:
                self._fail(self._exited(what))
            elif time.monotonic() > deadline:
                self.proc.kill()
                self._fail(f"the PLE worker process (pid {self.proc.pid}) sent nothing for {timeout:g} s while "
                           f"{what} (REVOLTA_PLE_WORKER_TIMEOUT_S); it was killed")

    def _reap(self) -> None:
        """Wait (2 s at most, then kill) for the exiting worker, so its exit status is known for the message."""
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _exited(self, what: str) -> str:
        code = self.proc.returncode
        how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited with {code}"
        return f"the PLE worker process (pid {self.proc.pid}) {how} while {what}"

    def _fail(self, message: str) -> None:
        self.error = PLEWorkerError(f"{message}; the engine cannot look up PLE rows (ple_placement='disk') and stops. "
                                    "Check the worker's memory limit and the checkpoint files, then restart")
        if self._copied is not None:
            self._copied.synchronize()  # no copy may still read the segments when they are unpinned
        self._finalizer()
        raise self.error

"""The PLE worker process (`python -m revolta.ple.worker FD`): gathers each step's table rows from the
memory-mapped checkpoint shards (the "disk" placement, spec/engine.md §6.3). It imports numpy, not torch.

Protocol over the connection on file descriptor FD (multiprocessing.connection, pickled tuples):
  GPU process -> worker: the init dict (see `disk.DiskRowFeeder`; a layer's `row_range` [lo, hi), when given,
                         limits it to those rows: parallel/ple.py), then ("gather", step, T, B) or ("stop",)
  worker -> GPU process: ("ready", info) | ("error", None, text) at start; ("done", step) |
                         ("error", step, text) per gather; ("beat",) every HEARTBEAT_S while gathering.
A gather reads, from the request segment, the step's token ids [T] (graph padding included), its
cu_seqlens [B + 1] and each sequence's n-gram history [B, n-1], computes every PLE layer's row ids
and writes the rows' bytes to that layer's response segment [T, heads * row bytes]. End of file on
the connection (the GPU process exited or was killed) ends the worker.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

import numpy as np

from .ngram_host import ngram_contexts_host, row_ids
from .shards import MappedTable

HEARTBEAT_S = 1.0


def map_segment(name: str) -> mmap.mmap:
    """A POSIX shared-memory segment the GPU process created (opened directly: attaching through
    multiprocessing.shared_memory would register it with this process's resource tracker, which
    unlinks it when the worker exits)."""
    fd = os.open(f"/dev/shm/{name.lstrip('/')}", os.O_RDWR)
    try:
        return mmap.mmap(fd, 0)
    finally:
        os.close(fd)


class _Layer:
    """One PLE layer's table, or only rows [lo, hi) of it (`row_range`: a tensor-parallel rank's share, whose
    other rows come back as zero bytes, which dequantise to 0: the ranks' all-reduce adds the owner's row)."""

    def __init__(self, spec: dict, threads: int, release_pages: bool, prefault: bool):
        layout = spec["layout"]
        self.lo, self.hi = spec.get("row_range") or (0, layout.rows)
        self.whole = (self.lo, self.hi) == (0, layout.rows)
        self.table = MappedTable(layout.restrict(self.lo, self.hi), threads, release_pages, prefault)
        self.multipliers = np.array(spec["multipliers"], dtype=np.int64)
        self.sizes = np.array(spec["sizes"], dtype=np.int64)
        self.offsets = np.array(spec["offsets"], dtype=np.int64)
        self.heads_per_ngram = spec["heads_per_ngram"]
        self.response = map_segment(spec["response"])
        self.row_bytes = spec["layout"].row_bytes

    def gather(self, contexts: np.ndarray) -> None:
        rows = row_ids(contexts, self.multipliers, self.sizes, self.offsets, self.heads_per_ngram, np.stack)
        rows = rows.reshape(-1)
        n = rows.size
        out = np.frombuffer(self.response, dtype=np.uint8, count=n * self.row_bytes).reshape(n, self.row_bytes)
        if self.whole:
            self.table.gather(rows, out)
            return
        mine = np.flatnonzero((rows >= self.lo) & (rows < self.hi))
        out[...] = 0
        if mine.size:
            part = np.empty((mine.size, self.row_bytes), dtype=np.uint8)
            self.table.gather(rows[mine] - self.lo, part)
            out[mine] = part


class Worker:
    """What the init dict describes: the request segment and one mapped table per PLE layer."""

    def __init__(self, init: dict):
        self.eos, self.order, self.max_tokens = init["eos"], init["order"], init["max_tokens"]
        self.request = np.frombuffer(map_segment(init["request"]), dtype=np.int64)
        self.layers = [_Layer(spec, init["threads"], init["release_pages"], init["prefault"]) for spec in init["layers"]]

    def info(self) -> dict:
        return {"pid": os.getpid(), "mapped_bytes": sum(layer.table.mapped_bytes for layer in self.layers)}

    def gather(self, T: int, B: int) -> None:
        if not 0 < B <= T <= self.max_tokens:
            raise ValueError(f"a gather of {T} tokens in {B} sequences does not fit {self.max_tokens} tokens")
        n = self.max_tokens
        ids = self.request[:T]
        cu = self.request[n:n + B + 1]
        history = self.request[2 * n + 1:2 * n + 1 + B * (self.order - 1)].reshape(B, self.order - 1)
        contexts = ngram_contexts_host(ids, history, cu, self.eos)
        for layer in self.layers:
            layer.gather(contexts)


def serve(conn: Connection) -> int:
    lock, busy = threading.Lock(), threading.Event()

    def send(msg: tuple) -> None:
        with lock:
            conn.send(msg)

    def heartbeat() -> None:  # says "alive" while a long gather runs (cold pages on slow storage)
        while True:
            time.sleep(HEARTBEAT_S)
            if busy.is_set():
                try:
                    send(("beat",))
                except OSError:
                    return

    try:
        worker = Worker(conn.recv())
    except EOFError:
        return 0
    except Exception:
        send(("error", None, traceback.format_exc(limit=4)))
        return 1
    send(("ready", worker.info()))
    threading.Thread(target=heartbeat, daemon=True, name="ple-heartbeat").start()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the GPU process is gone
            return 0
        if msg[0] == "stop":
            return 0
        _, step, T, B = msg
        busy.set()
        try:
            worker.gather(T, B)
            reply = ("done", step)
        except Exception:
            reply = ("error", step, traceback.format_exc(limit=4))
        finally:
            busy.clear()
        send(reply)


if __name__ == "__main__":
    sys.exit(serve(Connection(int(sys.argv[1]))))

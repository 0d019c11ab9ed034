"""MultiProcExecutor: tensor parallelism behind the executor seam (issue 23). A CPU/gloo prototype.

Rank 0's executor lives in the engine's process; ranks 1.. are spawned worker processes. Each rank holds
an ordinary `UniProcExecutor` over its shard of the model (parallel/shard.py, loaded by reading only its
slices: parallel/load.py) and a cache sized for its part (`CacheLayout.tp`). Every call that changes
rank state (execute, finish, drop) is put on each worker's queue first and then run locally, so all ranks
run the same step; the forward's collectives keep them in lock step, and rank 0's logits (gathered over
the vocabulary) go back to the engine, which samples. can_draft is answered from rank 0's copy.

Nothing hangs: the collectives wait at most `timeout_s` (a ParallelTimeout names the stalled collective),
`check_health` turns a dead worker into a FatalEngineError, workers exit when rank 0's process is gone,
and `close` joins them with a bound and kills what is left.

Not yet: the engine builds a UniProcExecutor itself (engine.py), so a caller swaps this one in; NCCL/CUDA
devices; one broadcast per step instead of a queue per worker.
"""

from __future__ import annotations

import logging
import os
import queue as queue_mod
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..cache.capacity import CachePlan
from ..config import ModelConfig
from ..errors import FatalEngineError
from ..parallel import ParallelConfig, ParallelContext
from ..parallel.load import load_rank_checkpoint
from ..parallel.shard import build_rank_model
from ..spec.config import SpeculativeConfig
from .executor import Executor, ModelStep, StepResult, UniProcExecutor

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to build its executor (pickled to the workers)."""

    cfg: ModelConfig
    checkpoint: str
    plan: CachePlan  # the engine's plan; each rank sizes its cache with layout.tp = tp
    spec: SpeculativeConfig
    config: object  # the EngineConfig
    tp: int
    store: str  # a FileStore path for the gloo rendezvous (fresh per group)
    timeout_s: float


def _rank_executor(rank: int, rs: RankSpec) -> UniProcExecutor:
    ctx = ParallelContext.from_group(dist.group.WORLD, timeout=timedelta(seconds=rs.timeout_s))
    model = build_rank_model(rs.cfg, ParallelConfig(rs.tp), ctx, with_vision=False)
    load_rank_checkpoint(model, rs.checkpoint, rank, rs.tp)
    plan = replace(rs.plan, layout=replace(rs.plan.layout, tp=rs.tp))
    return UniProcExecutor(model, plan, rs.spec, rs.config, None)


def _init_group(rank: int, rs: RankSpec) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(rs.store, rs.tp), rank=rank, world_size=rs.tp,
                            timeout=timedelta(seconds=rs.timeout_s))


def _worker(rank: int, rs: RankSpec, inbox) -> None:
    """Rank `rank` > 0: build the shard, then run each call rank 0 sends until "stop" or rank 0 is gone."""
    torch.set_num_threads(1)
    _init_group(rank, rs)
    parent = mp.parent_process()
    try:
        executor = _rank_executor(rank, rs)
        with torch.no_grad():
            while True:
                try:
                    op, args = inbox.get(timeout=1.0)
                except queue_mod.Empty:
                    if parent is None or not parent.is_alive():
                        return
                    continue
                if op == "stop":
                    return
                getattr(executor, op)(*args)
    finally:
        dist.destroy_process_group()


class MultiProcExecutor(Executor):
    """Rank 0 of a TP group in this process plus tp - 1 worker processes (module docstring)."""

    def __init__(self, local: UniProcExecutor, inboxes: list, procs: list):
        self.local, self.inboxes, self.procs = local, inboxes, procs

    @classmethod
    def start(cls, cfg: ModelConfig, checkpoint: str | Path, plan: CachePlan, spec: SpeculativeConfig, config,
              tp: int, workdir: str | Path, timeout_s: float = 60.0) -> "MultiProcExecutor":
        """Spawn ranks 1..tp-1, join the gloo group as rank 0 and build rank 0's shard here."""
        store = os.path.join(str(workdir), "tp_store")
        rs = RankSpec(cfg, str(checkpoint), plan, spec, config, tp, store, timeout_s)
        ctx = mp.get_context("spawn")
        inboxes = [ctx.Queue() for _ in range(1, tp)]
        procs = [ctx.Process(target=_worker, args=(r, rs, inboxes[r - 1]), name=f"revolta-tp-rank{r}")
                 for r in range(1, tp)]
        for p in procs:
            p.start()
        try:
            _init_group(0, rs)  # waits for every worker at most timeout_s
            return cls(_rank_executor(0, rs), inboxes, procs)
        except BaseException:
            cls(None, inboxes, procs).close(timeout_s=5)  # no worker outlives a failed start
            raise

    def _send(self, op: str, *args) -> None:
        self.check_health()
        for inbox in self.inboxes:
            inbox.put((op, args))

    def execute(self, step: ModelStep) -> StepResult:
        self._send("execute", step)
        return self.local.execute(step)

    def finish(self, step: ModelStep, accepted: list[int], finished: list[bool]) -> None:
        self._send("finish", step, accepted, finished)
        self.local.finish(step, accepted, finished)

    def can_draft(self, request_id: str, num_computed: int, num_preemptions: int) -> bool:
        return self.local.can_draft(request_id, num_computed, num_preemptions)

    def drop(self, request_id: str) -> None:
        self._send("drop", request_id)
        self.local.drop(request_id)

    def check_health(self) -> None:
        dead = [p.name for p in self.procs if not p.is_alive()]
        if dead:
            raise FatalEngineError(f"tensor-parallel worker(s) {dead} exited (exit codes "
                                   f"{[p.exitcode for p in self.procs if not p.is_alive()]}); the engine stops")
        self.local.check_health()

    def stats(self) -> dict[str, int]:
        return self.local.stats()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the workers (bounded), kill what does not exit, leave the process group."""
        for p, inbox in zip(self.procs, self.inboxes):
            if p.is_alive():
                inbox.put(("stop", ()))
        for p in self.procs:
            p.join(timeout_s)
            if p.is_alive():
                logger.warning("tensor-parallel %s did not stop within %.0f s; killing it", p.name, timeout_s)
                p.kill()
                p.join(timeout_s)
        if dist.is_initialized():
            dist.destroy_process_group()

    # rank 0's pieces, as UniProcExecutor exposes them (the engine's properties reach them)
    @property
    def runner(self):
        return self.local.runner

    @property
    def storage(self):
        return self.local.storage

    @property
    def cpu_storage(self):
        return self.local.cpu_storage

    @property
    def drafter(self):
        return self.local.drafter

    @property
    def graphs(self):
        return self.local.graphs

    @property
    def spec_graphs(self):
        return self.local.spec_graphs

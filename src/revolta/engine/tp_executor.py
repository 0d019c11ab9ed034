"""MultiProcExecutor: tensor parallelism behind the executor seam (issue 23). gloo on CPU, NCCL on CUDA.

Rank 0 lives in the engine's process; ranks 1.. are spawned worker processes. Start-up is two phases, because
the engine sizes its cache from rank 0's shard: `TPGroup.start` spawns the workers, joins the group as
rank 0 and loads rank 0's shard (parallel/load.py `load_rank_model`: only its slices are read) while every
worker loads its own, and returns once every shard is loaded (so a step's collective bound never covers a load);
the engine then plans its cache (per rank: `plan_cache(..., tp=tp)`, the budget counts
the rank's own weights) and `TPGroup.executor(plan, ...)` hands the plan to every rank, each of which builds an
ordinary `UniProcExecutor` over its shard. Every call that changes rank state (execute, finish, drop) is put on
each worker's queue first and then run locally, so all ranks run the same step; the forward's collectives keep
them in lock step, and rank 0's logits (gathered over the vocabulary) go back to the engine, which samples.
can_draft is answered from rank 0's copy. Each call is pickled when it is sent (`_send`), not later by the
queue's feeder thread: rank 0 goes on to run the same step, which attaches tensors to it (media rows, on its
device), and a worker must get the step as it was sent, host data only.

Devices (parallel/devices.py): on CPU every rank uses gloo; on CUDA rank r uses cuda:r of the visible GPUs and NCCL.
Each rank makes its GPU the current device before it joins the group and before it loads its shard, and the NCCL
environment defaults (NVLink multicast off, the watchdog's error mode) are set in rank 0's process before the
workers are spawned, so every rank has them. CUDA graphs stay off at tp > 1 (EngineConfig.use_cuda_graphs):
every collective's wait is bounded, and a bounded wait cannot be captured.

Nothing hangs: the collectives wait at most `timeout_s` (a ParallelTimeout names the stalled collective);
a dead worker or any error on rank 0 mid-step (the ranks are then out of step) is a FatalEngineError, after
which the workers are stopped and the executor refuses further steps; workers exit when rank 0's process is
gone (and are daemons, so an interpreter exit without `close` ends them too); `close` joins them with a bound
and kills what is left.

Not yet: run on GPUs (the NCCL path is written, tests/gpu/test_tp_nccl.py awaits a multi-GPU machine); one
broadcast per step instead of a queue per worker; CUDA graphs at tp > 1.
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import pickle
import queue as queue_mod
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..cache.capacity import CachePlan
from ..config import ModelConfig
from ..errors import FatalEngineError
from ..model import FlashNextModel
from ..parallel import ParallelConfig, ParallelContext
from ..parallel.devices import apply_nccl_env, check_rank_devices, group_timeout, rank_placement, visible_gpus
from ..parallel.load import load_rank_model
from ..spec.config import SpeculativeConfig
from .executor import Executor, ModelStep, StepResult, UniProcExecutor, forwarded

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0  # a collective (or the start-up rendezvous) waits at most this long
# spawning a worker imports torch and revolta (seconds on a loaded machine), so the start-up wait has its own
# bound: a short collective timeout (a test's stalled-rank check) must not fail the start
DEFAULT_START_TIMEOUT_S = 120.0
LOAD_WAIT_FACTOR = 4.0  # after rank 0's load, the workers' loads may take this many times as long (TPGroup.start)


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to build its shard (pickled to the workers)."""

    cfg: ModelConfig
    checkpoint: str
    tp: int
    dcp: int
    with_mtp: bool
    dtype: torch.dtype
    store: str  # a FileStore path for the rendezvous (fresh per group)
    timeout_s: float
    ple_placement: str = "device"  # "host" / "disk": each rank its rows of the PLE table (parallel/ple.py)
    device: str = "cpu"  # rank 0's device type: "cpu" (gloo) or "cuda" (rank r on cuda:r, NCCL)


def _init_group(rank: int, rs: RankSpec) -> tuple[ParallelContext, torch.device]:
    """Join the group as `rank`: on CUDA its GPU becomes the current device first (NCCL binds the communicator to
    it, and Triton launches on the current device). Returns the context and the rank's device."""
    place = rank_placement(rs.device, rank)
    if place.device.type == "cuda":
        torch.cuda.set_device(place.device)
    wait = timedelta(seconds=rs.timeout_s)
    # torch.distributed.nn.functional binds group.WORLD as its functions' default argument when it is imported,
    # and the first meta-device model build imports it (through torch._dynamo): imported after the join, it would
    # hold the group, and its gloo threads, until the interpreter's teardown (`_worker`). Before: it binds None.
    importlib.import_module("torch.distributed.nn")
    dist.init_process_group(place.backend, store=dist.FileStore(rs.store, rs.tp), rank=rank, world_size=rs.tp,
                            timeout=group_timeout(place.backend, wait),
                            device_id=place.device if place.device.type == "cuda" else None)
    return ParallelContext.from_group(dist.group.WORLD, timeout=wait), place.device


def _send(inboxes: list, op: str, args: tuple) -> None:
    """Put `(op, args)` on every worker's queue, pickled now (module docstring: the step as it is at this moment)."""
    message = pickle.dumps((op, args), protocol=pickle.HIGHEST_PROTOCOL)
    for inbox in inboxes:
        inbox.put(message)


def _receive(inbox, timeout_s: float) -> tuple[str, tuple]:
    """The next `(op, args)` `_send` put on `inbox` (queue.Empty after `timeout_s`)."""
    return pickle.loads(inbox.get(timeout=timeout_s))


def _rank_executor(model: FlashNextModel, plan: CachePlan, spec: SpeculativeConfig, config, ctx: ParallelContext,
                   encoder_cache=None) -> UniProcExecutor:
    """A rank's executor; rank 0's encodes media into the engine's `encoder_cache` and sends the rows to the rest."""
    plan = replace(plan, layout=replace(plan.layout, tp=ctx.size))  # each rank's cache holds its part of the heads
    return UniProcExecutor(model, plan, spec, config, encoder_cache, media_ctx=ctx)


def _report_path(workdir: str, rank: int) -> str:
    return os.path.join(workdir, f"rank{rank}.error")


def _report(rs: RankSpec, rank: int, e: Exception) -> None:
    """Leave the error that ends rank `rank` where rank 0 reads it (`TPGroup.reported`), written before the rank
    leaves the group, so it is there when rank 0's collective fails: a FatalEngineError (e.g. the rank's PLE
    worker died) keeps its type and message, anything else becomes one naming it."""
    error = e if isinstance(e, FatalEngineError) else FatalEngineError(f"{type(e).__name__}: {e}")
    path = _report_path(os.path.dirname(rs.store), rank)
    try:
        with open(path + ".tmp", "wb") as f:
            pickle.dump(error, f)
        os.replace(path + ".tmp", path)
    except Exception:  # e.g. an unpicklable subclass: rank 0 still sees the rank exit
        logger.exception("rank %d could not report its error", rank)


def _worker(rank: int, rs: RankSpec, inbox, ready) -> None:
    """Rank `rank` > 0: load the shard, build the executor from rank 0's plan, then run each call rank 0 sends
    until "stop" or rank 0's process is gone. An error ends the rank, reported to rank 0 first. `ready` hears the
    rank twice: about to join the group, then with its shard loaded (TPGroup.start waits for both).

    The group is gone, its gloo threads included, before this returns: they live as long as any reference to the
    group does (the shard's layers hold one), and threads left to the interpreter's teardown aborted a cleanly
    stopped worker once ("terminate called without an active exception"). So `_serve` holds every reference (an
    error's traceback drops its frames' locals) and the collection after it ends them while the interpreter is whole."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // rs.tp))  # the ranks share the host's cores
    ready.put(rank)  # about to join the group: rank 0 waits for this before its (blocking) rendezvous
    clean = False
    try:
        clean = _serve(rank, rs, inbox, ready, *_init_group(rank, rs))  # the NCCL environment came with rank 0's
    except BaseException as e:  # still raised (exit code 1, its traceback printed), without _serve's locals
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        _leave_group(failed=not clean)
        gc.collect()  # the shard's layers and the context are cyclic garbage now: the group object goes with them


def _serve(rank: int, rs: RankSpec, inbox, ready, ctx: ParallelContext, device: torch.device) -> bool:
    """The worker's loop (`_worker`): True after "stop", False when rank 0's process is gone."""
    parent = mp.parent_process()
    executor = None
    try:
        model = load_rank_model(rs.cfg, rs.checkpoint, ctx, with_mtp=rs.with_mtp, dtype=rs.dtype, dcp=rs.dcp,
                                ple_placement=rs.ple_placement, device=device)
        ready.put(rank)  # loaded: rank 0's first collective no longer waits on this rank's load
        with torch.no_grad():
            while True:
                try:
                    op, args = _receive(inbox, timeout_s=1.0)
                except queue_mod.Empty:
                    if parent is None or not parent.is_alive():
                        return False
                    if executor is not None:  # an idle rank's dead PLE worker ends the rank (reported below)
                        executor.check_health()
                    continue
                if op == "stop":
                    return True
                if op == "build":
                    executor = _rank_executor(model, *args, ctx)
                else:
                    getattr(executor, op)(*args)
    except Exception as e:
        _report(rs, rank, e)
        raise
    finally:
        if executor is not None:
            executor.close()  # the rank's PLE worker, if any (bounded)


def _leave_group(failed: bool) -> None:
    """Leave this process's group. After a failure an NCCL group is aborted: a graceful destroy first flushes the
    communicator, which would wait on a collective that a dead or stalled peer left unfinished. (gloo: destroy.)"""
    if not dist.is_initialized():
        return
    if failed and dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()  # the WORLD group and the DCP subgroups
    else:
        dist.destroy_process_group()


class TPGroup:
    """The ranks of a TP group before the engine has planned its cache: rank 0's shard (`model`) here, the
    workers loading theirs. `executor(...)` finishes the start; `close()` stops the workers (bounded)."""

    def __init__(self, model: FlashNextModel | None, tp: int, inboxes: list, procs: list, workdir: str, dcp: int = 1):
        self.model, self.tp, self.inboxes, self.procs, self.workdir = model, tp, inboxes, procs, workdir
        self.dcp = dcp
        self.ctx: ParallelContext | None = None  # rank 0's place in the group, once joined

    @classmethod
    def start(cls, cfg: ModelConfig, checkpoint: str | Path, tp: int, *, with_mtp: bool,
              dtype: torch.dtype = torch.float32, timeout_s: float = DEFAULT_TIMEOUT_S, dcp: int = 1,
              start_timeout_s: float = DEFAULT_START_TIMEOUT_S, ple_placement: str = "device",
              device: str | torch.device = "cpu") -> "TPGroup":
        """Spawn ranks 1..tp-1, join the group as rank 0 and load rank 0's shard here (at dcp > 1 the ranks also
        form their DCP groups while building their shards). device "cpu": gloo; "cuda": rank r on cuda:r, NCCL."""
        device = torch.device(device)
        check_rank_devices(device, ParallelConfig(tp, dcp), visible_gpus() if device.type == "cuda" else [])
        if device.type == "cuda":  # before any communicator or spawn
            for name, value in apply_nccl_env(os.environ).items():
                logger.info("tensor parallel: %s=%s (not set by the user)", name, value)
        workdir = tempfile.mkdtemp(prefix="revolta-tp-")
        rs = RankSpec(cfg, str(checkpoint), tp, dcp, with_mtp, dtype, os.path.join(workdir, "store"), timeout_s,
                      ple_placement, device.type)
        ctx = mp.get_context("spawn")
        inboxes, ready = [ctx.Queue() for _ in range(1, tp)], ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(r, rs, inboxes[r - 1], ready), name=f"revolta-tp-rank{r}",
                             daemon=True) for r in range(1, tp)]
        group = cls(None, tp, inboxes, procs, workdir, dcp)
        try:
            for p in procs:
                p.start()
            logger.info("tensor parallel: %d ranks (%s); worker pids %s", tp, rank_placement(device, 0).backend,
                        [p.pid for p in procs])
            start_wait = max(timeout_s, start_timeout_s)
            group._wait_ready(ready, start_wait, "start", hint=" while starting; a script that starts tensor-"
                              "parallel ranks must guard its entry point with `if __name__ == \"__main__\":` "
                              "(spawned processes import it)")
            group.ctx, rank0 = _init_group(0, rs)  # waits for every worker at most timeout_s
            # rank 0 alone holds the vision tower (replicated weights): it encodes media, the rows go to the rest
            t0 = time.monotonic()
            group.model = load_rank_model(cfg, checkpoint, group.ctx, with_mtp=with_mtp, dtype=dtype, dcp=dcp,
                                          ple_placement=ple_placement, with_vision=True, device=rank0)
            # every shard loaded before the engine's first step: a collective's bound (timeout_s, seconds in a
            # test) is for a step, and a worker importing and loading on a busy host can lag rank 0 by more. The
            # shards are alike, so a worker gets 4x rank 0's own load time (ranks sharing one disk) if that is longer
            load_wait = max(start_wait, LOAD_WAIT_FACTOR * (time.monotonic() - t0))
            group._wait_ready(ready, load_wait, "load their shards", hint=" while loading its shard")
            group.check_health()
            return group
        except BaseException:
            group.close(timeout_s=5, failed=True)  # no worker outlives a failed start
            raise

    def _wait_ready(self, ready, timeout_s: float, what: str, hint: str) -> None:
        """Until every worker has sent its next `ready` message (`_worker`: about to join the group, then loaded);
        a worker that dies first (e.g. a script without the `if __name__ == "__main__":` guard that spawned
        processes need) fails the start at once with `hint`, not after the rendezvous timeout."""
        deadline, waiting = time.monotonic() + timeout_s, len(self.procs)
        while waiting:
            try:
                ready.get(timeout=0.2)
                waiting -= 1
            except queue_mod.Empty:
                self.check_health(hint=hint)
                if time.monotonic() > deadline:
                    raise FatalEngineError(f"{waiting} tensor-parallel worker(s) did not {what} within "
                                           f"{timeout_s:.0f} s")

    def executor(self, plan: CachePlan, spec: SpeculativeConfig, config, encoder_cache=None) -> "MultiProcExecutor":
        """Every rank builds its executor over its shard with the engine's plan (its cache sized at tp); rank 0's
        encodes media into `encoder_cache` (the engine's; None: no vision tower)."""
        self.check_health()
        _send(self.inboxes, "build", (plan, spec, config))
        return MultiProcExecutor(_rank_executor(self.model, plan, spec, config, self.ctx, encoder_cache), self)

    def dead_workers(self, wait_s: float = 0.0) -> list[str]:
        """Names and exit codes of the workers that have exited, waiting up to `wait_s` for one that is dying."""
        deadline = time.monotonic() + wait_s
        while all(p.is_alive() for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        return [f"{p.name} (exit code {p.exitcode})" for p in self.procs if not p.is_alive()]

    def reported(self) -> FatalEngineError | None:
        """The error a worker reported before it exited (`_report`), its rank named; None if none did."""
        for rank in range(1, self.tp):
            try:
                with open(_report_path(self.workdir, rank), "rb") as f:
                    error = pickle.load(f)
            except (OSError, EOFError, pickle.UnpicklingError):
                continue
            try:
                return type(error)(f"tensor-parallel rank {rank}: {error}")
            except TypeError:
                return FatalEngineError(f"tensor-parallel rank {rank}: {type(error).__name__}: {error}")
        return None

    def check_health(self, hint: str = "; the engine stops") -> None:
        dead = [p for p in self.procs if not p.is_alive()]
        if dead:
            reported = self.reported()
            if reported is not None:
                raise reported
            raise FatalEngineError(f"tensor-parallel worker(s) {[p.name for p in dead]} exited (exit codes "
                                   f"{[p.exitcode for p in dead]}){hint}")

    def close(self, timeout_s: float = 10.0, failed: bool = False) -> None:
        """Stop the workers (bounded), kill what does not exit, leave the process group (`failed`: the ranks are
        out of step, abort it). Idempotent."""
        for p, inbox in zip(self.procs, self.inboxes):
            if p.is_alive():
                _send([inbox], "stop", ())
        for p in self.procs:
            if p.pid is None:  # never started
                continue
            p.join(timeout_s)
            if p.is_alive():
                logger.warning("tensor-parallel %s did not stop within %.0f s; killing it", p.name, timeout_s)
                p.kill()
                p.join(timeout_s)
        _leave_group(failed)
        shutil.rmtree(self.workdir, ignore_errors=True)


class MultiProcExecutor(Executor):
    """Rank 0 of a TP group in this process plus tp - 1 worker processes (module docstring)."""

    def __init__(self, local: UniProcExecutor, group: TPGroup):
        self.local, self.group = local, group
        self.failed: FatalEngineError | None = None  # set once: the ranks are out of step, no step runs again

    @property
    def procs(self) -> list:
        return self.group.procs

    def _run(self, op: str, *args):
        """Send `op` to every worker, then run it here; any failure stops the group (FatalEngineError)."""
        if self.failed is not None:
            raise self.failed
        try:
            self.group.check_health()
            _send(self.group.inboxes, op, args)
            return getattr(self.local, op)(*args)
        except FatalEngineError as e:
            self._fail(e)
            raise
        except Exception as e:  # a collective that timed out or failed, or a bug on rank 0: out of step for good
            # a rank that failed (e.g. its PLE worker died) wrote its error before it left the group (_report): it
            # is there when the collective breaks, while that rank may still be tearing down
            reported, dead = self.group.reported(), []
            if reported is None:
                dead = self.group.dead_workers(wait_s=1.0)  # a killed peer is what usually breaks a collective
                reported = self.group.reported() if dead else None
            if reported is not None:
                self._fail(reported)
                raise reported from e
            cause = f"worker(s) {dead} exited, so " if dead else ""
            error = FatalEngineError(f"tensor-parallel {cause}{op} failed on rank 0 ({type(e).__name__}: {e}); the "
                                     "ranks are out of step, the engine stops")
            self._fail(error)
            raise error from e

    def _fail(self, error: FatalEngineError) -> None:
        self.failed = error
        self.group.close(timeout_s=2, failed=True)

    def execute(self, step: ModelStep) -> StepResult:
        return self._run("execute", step)

    def finish(self, step: ModelStep, accepted: list[int], finished: list[bool]) -> None:
        self._run("finish", step, accepted, finished)

    def can_draft(self, request_id: str, num_computed: int, num_preemptions: int) -> bool:
        return self.local.can_draft(request_id, num_computed, num_preemptions)

    def drop(self, request_id: str) -> None:
        if self.failed is None:  # after a failure the engine aborts its requests: nothing to tell the ranks
            self._run("drop", request_id)

    def check_health(self) -> None:
        if self.failed is not None:
            raise self.failed
        try:
            self.group.check_health()
        except FatalEngineError as e:
            self._fail(e)
            raise
        self.local.check_health()

    def stats(self) -> dict[str, int]:
        return self.local.stats()

    def close(self, timeout_s: float = 10.0) -> None:
        self.group.close(timeout_s)
        self.local.close()

    # rank 0's pieces, as UniProcExecutor exposes them (the engine's properties reach them)
    runner = forwarded("local", "runner")
    storage = forwarded("local", "storage")
    cpu_storage = forwarded("local", "cpu_storage")
    drafter = forwarded("local", "drafter")
    graphs = forwarded("local", "graphs")
    spec_graphs = forwarded("local", "spec_graphs")

"""ParallelContext: which rank this process is, its process group, and the collectives the split model uses.

Passed explicitly to every layer that communicates (no module-level state): a test can run two groups in
one process, and a layer built without one is the single-process layer. Every wait is bounded: a rank
that died or hangs turns into a `ParallelTimeout` on the others instead of a hang.

How the bound holds. Every collective is issued async and waited with `work.wait(timeout)`:
- gloo (CPU): the wait returns when the collective is done and raises when `timeout` passes or a peer's
  connection closes (a killed peer fails the others at once).
- NCCL (CUDA): a wait *with a timeout* blocks the host until the collective's kernel has finished (polling its
  CUDA event, and NCCL's asynchronous error, e.g. a peer gone); past `timeout` torch aborts the communicator
  (freeing the stuck kernel) and raises DistBackendError. So each collective is a host sync (the price of the
  bound; tp > 1 runs eager on CUDA, where a wait inside a CUDA graph is impossible: engine.EngineConfig).
  Behind it, the process group's watchdog (timeout `devices.group_timeout`: longer than this one) with
  TORCH_NCCL_ASYNC_ERROR_HANDLING=2 aborts a communicator whose collective nobody waits on, without killing
  the process (devices.NCCL_ENV).
Either way the waiting rank gets a `ParallelTimeout`; the engine turns it into a FatalEngineError.

On gloo (CPU) 16-bit tensors travel and reduce as fp32 and come back in the caller's dtype: older gloo
builds have no bf16 reduction (pytorch issue 111131; the torch 2.x installed here has one), and the fp32
sum is the more exact one. NCCL reduces in the tensor's own dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .devices import group_timeout

DEFAULT_TIMEOUT = timedelta(seconds=60)


class ParallelTimeout(RuntimeError):
    """A collective did not finish in time: another rank died, hangs, or called a different collective."""


@dataclass(frozen=True)
class ParallelContext:
    """This rank's place in a tensor-parallel group of `size` ranks. group: a torch.distributed ProcessGroup
    (None only when size == 1, where every collective is the identity)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    timeout: timedelta = DEFAULT_TIMEOUT

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank={self.rank} is outside the group of size={self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError(f"a group of size={self.size} needs its torch.distributed process group; pass group=")

    @classmethod
    def from_group(cls, group: Any, timeout: timedelta = DEFAULT_TIMEOUT) -> "ParallelContext":
        return cls(rank=dist.get_rank(group), size=dist.get_world_size(group), group=group, timeout=timeout)

    def _wire_dtype(self, x: Tensor) -> torch.dtype:
        if x.dtype in (torch.bfloat16, torch.float16) and dist.get_backend(self.group) == "gloo":
            return torch.float32
        return x.dtype

    def _wait(self, work, what: str, shape) -> None:
        try:
            ok = work.wait(self.timeout)
        except RuntimeError as e:  # gloo: timeout or a peer's closed connection; NCCL: DistBackendError (timeout, abort)
            raise ParallelTimeout(f"rank {self.rank}/{self.size}: {what} of {tuple(shape)} failed within "
                                  f"{self.timeout.total_seconds():.0f} s ({e}); another rank died or diverged") from e
        if ok is False:
            raise ParallelTimeout(f"rank {self.rank}/{self.size}: {what} of {tuple(shape)} did not finish within "
                                  f"{self.timeout.total_seconds():.0f} s; another rank died or diverged")

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum of `x` over the group (a new tensor in x.dtype; x itself may be overwritten)."""
        if self.size == 1:
            return x
        y = x.to(self._wire_dtype(x)).contiguous()
        self._wait(dist.all_reduce(y, group=self.group, async_op=True), "all_reduce", y.shape)
        return y.to(x.dtype)

    def broadcast(self, x: Tensor, src: int = 0) -> Tensor:
        """Rank `src`'s `x` on every rank (every rank passes the same shape and dtype; x may be overwritten)."""
        if self.size == 1:
            return x
        y = x.to(self._wire_dtype(x)).contiguous()
        root = dist.get_global_rank(self.group, src)
        self._wait(dist.broadcast(y, root, group=self.group, async_op=True), "broadcast", y.shape)
        return y.to(x.dtype)

    def all_gather(self, x: Tensor, dim: int = -1) -> Tensor:
        """Every rank's `x` (equal shapes) concatenated along `dim` in rank order."""
        if self.size == 1:
            return x
        y = x.to(self._wire_dtype(x)).contiguous()
        out = [torch.empty_like(y) for _ in range(self.size)]
        self._wait(dist.all_gather(out, y, group=self.group, async_op=True), "all_gather", y.shape)
        return torch.cat(out, dim=dim).to(x.dtype)


def subgroup_context(ctx: ParallelContext, size: int) -> ParallelContext:
    """This rank's group of `size` consecutive ranks of `ctx`'s group (ranks g*size .. g*size + size - 1), as a
    context whose rank is the place in that group. Every rank of `ctx` must call it at the same point: torch's
    new_group is collective over the whole world, and each rank creates every group in the same order."""
    if size == 1:
        return ParallelContext(timeout=ctx.timeout)
    if ctx.size % size:
        raise ValueError(f"a group of {ctx.size} ranks does not split into groups of {size}")
    ranks = dist.get_process_group_ranks(ctx.group)
    backend = dist.get_backend(ctx.group)
    mine = None
    for g in range(ctx.size // size):
        pg = dist.new_group(ranks[g * size:(g + 1) * size], timeout=group_timeout(backend, ctx.timeout), backend=backend)
        if ctx.rank // size == g:
            mine = pg
    return ParallelContext(rank=ctx.rank % size, size=size, group=mine, timeout=ctx.timeout)

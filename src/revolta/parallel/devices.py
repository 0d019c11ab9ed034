"""Where each rank of a tensor-parallel group runs, which torch.distributed backend it uses, and the environment
NCCL needs. Pure functions of their arguments (the visible GPUs are passed in), so the choices are tested on CPU.

- device "cpu": every rank on the CPU, gloo;
- device "cuda" (or "cuda:0"): rank r on cuda:r of the GPUs this process sees (CUDA_VISIBLE_DEVICES chooses and
  orders them; the spawned ranks inherit it), NCCL. One process per GPU, so tp <= visible GPUs; the GPUs must be
  alike, because rank 0 plans every rank's cache from its own GPU's memory (engine `_budget`).

NVLink multicast (NVLS; symmetric-memory multicast) stays off in every rank: it is unreliable on the shared
multi-GPU hosts this runs on, and every rank of a communicator must agree on it, so rank 0's process gets the same
values as the workers it spawns (`apply_nccl_env`: only the names the user has not set).
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch

from .config import ParallelConfig, ParallelConfigError, check_world_size

# set in every rank's environment unless the user set them (read by NCCL / torch when a communicator is made)
NCCL_ENV = {
    "NCCL_NVLS_ENABLE": "0",  # no NVLink SHARP (multicast) all-reduce
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",  # torch symmetric memory without multicast objects
    "NVSHMEM_DISABLE_NVLS": "1",  # NVSHMEM (torch symmetric memory's backend) likewise
    # 2 = CleanUpOnly: when the watchdog sees a collective fail or time out it aborts the communicator (which frees
    # the stuck NCCL kernel) and leaves the process alone; the waiting thread then raises. torch's default (3) takes
    # the whole process down, which on rank 0 would kill the engine's process (the server) instead of failing its
    # requests with an error.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
}
# on NCCL the process group's own timeout (its watchdog) is a backstop behind ParallelContext's bounded wait: longer,
# so the waiting thread's ParallelTimeout (which names the collective) is what a stalled peer produces
NCCL_WATCHDOG_MARGIN = timedelta(seconds=30)


@dataclass(frozen=True)
class RankPlacement:
    """Rank `rank`'s device and backend."""

    rank: int
    device: torch.device
    backend: str  # "nccl" or "gloo"


def backend_for(device_type: str) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    if device_type == "cuda":
        return "nccl"
    if device_type == "cpu":
        return "gloo"
    raise ParallelConfigError(f"tensor parallel ranks run on 'cpu' (gloo) or 'cuda' (NCCL), not {device_type!r}")


def rank_placement(device: torch.device | str, rank: int) -> RankPlacement:
    """Rank `rank` of a group whose rank 0 runs on `device` (checked by `check_rank_devices`)."""
    device = torch.device(device)
    where = torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")
    return RankPlacement(rank, where, backend_for(device.type))


def group_timeout(backend: str, wait: timedelta) -> timedelta:
    """The process group's timeout for collectives that `ParallelContext` waits on for at most `wait`.

    gloo: the same (gloo's own socket timeouts fire with it). NCCL: `wait` plus NCCL_WATCHDOG_MARGIN, so the
    watchdog only catches what no bounded wait is watching (see context.py)."""
    return wait + NCCL_WATCHDOG_MARGIN if backend == "nccl" else wait


def check_rank_devices(device: torch.device | str, pc: ParallelConfig, gpus: Sequence[tuple[str, int]]) -> None:
    """Refuse, naming the fix, a device layout the ranks of `pc` cannot run on. gpus: (name, total memory in bytes)
    of each visible GPU in index order (empty without CUDA)."""
    device, tp = torch.device(device), pc.world_size
    backend_for(device.type)
    if tp == 1 or device.type == "cpu":
        return
    if device.index not in (None, 0):
        raise ParallelConfigError(
            f"device={str(device)!r} with tensor_parallel_size={tp}: rank r runs on cuda:r of the visible GPUs, so "
            f"the group cannot start on {device}; pass device='cuda' and choose the GPUs with CUDA_VISIBLE_DEVICES "
            f"(e.g. CUDA_VISIBLE_DEVICES={','.join(str(device.index + r) for r in range(tp))})")
    check_world_size(pc, len(gpus))
    used = list(gpus[:tp])
    # alike: one model, and no rank with less memory than rank 0 plans for (1% slack: the same model can report a
    # few MiB less, e.g. with ECC or a driver reservation)
    name0, mem0 = used[0]
    if any(name != name0 or mem < 0.99 * mem0 for name, mem in used[1:]):
        listed = ", ".join(f"cuda:{i} {name} ({mem / 2**30:.0f} GiB)" for i, (name, mem) in enumerate(used))
        raise ParallelConfigError(
            f"tensor_parallel_size={tp} runs on mixed GPUs ({listed}): rank 0 sizes every rank's cache from its own "
            f"GPU, so the ranks must run on GPUs of one model and memory size; choose alike GPUs with "
            f"CUDA_VISIBLE_DEVICES")


def visible_gpus() -> list[tuple[str, int]]:
    """(name, total memory) of each GPU this process sees, in index order (empty without CUDA)."""
    if not torch.cuda.is_available():
        return []
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    return [(p.name, p.total_memory) for p in props]


def apply_nccl_env(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Set the NCCL_ENV entries `environ` lacks (the user's values win); returns what was set. Called with
    os.environ by rank 0 before it makes a communicator or spawns a rank: NCCL reads its own process's
    environment, and spawned processes inherit it."""
    missing = {k: v for k, v in NCCL_ENV.items() if k not in environ}
    environ.update(missing)
    return missing

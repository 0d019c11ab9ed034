"""Sleep: give an idle engine's device memory back and take it again (vLLM's sleep levels).

    level 0   nothing is freed: the engine only stops serving (requests are refused until wake_up)
    level 1   weights -> host memory (a byte copy per storage), KV cache and CUDA graphs (their memory pools)
              dropped; wake_up copies the weights back, re-creates a zeroed cache and re-captures the graphs
    level 2   weights dropped too: wake_up reloads the parameters from the checkpoint files
              (`model.checkpoint_dir`); buffers, a device PLE table held outside the parameters and a DFlash2
              drafter's weights still go to host memory (as vLLM keeps model buffers), so level 2 also
              needs some host memory

Memory is freed by shrinking each tensor's storage to 0 bytes (`untyped_storage().resize_(0)`) and grown
back in place on wake_up, as FSDP frees its flat parameters: every module, view and cache handle keeps
pointing at the same storage object, so nothing that holds a weight or a cache tensor has to be rebuilt.
Only the data pointers change, which is why CUDA graphs (whose kernels baked the old addresses in) are
dropped and captured again. On a CPU run the "device" is the CPU: level 1 still copies every weight
storage into a separate host buffer and frees the original, level 2 still reloads from the files.

`check_host_memory` is the preflight: the bytes a level would copy to host memory, against what the
host has available (`host_available_bytes`: psutil, else /proc/meminfo; tests inject another source),
refused with `SleepRefused` before anything changes. Out of scope: tensor parallelism (the ranks' own
memory lives in their processes) and vLLM's partial `wake_up(tags=...)`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..ple.table import PLETable
from ..units import human_bytes

logger = logging.getLogger(__name__)

SLEEP_LEVELS = (0, 1, 2)
HOST_HEADROOM_BYTES = 256 << 20  # left free for the rest of the process after the host copies
HOST_HEADROOM_FRACTION = 0.05


class SleepRefused(RuntimeError):
    """The sleep preflight failed (host memory short, no checkpoint to reload); the engine was not touched."""


class EngineAsleepError(RuntimeError):
    """A request reached an engine that sleeps; call wake_up() first."""


def host_available_bytes() -> int:
    """Host memory available to new allocations without swapping (psutil, else MemAvailable of /proc/meminfo)."""
    try:
        import psutil
    except ImportError:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("cannot read the available host memory: no psutil and no MemAvailable in /proc/meminfo")
    return int(psutil.virtual_memory().available)


@dataclass
class _Held:
    """One storage freed by sleep: its size, and where its bytes wait (None: reloaded from the checkpoint)."""

    storage: torch.UntypedStorage
    nbytes: int
    device: torch.device
    backup: Tensor | None = None  # uint8 [nbytes] in host memory


def _byte_view(storage: torch.UntypedStorage, nbytes: int, device: torch.device) -> Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))


def _covered(spans: list[tuple[int, int]], nbytes: int) -> bool:
    """Whether the byte ranges [a, b) together cover [0, nbytes)."""
    end = 0
    for a, b in sorted(spans):
        if a > end:
            return False
        end = max(end, b)
    return end >= nbytes


def _storages(tensors: Iterable[tuple[Tensor, bool]], device: torch.device) -> dict[int, tuple[Tensor, list[bool]]]:
    """Storage key -> (one tensor on it, is-reloadable flag per tensor on it), for non-empty storages on `device`."""
    found: dict[int, tuple[Tensor, list[tuple[int, int] | None]]] = {}
    for t, reloadable in tensors:
        st = t.untyped_storage()
        if t.device != device or st.nbytes() == 0 or not st.resizable():  # e.g. a file mapping: it stays
            continue
        span = (t.storage_offset() * t.element_size(), (t.storage_offset() + t.numel()) * t.element_size())
        found.setdefault(st.data_ptr(), (t, []))[1].append(span if reloadable and t.is_contiguous() else None)
    out: dict[int, tuple[Tensor, list[bool]]] = {}
    for key, (t, spans) in found.items():
        # reloadable only when parameters alone cover the whole storage (one parameter, or the row slices of a
        # merged projection weight, layers/merged_linear.py): a reload then rewrites every byte
        whole = None not in spans and _covered(spans, t.untyped_storage().nbytes())
        out[key] = (t, [whole] * len(spans))
    return out


def weight_tensors(model: nn.Module, extra: Iterable[nn.Module] = ()) -> list[tuple[Tensor, bool]]:
    """(tensor, reloadable from the checkpoint) of every weight that lives with the model: its parameters (True),
    its buffers, a device PLE table kept outside the parameters, and the `extra` modules' tensors (False)."""
    out = [(p, True) for p in model.parameters()] + [(b, False) for b in model.buffers()]
    for m in model.modules():
        table = getattr(m, "table", None)
        if isinstance(table, PLETable) and table.placement == "device":
            out += [(table.weight, False)] + ([(table.scale, False)] if table.scale is not None else [])
    for mod in extra:
        out += [(t, False) for t in (*mod.parameters(), *mod.buffers())]
    return out


class SleepingMemory:
    """The storages a sleep freed, and how to bring them back (see the module docstring)."""

    def __init__(self, level: int, weights: list[tuple[Tensor, bool]], cache: list[Tensor], device: torch.device):
        self.level, self.device = level, torch.device(device)
        self._weights = _storages(weights, self.device)
        self._cache = _storages(((t, False) for t in cache), self.device)
        self.held: list[_Held] = []

    def host_bytes(self) -> int:
        """Bytes this level copies to host memory."""
        return sum(t.untyped_storage().nbytes() for t, flags in self._weights.values()
                   if self.level == 1 or not all(flags))

    def device_bytes(self) -> int:
        """Bytes this level frees on the device."""
        return sum(t.untyped_storage().nbytes() for t, _ in (*self._weights.values(), *self._cache.values()))

    @torch.no_grad()
    def free(self) -> None:
        """Copy what must survive to host memory and shrink every storage to 0 bytes."""
        pin = self.device.type == "cuda"
        for t, flags in self._weights.values():
            st, n = t.untyped_storage(), t.untyped_storage().nbytes()
            backup = None
            if self.level == 1 or not all(flags):
                backup = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
                backup.copy_(_byte_view(st, n, self.device))  # a separate host buffer even on a CPU run
            self.held.append(_Held(st, n, self.device, backup))
        for t, _ in self._cache.values():
            st = t.untyped_storage()
            self.held.append(_Held(st, st.nbytes(), self.device))
        if pin:
            torch.cuda.synchronize(self.device)
        for h in self.held:
            h.storage.resize_(0)
        self._weights, self._cache = {}, {}  # no tensor references: nothing keeps the freed tensors' objects alive
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.no_grad()
    def restore(self, reload: Callable[[], None]) -> None:
        """Grow every storage back; copy the host bytes in, zero the cache, then `reload()` the dropped weights."""
        for h in self.held:
            h.storage.resize_(h.nbytes)
            view = _byte_view(h.storage, h.nbytes, h.device)
            if h.backup is not None:
                view.copy_(h.backup, non_blocking=True)
            else:
                view.zero_()  # the cache starts empty; a dropped weight is rewritten by the reload
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if any(h.backup is None for h in self.held) and self.level == 2:
            reload()
        self.held = []

    def describe(self) -> str:
        return (f"level {self.level}: {human_bytes(self.device_bytes())} freed on {self.device.type}, "
                f"{human_bytes(self.host_bytes())} copied to host memory")


def check_host_memory(level: int, needed: int, available: int) -> None:
    """Raise SleepRefused when the host copies of `level` (`needed` bytes) do not fit in `available`."""
    want = needed + max(HOST_HEADROOM_BYTES, int(HOST_HEADROOM_FRACTION * needed))
    if needed and want > available:
        more = "; level 2 copies only buffers and tables" if level == 1 else ""
        raise SleepRefused(f"sleep(level={level}) needs {human_bytes(needed)} of host memory for the weights "
                           f"(+ {human_bytes(want - needed)} headroom) but only {human_bytes(available)} is "
                           f"available; the engine keeps serving. Free host memory{more}, or use level 0")


def reload_weights(model: nn.Module) -> None:
    """Read the model's parameters again from its checkpoint files, in place (level 2's wake_up)."""
    from ..ple.load import ple_embeddings
    from ..weights import load_weights

    skip = [] if model.mtp is not None else ["mtp."]
    if model.model.visual is None:
        skip.append("model.visual.")
    # a PLE table held outside the parameters was kept in host memory, not dropped: leave its on-disk shards
    skip += [f"{name}.ngram_embedding." for name, _, emb in ple_embeddings(model) if emb.table is not None]
    load_weights(model, model.checkpoint_dir, device=model.device, skip_prefixes=tuple(skip), progress=False)


def check_reloadable(model: nn.Module) -> None:
    """Raise SleepRefused unless level 2 can reload `model` (loaded from a checkpoint whose files still exist)."""
    from ..weights import checkpoint_files

    path = getattr(model, "checkpoint_dir", None)
    if path is None:
        raise SleepRefused("sleep(level=2) reloads the weights from the checkpoint, but this model was not loaded "
                           "from one (no checkpoint_dir); use level 1")
    try:
        checkpoint_files(path)
    except (OSError, ValueError) as e:
        raise SleepRefused(f"sleep(level=2) would reload the weights from {path}, but it cannot be read ({e}); "
                           "use level 1") from None

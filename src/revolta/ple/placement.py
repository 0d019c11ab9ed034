"""The `ple_placement` setting and the offload knobs, from an argument or the environment (torch-free).

Placements (spec/engine.md §6.2):
- "device": the table is a weight on the GPU (the default; the whole model on one device);
- "host": the table in pinned host memory, read by the GPU through a mapped view (the release
  note's reference configuration, VLLM_SM70_QWEN38_HYBRID_PLE=1 / VLLM_PLE_CPU_OFFLOAD=1);
- "disk": the table stays in the checkpoint's safetensors files, memory-mapped by a separate PLE
  worker process that gathers each step's rows (VLLM_PLE_CPU_OFFLOAD=1 + VLLM_PLE_DISK_OFFLOAD=1
  with VLLM_SM70_QWEN38_HYBRID_PLE=0; experimental in the release note).

Precedence: the argument, then REVOLTA_PLE_PLACEMENT, then the release note's variables, then the
default. The source of the value in force is kept, so the startup summary can say which one was used.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

PLACEMENTS = ("device", "host", "disk")
PLACEMENT_ENV = "REVOLTA_PLE_PLACEMENT"
VLLM_CPU_OFFLOAD, VLLM_DISK_OFFLOAD = "VLLM_PLE_CPU_OFFLOAD", "VLLM_PLE_DISK_OFFLOAD"
VLLM_HYBRID = "VLLM_SM70_QWEN38_HYBRID_PLE"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class Placement:
    """A resolved placement and where it came from ("argument", "environment (...)", "default ...")."""

    value: str
    source: str


def check_placement(value: str, what: str = "ple_placement") -> str:
    if value not in PLACEMENTS:
        raise ValueError(f"{what}={value!r}; use one of {', '.join(PLACEMENTS)} (spec/engine.md §6.2)")
    return value


def env_flag(environ: Mapping[str, str], name: str) -> bool | None:
    """True / False for a set boolean variable, None when unset; anything else is an error naming it."""
    raw = environ.get(name)
    if raw is None:
        return None
    if raw.strip().lower() in _TRUE:
        return True
    if raw.strip().lower() in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean; set it to 1 or 0")


def _from_vllm_env(environ: Mapping[str, str]) -> Placement | None:
    """The release note's variables: CPU offload alone keeps the table in host memory; CPU + disk offload
    reads it from the checkpoint files unless the hybrid (pinned-host) mode is on, which wins."""
    cpu, disk, hybrid = (env_flag(environ, n) for n in (VLLM_CPU_OFFLOAD, VLLM_DISK_OFFLOAD, VLLM_HYBRID))
    used = ", ".join(f"{n}={environ[n]}" for n in (VLLM_CPU_OFFLOAD, VLLM_DISK_OFFLOAD, VLLM_HYBRID) if n in environ)
    if hybrid:
        return Placement("host", f"environment ({used}: the pinned-host hybrid mode)")
    if disk and not cpu:
        raise ValueError(f"{VLLM_DISK_OFFLOAD}=1 needs {VLLM_CPU_OFFLOAD}=1 (release note: the disk mode sets both, "
                         f"and {VLLM_HYBRID}=0); or set {PLACEMENT_ENV}=disk")
    if cpu:
        return Placement("disk" if disk else "host", f"environment ({used})")
    return None


def resolve_ple_placement(value: str | None = None, environ: Mapping[str, str] | None = None,
                          default: str = "device") -> Placement:
    """The placement in force for an argument `value` (None: not given) and the environment."""
    environ = os.environ if environ is None else environ
    env_value = environ.get(PLACEMENT_ENV)
    from_env = (Placement(check_placement(env_value.strip().lower(), PLACEMENT_ENV), f"environment ({PLACEMENT_ENV})")
                if env_value else _from_vllm_env(environ))
    if value is not None:
        chosen = Placement(check_placement(value), "argument")
        if from_env is not None and from_env.value != chosen.value:
            logger.warning("ple_placement=%r (argument) overrides %r from the %s", value, from_env.value,
                           from_env.source)
        return chosen
    if from_env is not None:
        vllm = _from_vllm_env(environ) if env_value else None
        if vllm is not None and vllm.value != from_env.value:
            logger.warning("%s=%s overrides %r from the %s", PLACEMENT_ENV, env_value, vllm.value, vllm.source)
        return from_env
    return Placement(check_placement(default), "default")


def _env_number(environ: Mapping[str, str], name: str, default: float, minimum: float) -> float:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if value < minimum:
        raise ValueError(f"{name}={raw} must be >= {minimum:g}")
    return value


@dataclass(frozen=True)
class PLEOptions:
    """Knobs of the off-device placements (environment variables; the defaults suit a local NVMe disk).

    staged_min_tokens: host placement, steps of at least this many tokens gather on the host into a
    pinned staging buffer and copy once, instead of reading mapped memory from the GPU (0: never).
    disk_threads: the worker's gather threads. release_pages: madvise(DONTNEED) the shard pages a
    gather touched (the worker's RSS stays small; the page cache keeps them). prefault: ask the kernel
    to read the whole table into the page cache at start (madvise WILLNEED), for cold network storage, and map
    every page in the worker (MADV_POPULATE_READ from a background thread) so new rows cost no page fault each.
    worker_timeout_s: how long the GPU process waits for the worker's next sign of life (a reply or a
    heartbeat) before it fails the step: a stalled or dead worker ends the engine within this bound.
    """

    staged_min_tokens: int = 0
    disk_threads: int = 8
    release_pages: bool = False
    prefault: bool = False
    worker_timeout_s: float = 8.0
    worker_startup_timeout_s: float = 120.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "PLEOptions":
        env = os.environ if environ is None else environ
        release = env_flag(env, "REVOLTA_PLE_DISK_RELEASE_PAGES")
        return cls(
            staged_min_tokens=int(_env_number(env, "REVOLTA_PLE_STAGED_MIN_TOKENS", 0, 0)),
            disk_threads=int(_env_number(env, "REVOLTA_PLE_DISK_THREADS", min(16, os.cpu_count() or 1), 1)),
            release_pages=bool(release if release is not None else env_flag(env, "VLLM_PLE_DISK_RELEASE_PAGES")),
            prefault=bool(env_flag(env, "REVOLTA_PLE_DISK_PREFAULT")),
            worker_timeout_s=_env_number(env, "REVOLTA_PLE_WORKER_TIMEOUT_S", 8.0, 0.1),
            worker_startup_timeout_s=_env_number(env, "REVOLTA_PLE_WORKER_STARTUP_TIMEOUT_S", 120.0, 1.0))

"""Which device revolta runs on, and whether it can run there correctly.

    resolve_device(name)                None -> cuda when available, else cpu; a device this machine lacks raises
                                        DeviceError naming it and the devices that exist
    check_triton(capability, version)   refuse a Volta GPU (compute capability 7.x) under Triton < 3.4

Triton before 3.4 returns zeros from fp16 `tl.dot` on Volta (triton-lang/triton issues 3478 and 4037, fixed in
3.4), and the GDN chunk kernels and MoE tiles use it: such a stack would run and print wrong numbers, so it is
refused at start-up instead. pyproject.toml requires triton>=3.4; this catches an older one installed by hand.
"""

from __future__ import annotations

import re

import torch

MIN_TRITON_FOR_VOLTA = (3, 4)


class DeviceError(ValueError):
    """A device that does not exist here, or one revolta would compute wrong on; the message says what to do."""


def triton_version() -> str | None:
    """The installed Triton's version, or None without Triton (the torch reference path needs none)."""
    try:
        import triton
    except ImportError:
        return None
    return getattr(triton, "__version__", None)


def _release(version: str) -> tuple[int, ...]:
    """"3.3.1" / "3.4.0+git1234" / "3.4.0rc1" -> (3, 3, 1) / (3, 4, 0) / (3, 4, 0): the leading numbers."""
    match = re.match(r"\d+(\.\d+)*", version.strip())
    return tuple(int(p) for p in match.group(0).split(".")) if match else ()


def check_triton(capability: tuple[int, int], version: str | None) -> None:
    """Raise DeviceError for compute capability 7.x (V100, Titan V, T4) under a Triton older than 3.4."""
    if capability[0] != 7 or version is None:
        return
    release = _release(version)
    if release and release < MIN_TRITON_FOR_VOLTA:
        need = ".".join(map(str, MIN_TRITON_FOR_VOLTA))
        raise DeviceError(f"triton {version} computes fp16 tl.dot wrong (zeros) on this compute capability "
                          f"{capability[0]}.{capability[1]} GPU (triton-lang/triton issues 3478, 4037); "
                          f"upgrade it: pip install 'triton>={need}'")


def available_devices() -> list[str]:
    """The device names that exist on this machine: cpu, then cuda:0, cuda:1, ..."""
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ["cpu"] + [f"cuda:{i}" for i in range(cuda)]


def _no_cuda_reason() -> str:
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    return "torch sees no CUDA GPU"


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None -> cuda when available, else cpu. A name this machine has no device for raises DeviceError (one
    line naming it and what exists), before anything loads; a CUDA device is also checked by `check_triton`."""
    if device is None:
        resolved = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            resolved = torch.device(device)
        except (RuntimeError, TypeError):
            raise DeviceError(f"device {str(device)!r} is not a device name; available here: "
                              f"{', '.join(available_devices())}") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {str(device)!r} does not exist on this machine ({_no_cuda_reason()}); "
                              f"available here: {', '.join(available_devices())}")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise DeviceError(f"device {str(device)!r} does not exist on this machine; available here: "
                              f"{', '.join(available_devices())}")
        check_triton(torch.cuda.get_device_capability(resolved), triton_version())
    elif resolved.type not in ("cpu", "meta"):  # meta: shapes only, for building a model without memory
        raise DeviceError(f"device {str(device)!r}: revolta runs on cpu or cuda; available here: "
                          f"{', '.join(available_devices())}")
    return resolved

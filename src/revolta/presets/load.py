"""Naming a model: a checkpoint directory, or "default" for the embedded default model.

    revolta.load_model("default")                 # the embedded default, built offline on first use
    revolta.load_model("trained-default")         # the trained preset (what "default" names unless told otherwise)
    revolta.load_model("random-default")          # the random-weight preset (tests)
    revolta.load_model("/path/to/checkpoint", dtype=torch.float16, device="cuda")

`resolve_model` is the one place the name is read; `LLM(model=...)` uses it too. The name "default" always means the
preset: a local directory called `default` is `"./default"`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "default"
TRAINED, RANDOM = "trained-default", "random-default"
DEFAULT_ENV = "REVOLTA_DEFAULT_MODEL"  # "trained" (the default) or "random": what "default" / None names


def default_preset(environ: Mapping[str, str] | None = None) -> str:
    """TRAINED or RANDOM: what "default" names, from $REVOLTA_DEFAULT_MODEL ("trained", unset: the trained model;
    "random": the random-weight preset, which the test suite uses for its speed and fixed shapes)."""
    value = (os.environ if environ is None else environ).get(DEFAULT_ENV, "trained").strip().lower()
    if value not in ("trained", "random"):
        raise ValueError(f"{DEFAULT_ENV}={value!r}; use 'trained' (the trained embedded default) or 'random' (the "
                         "random-weight preset)")
    return TRAINED if value == "trained" else RANDOM


def resolve_model(model: str | Path | None) -> tuple[Path, bool]:
    """(checkpoint directory, whether it is an embedded default) for None / "default" / "trained-default" /
    "random-default" or a directory path.

    Builds a preset on first use; raises FileNotFoundError for a path that is not a directory."""
    name = model if isinstance(model, str) else None
    if model is None or name == DEFAULT_MODEL:
        name = default_preset()
    if name in (TRAINED, RANDOM):
        if name == TRAINED:
            from .trained import ensure_trained_model

            return ensure_trained_model(), True
        from .default import ensure_default_model

        return ensure_default_model(), True
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model={str(model)!r} is not a directory; pass a local checkpoint directory "
                                f"(config.json + *.safetensors), {DEFAULT_MODEL!r} for the embedded default model, "
                                f"or {TRAINED!r} / {RANDOM!r} for one of the two presets")
    return path, False


def load_model(path: str | Path, **kwargs: Any):
    """`revolta.load_model`: `model.load_model` (same arguments: dtype, device, with_mtp, with_vision, progress,
    ple_placement), where `path` may also be "default", the embedded default model (built offline into the cache on
    first use), "trained-default" or "random-default"."""
    from ..model import load_model as load

    directory, _ = resolve_model(path)
    return load(directory, **kwargs)

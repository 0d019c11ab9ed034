"""Naming a model: a checkpoint directory, or "default" for the embedded default model.

    revolta.load_model("default")                 # the embedded default, built offline on first use
    revolta.load_model("/path/to/checkpoint", dtype=torch.float16, device="cuda")

`resolve_model` is the one place the name is read; `LLM(model=...)` uses it too. The name "default" always means the
preset: a local directory called `default` is `"./default"`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DEFAULT_MODEL = "default"


def resolve_model(model: str | Path | None) -> tuple[Path, bool]:
    """(checkpoint directory, whether it is the embedded default) for None / "default" or a directory path.

    Builds the default on first use; raises FileNotFoundError for a path that is not a directory."""
    if model is None or (isinstance(model, str) and model == DEFAULT_MODEL):
        from .default import ensure_default_model

        return ensure_default_model(), True
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model={str(model)!r} is not a directory; pass a local checkpoint directory "
                                f"(config.json + *.safetensors), or {DEFAULT_MODEL!r} for the embedded default model")
    return path, False


def load_model(path: str | Path, **kwargs: Any):
    """`revolta.load_model`: `model.load_model` (same arguments: dtype, device, with_mtp, with_vision, progress,
    ple_placement), where `path` may also be "default", the embedded default model (random weights, built offline
    into the cache on first use)."""
    from ..model import load_model as load

    directory, _ = resolve_model(path)
    return load(directory, **kwargs)

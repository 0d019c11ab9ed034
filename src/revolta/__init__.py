"""revolta: run and study Qwen3.8-Flash-Next.

    from revolta import LLM, SamplingParams
    outputs = LLM().generate("Hello", SamplingParams(temperature=0, max_tokens=16))
    print(outputs[0].outputs[0].text)

`revolta.load_model(path, dtype=..., device=...)` returns the model module itself (token ids [B, S] in,
logits [B, S, V] out) for notebooks and parity checks; `revolta.load_model("default")` is the embedded default
model. Names are imported on first use, so `import revolta` stays cheap and has no side effects.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "load_model", "__version__"]

_EXPORTS = {"LLM": ".llm", "SamplingParams": ".engine.sampling",
            "StructuredOutputsParams": ".engine.structured",
            "load_model": ".presets.load"}

if TYPE_CHECKING:
    from .llm import LLM
    from .presets.load import load_model
    from .engine.sampling import SamplingParams
    from .engine.structured import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'revolta' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)

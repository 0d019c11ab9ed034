"""DFlash2 speculative decoding (spec/engine.md §2.1-2.3, §2.7): a block-diffusion drafter with a candidate selector.

draft_config.py  DFlash2DraftConfig, the drafter's config.json (dflash 0.1.0 field names, tap_reduction)
model.py         the drafter: context K/V from tapped target states, one non-causal block, DraftKVCache
context_store.py DraftContextStore: the engine's drafter context K/V, preallocated per request slot
conv.py          the grouped dynamic causal convolutions around every sublayer
selector.py      the candidate selector: top-K lattice and the greedy or sampled walk
checkpoint.py    load a dflash-format drafter directory, every name and shape checked first
rank_drafter.py  a tensor-parallel rank's drafter: layers split like a decoder layer, its codebook rows
taps.py          the context features from a HyperConnection target (tap_reduction), captured per forward
drafter.py       DFlash2Drafter: the engine's drafter interface (has_pending / keep / drop / propose), as MTPDrafter
"""

from .draft_config import DFlash2DraftConfig, DraftConfigError

# The torch modules load on first use, so the pure-Python siblings (config and option checks) can be
# imported from anywhere (e.g. the cache planner) without pulling in the runner and the model.
_LAZY = {"load_draft_model": "checkpoint", "DFlash2Drafter": "drafter", "DFlash2DraftModel": "model",
         "DraftKVCache": "model", "DraftContextStore": "context_store", "Selection": "selector"}

__all__ = ["DFlash2DraftConfig", "DFlash2DraftModel", "DFlash2Drafter", "DraftConfigError", "DraftContextStore",
           "DraftKVCache", "Selection", "load_draft_model"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""DFlash2 speculative decoding (spec/engine.md §2.1-2.3, §2.7): a block-diffusion drafter with a candidate selector.

draft_config.py  DFlash2DraftConfig, the drafter's config.json (dflash 0.1.0 field names, tap_reduction)
model.py         the drafter: context K/V from tapped target states, one non-causal block, DraftKVCache
conv.py          the grouped dynamic causal convolutions around every sublayer
selector.py      the candidate selector: top-K lattice and the greedy or sampled walk
checkpoint.py    load a dflash-format drafter directory, every name and shape checked first
taps.py          the context features from a HyperConnection target (tap_reduction), captured per forward
"""

from .checkpoint import load_draft_model
from .draft_config import DFlash2DraftConfig, DraftConfigError
from .model import DFlash2DraftModel, DraftKVCache
from .selector import Selection

__all__ = ["DFlash2DraftConfig", "DFlash2DraftModel", "DraftConfigError", "DraftKVCache", "Selection",
           "load_draft_model"]

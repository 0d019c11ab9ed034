"""Speculative decoding with the checkpoint's MTP head (spec/engine.md §2.4, §2.8, §3).

config.py   SpeculativeConfig (vLLM's `speculative_config` dict, resolved against the checkpoint)
verify.py   the acceptance rule: greedy longest prefix + bonus, lossless rejection sampling
mtp.py      the MTP drafter: k recursive MTP steps on the paged cache, pending target hiddens
commit.py   recurrent state after verification: per-draft state slots or replay, bitwise equal
stats.py    acceptance statistics per request and per engine
dflash2/    DFlash2: configuration options, the concurrency ladder, checks before weights, sharded
            selector codebooks and the DFlash2 drafter (docs/speculative.md, docs/dflash2.md)
"""

from .config import SpeculativeConfig
from .stats import SpecStats

__all__ = ["SpecStats", "SpeculativeConfig"]

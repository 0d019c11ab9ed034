"""Tensor parallelism and decode context parallelism (issue 23): split the text model across ranks of one process
group, and the full-attention K/V of each sequence across the ranks that share a KV head.

config.py   ParallelConfig(tp, dcp) and its validation against a ModelConfig (before weights load)
context.py  ParallelContext: this rank's place in the group and the bounded-wait collectives
layers.py   row-parallel linear, vocab-parallel embedding / LM head, the reducing MoE
dcp.py      DCPAttention: a trunk QSA layer over this rank's stripe of the K/V, partial outputs merged by lse
shard.py    which slice of each checkpoint tensor a rank holds; building a rank's model
load.py     filling a rank's model from the checkpoint, reading its slices only
docs/parallel.md says how each layer is split.
"""

from .config import ParallelConfig, ParallelConfigError, check_world_size, validate_parallel
from .context import ParallelContext

__all__ = ["ParallelConfig", "ParallelConfigError", "ParallelContext", "check_world_size", "validate_parallel"]

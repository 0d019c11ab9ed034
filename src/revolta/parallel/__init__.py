"""Tensor parallelism and decode context parallelism (issue 23): split the text model across ranks of one process
group, and the full-attention K/V of each sequence across the ranks that share a KV head.

config.py   ParallelConfig(tp, dcp) and its validation against a ModelConfig (before weights load)
context.py  ParallelContext: this rank's place in the group and the bounded-wait collectives
devices.py  where each rank runs (cuda:r + NCCL, or CPU + gloo), the refusals, the NCCL environment defaults
layers.py   row-parallel (packed) linear, vocab-parallel embedding / LM head, the reducing MoE
dcp.py      DCPAttention: a trunk QSA layer over this rank's stripe of the K/V, partial outputs merged by lse
shard.py    which slice of each checkpoint tensor a rank holds; building a rank's model
packed.py   which slice of each packed (int4 / fp4) tensor a rank holds: whole words and quantization groups
load.py     filling a rank's model from the checkpoint, reading its slices only
ple.py      the PLE table in host memory at tp > 1: a row range per rank, masked gather + all-reduce
docs/parallel.md says how each layer is split.
"""

from .config import ParallelConfig, ParallelConfigError, check_world_size, validate_parallel
from .context import ParallelContext

__all__ = ["ParallelConfig", "ParallelConfigError", "ParallelContext", "check_world_size", "validate_parallel"]

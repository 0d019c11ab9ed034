"""`sharded_selector_codebook`: the candidate selector's two vocab x rank codebooks split by
vocabulary rows over the tensor-parallel group (spec/engine.md §2.7, release note #9).

The selector (spec §2.2) reads a `predecessor_codebook` row for each predecessor token (the
anchor, then each position's K candidates) and a `successor_codebook` row for each candidate,
both [vocab, rank]. Replicated, every rank holds both tables (242.5 MiB at vocab 248,320, rank
256, fp16). Sharded, rank r of W holds the contiguous rows [r * ceil(V/W), (r + 1) * ceil(V/W))
(the last range may be shorter), like a vocabulary-parallel embedding, so every row has exactly
one owner. A lookup takes the owned rows and zeros for the others, and one sum all-reduce over
the group completes both lookups at once. For every finite value x, x + 0 + ... + 0 == x
bitwise; the one exception is -0, which becomes +0 (the release note's "negative zero can lose
its sign"). The all-reduce is the ParallelContext's, so its wait is bounded like every other
collective of the split model (a dead rank is a ParallelTimeout, not a hang).

The checkpoint stores the tables as `candidate_selector.{predecessor,successor}_codebook`
(the dflash package's names; `.weight` suffixes are accepted too). `load_codebook_shards` reads
each shape from the safetensors header and checks it is [vocab, rank] before reading a rank's
rows, so a rank never materialises the whole table. `checkpoint.load_draft_model(..., ctx=)`
loads a drafter that way and hands the shards to its selector (`CandidateSelector.shard_codebooks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from ...parallel.context import ParallelContext

CODEBOOKS = ("predecessor_codebook", "successor_codebook")
PREFIX = "candidate_selector."


def vocab_shard(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of the vocabulary rows rank `rank` of `world_size` owns."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of a tensor-parallel group of {world_size}")
    if vocab_size < world_size:
        raise ValueError(f"vocab_size={vocab_size} has fewer rows than the {world_size} tensor-parallel ranks")
    per = -(-vocab_size // world_size)
    start = min(rank * per, vocab_size)
    return start, min(start + per, vocab_size)


def codebook_bytes_per_gpu(vocab_size: int, selector_rank: int, tensor_parallel_size: int, sharded: bool,
                           element_bytes: int = 2) -> int:
    """Bytes of both codebooks on the GPU holding the most rows (rank 0): 242.5 MiB replicated at
    vocab 248,320 and rank 256 in fp16, 60.6 MiB per GPU sharded over TP4 (release note: 242 -> 61)."""
    start, end = vocab_shard(vocab_size, 0, tensor_parallel_size) if sharded else (0, vocab_size)
    return len(CODEBOOKS) * (end - start) * selector_rank * element_bytes


def check_codebook_shape(name: str, shape: Sequence[int], vocab_size: int, selector_rank: int) -> None:
    if tuple(shape) != (vocab_size, selector_rank):
        raise ValueError(f"checkpoint tensor {name} has shape {list(shape)}, expected [vocab_size={vocab_size}, "
                         f"selector_rank={selector_rank}]; the drafter checkpoint does not match its config.json")


def load_codebook_shards(checkpoint: str | Path, vocab_size: int, selector_rank: int, rank: int,
                         world_size: int) -> dict[str, Tensor]:
    """{codebook name: this rank's rows [end - start, rank]} from the drafter's *.safetensors.

    Raises ValueError when a codebook is missing or its header shape is not [vocab_size, selector_rank].
    """
    from safetensors import safe_open

    files = sorted(Path(checkpoint).glob("*.safetensors"))
    start, end = vocab_shard(vocab_size, rank, world_size)
    out: dict[str, Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                name = key.removesuffix(".weight").removeprefix(PREFIX)
                if key.startswith(PREFIX) and name in CODEBOOKS:
                    view = sf.get_slice(key)
                    check_codebook_shape(key, view.get_shape(), vocab_size, selector_rank)
                    out[name] = view[start:end]
    missing = [f"{PREFIX}{n}" for n in CODEBOOKS if n not in out]
    if missing:
        raise ValueError(f"{checkpoint}: no tensor {missing} in {[f.name for f in files]}; pass a DFlash2 drafter "
                         "checkpoint")
    return out


class ShardedCodebooks(nn.Module):
    """This rank's rows of both codebooks; `lookup` returns full rows on every rank.

    predecessor, successor: [end - start, rank] rows [start, end) of each table (`vocab_shard` for
    ctx.rank of ctx.size). ctx: the tensor-parallel group; of size 1 this is a plain replicated
    lookup with no collective.
    """

    def __init__(self, predecessor: Tensor, successor: Tensor, vocab_size: int, ctx: ParallelContext):
        super().__init__()
        self.start, self.end = vocab_shard(vocab_size, ctx.rank, ctx.size)
        for name, t in zip(CODEBOOKS, (predecessor, successor)):
            if t.dim() != 2 or t.shape[0] != self.end - self.start:
                raise ValueError(f"{name} shard has shape {list(t.shape)}, expected [{self.end - self.start}, rank] "
                                 f"(rows {self.start}..{self.end} of {vocab_size})")
        self.predecessor_codebook = nn.Parameter(predecessor, requires_grad=False)  # [V_local, R]
        self.successor_codebook = nn.Parameter(successor, requires_grad=False)  # [V_local, R]
        self.vocab_size, self.ctx = vocab_size, ctx

    @classmethod
    def from_full(cls, predecessor: Tensor, successor: Tensor, ctx: ParallelContext) -> "ShardedCodebooks":
        """Shard full [vocab, rank] tables already in memory (shapes checked first)."""
        vocab, r = predecessor.shape
        check_codebook_shape(PREFIX + CODEBOOKS[1], successor.shape, vocab, r)
        start, end = vocab_shard(vocab, ctx.rank, ctx.size)
        return cls(predecessor[start:end].clone(), successor[start:end].clone(), vocab, ctx)

    def _owned(self, table: Tensor, ids: Tensor) -> Tensor:
        """[*ids.shape, R]: the rows this rank owns, +0 elsewhere."""
        flat = ids.reshape(-1)
        if self.end == self.start:  # a rank past the vocabulary's end (e.g. 5 rows over 4 ranks: 2, 2, 1, 0) owns none
            return torch.zeros(flat.shape[0], table.shape[1], dtype=table.dtype, device=table.device)
        mine = (flat >= self.start) & (flat < self.end)
        rows = table[(flat - self.start).clamp(0, self.end - self.start - 1)]  # [N, R]
        return torch.where(mine[:, None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))

    def lookup(self, predecessor_ids: Tensor, successor_ids: Tensor) -> tuple[Tensor, Tensor]:
        """(predecessor rows [*predecessor_ids.shape, R], successor rows [*successor_ids.shape, R]),
        bitwise the replicated lookup except -0 -> +0, with one all-reduce for both."""
        a = self._owned(self.predecessor_codebook, predecessor_ids)
        b = self._owned(self.successor_codebook, successor_ids)
        both = self.ctx.all_reduce(torch.cat([a, b]))  # [N + M, R]; identity at size 1
        r = both.shape[-1]
        return (both[:a.shape[0]].reshape(*predecessor_ids.shape, r),
                both[a.shape[0]:].reshape(*successor_ids.shape, r))

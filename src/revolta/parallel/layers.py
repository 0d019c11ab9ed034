"""The layers whose output crosses ranks. Each subclasses the single-process layer, so parameter names
(and so checkpoint names) are unchanged; only the shapes are a rank's part and the forward adds the one
collective that reassembles the full result.

RowParallelLinear   input features split: partial products, summed by one all-reduce (GDN out_proj, QSA o_proj)
RowParallelQuantLinear  the same over a packed weight holding the rank's whole quantization groups
ParallelMoE         experts' intermediate dim and the shared expert split: routed + shared partial sums,
                    one all-reduce per MoE (router and shared-expert gate replicated)
VocabParallelEmbedding  rows [start, end) of the vocabulary per rank; other ids give zeros; all-reduce
                    (x + 0 + ... + 0 == x bitwise, so the sum is exact)
VocabParallelLMHead rows of the vocabulary per rank; logits all-gathered and the padding cut off
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from ..layers.linear import QuantLinear, quant_linear
from ..layers.moe import MoE
from .context import ParallelContext


def vocab_range(vocab_size: int, rank: int, tp: int) -> tuple[int, int, int]:
    """(start, end, rows per rank): rank r owns ids [start, end); every rank holds `rows` rows (the last
    rank's tail is zero padding when tp does not divide the vocabulary)."""
    rows = -(-vocab_size // tp)
    start = min(vocab_size, rank * rows)
    return start, min(vocab_size, start + rows), rows


class RowParallelLinear(nn.Linear):
    """nn.Linear over this rank's slice of the input features; the all-reduce makes the full output."""

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.ctx = ctx

    def forward(self, x: Tensor) -> Tensor:
        y = self.ctx.all_reduce(F.linear(x, self.weight))  # [..., out] partial -> full
        return y if self.bias is None else y + self.bias  # bias once, not once per rank


class RowParallelQuantLinear(QuantLinear):
    """QuantLinear over this rank's whole groups of the input features; the all-reduce makes the full output."""

    def __init__(self, in_features: int, out_features: int, bias: bool, fmt, ctx: ParallelContext):
        super().__init__(in_features, out_features, bias, fmt)
        self.ctx = ctx

    def forward(self, x: Tensor) -> Tensor:
        y = quant_linear(x.reshape(-1, self.in_features), self.fmt, self.packed(), self.out_features, None, self.kernel,
                         self.splitk_counters)
        y = self.ctx.all_reduce(y).view(*x.shape[:-1], self.out_features)  # partial -> full
        return y if self.bias is None else y + self.bias  # bias once, not once per rank


class ParallelMoE(MoE):
    """MoE with this rank's slice of every expert's (and the shared expert's) intermediate dim."""

    def __init__(self, *args, ctx: ParallelContext, **kw):
        super().__init__(*args, **kw)
        self.ctx = ctx

    def forward(self, x: Tensor, ops=None) -> Tensor:
        # silu(gate_i) * up_i is per intermediate channel, so each rank's down projection of its channels is
        # a partial sum of the full output; the shared expert's sigmoid gate is one scalar per token
        return self.ctx.all_reduce(super().forward(x, ops))


class VocabParallelEmbedding(nn.Embedding):
    """`embed_tokens` with this rank's rows of the vocabulary."""

    def __init__(self, vocab_size: int, dim: int, ctx: ParallelContext):
        self.start, self.end, rows = vocab_range(vocab_size, ctx.rank, ctx.size)
        super().__init__(rows, dim)
        self.vocab_size, self.ctx = vocab_size, ctx

    def forward(self, ids: Tensor) -> Tensor:
        """ids: [...] global ids -> [..., d]."""
        mine = (ids >= self.start) & (ids < self.end)
        local = (ids - self.start).masked_fill(~mine, 0)
        e = F.embedding(local, self.weight).masked_fill(~mine[..., None], 0.0)
        return self.ctx.all_reduce(e)


class VocabParallelLMHead(nn.Linear):
    """`lm_head` with this rank's rows of the vocabulary; returns the full-vocabulary logits on every rank."""

    def __init__(self, dim: int, vocab_size: int, ctx: ParallelContext):
        self.start, self.end, rows = vocab_range(vocab_size, ctx.rank, ctx.size)
        super().__init__(dim, rows, bias=False)
        self.vocab_size, self.ctx = vocab_size, ctx

    def forward(self, y: Tensor) -> Tensor:
        """y: [N, d] -> [N, V]."""
        part = F.linear(y, self.weight)  # [N, rows]
        return self.ctx.all_gather(part, dim=-1)[..., : self.vocab_size]

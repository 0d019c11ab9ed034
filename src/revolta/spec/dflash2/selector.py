"""DFlash2's candidate (path) selector (spec/engine.md §2.2, item 2).

Per request and draft position t = 0 .. D - 1: the K best ids of the drafter's logits U_t are the
candidates; the edge score from predecessor a to candidate b is

    S_t(a, b) = U_t(b) + < A[a] * P(h_t), B[b] >,

with A = `predecessor_codebook`, B = `successor_codebook` (both vocab x rank) and P =
`hidden_projection`. Position 0's only predecessor is the anchor; position t's are the K candidates
of t - 1. All positions' K x K lattices are computed at once, then a left-to-right walk from the
anchor reads the row of the candidate chosen at t - 1 and picks the next one: the argmax (greedy),
or a draw from softmax(S / temperature) over the K candidates (sampled; those rows are the sparse
proposal distribution q of rejection sampling). It is a walk, not Viterbi.

At tensor_parallel_size > 1 with `sharded_selector_codebook` each rank holds only its vocabulary
rows of A and B (`shard_codebooks`, spec/dflash2/sharded_codebook.py): the lattice's rows of both
tables are then one lookup pair completed by one all-reduce, and every rank gets the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .sharded_codebook import ShardedCodebooks


@dataclass(frozen=True)
class Selection:
    """The walk's result for B requests and D draft positions."""

    tokens: Tensor  # [B, D] long: the drafted ids
    candidates: Tensor  # [B, D, K] long: each position's top-K ids, by descending logit
    q: Tensor | None  # [B, D, K] fp32: the sampled walk's distribution over `candidates` (None when greedy)


class CandidateSelector(nn.Module):
    """`candidate_selector.*`: the two codebooks and the hidden projection."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)
        self.successor_codebook = nn.Embedding(vocab_size, rank)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.codebook_shards: ShardedCodebooks | None = None  # set by shard_codebooks (tp > 1)

    def shard_codebooks(self, shards: ShardedCodebooks) -> None:
        """Hold this rank's rows of both codebooks instead of the whole tables (which are dropped)."""
        del self.predecessor_codebook, self.successor_codebook
        self.codebook_shards = shards

    def lookup(self, predecessor_ids: Tensor, successor_ids: Tensor) -> tuple[Tensor, Tensor]:
        """(A rows [*predecessor_ids.shape, R], B rows [*successor_ids.shape, R])."""
        if self.codebook_shards is not None:
            return self.codebook_shards.lookup(predecessor_ids, successor_ids)
        return self.predecessor_codebook(predecessor_ids), self.successor_codebook(successor_ids)

    def lattice(self, hidden: Tensor, unary: Tensor, candidates: Tensor, anchor_ids: Tensor) -> tuple[Tensor, Tensor]:
        """Edge scores: (first [B, K] from the anchor, rest [B, D - 1, K, K] indexed [t - 1, a, b]).

        hidden: [B, D, H] draft hidden states; unary: [B, D, K] candidate logits; candidates: [B, D, K].
        """
        h = self.hidden_projection(hidden)  # [B, D, R]
        D, K = candidates.shape[1:]
        predecessors = torch.cat([anchor_ids[:, None], candidates[:, :-1].flatten(1)], dim=1)  # [B, 1 + (D-1)K]
        pred_rows, succ = self.lookup(predecessors, candidates)  # [B, 1 + (D-1)K, R], [B, D, K, R]
        anchor = pred_rows[:, 0] * h[:, 0]  # [B, R]
        first = unary[:, 0] + (succ[:, 0] @ anchor.unsqueeze(-1)).squeeze(-1)  # [B, K]
        pred = pred_rows[:, 1:].unflatten(1, (D - 1, K)) * h[:, 1:, None]  # [B, D-1, K(a), R]
        rest = unary[:, 1:, None, :] + pred @ succ[:, 1:].transpose(-1, -2)  # [B, D-1, K(a), K(b)]
        return first, rest

    def forward(self, hidden: Tensor, logits: Tensor, anchor_ids: Tensor, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> Selection:
        """hidden: [B, D, H]; logits: [B, D, V] of the same positions; anchor_ids: [B] long.

        temperature > 0 samples each step from softmax(scores / temperature) with `generator`.
        """
        unary, candidates = torch.topk(logits, self.top_k, dim=-1)  # [B, D, K], descending
        first, rest = self.lattice(hidden, unary, candidates, anchor_ids)
        rows = torch.arange(first.shape[0], device=first.device)
        picks, qs = [], []
        scores = first
        for t in range(candidates.shape[1]):
            if t > 0:
                scores = rest[rows, t - 1, picks[-1]]  # the row of the candidate chosen at t - 1: [B, K]
            if temperature > 0:
                q = torch.softmax(scores.float() / temperature, dim=-1)
                picks.append(torch.multinomial(q, 1, generator=generator).squeeze(-1))
                qs.append(q)
            else:
                picks.append(scores.argmax(-1))
        index = torch.stack(picks, dim=1)  # [B, D]
        tokens = candidates.gather(-1, index.unsqueeze(-1)).squeeze(-1)
        return Selection(tokens, candidates, torch.stack(qs, dim=1) if qs else None)

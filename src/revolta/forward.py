"""ForwardMeta: the per-step data every layer receives (flat varlen token stream)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .state import SequenceState


@dataclass
class ForwardMeta:
    """One forward over B sequences laid end to end: T = cu_seqlens[-1] tokens.

    cu_seqlens: [B + 1] python ints; sequence b owns tokens cu_seqlens[b]:cu_seqlens[b+1].
    states: B per-sequence states; state.num_tokens is the index of each sequence's first new token.
    input_ids: [T] long (raw ids; the n-gram hash reads them, media pads included).
    positions: [3, T] long mRoPE positions (all rows equal for text).
    cos, sin: [T, rotary_dim] fp32 rotary tables for `positions`, shared by all QSA layers.
    """

    cu_seqlens: list[int]
    states: list[SequenceState]
    input_ids: Tensor
    positions: Tensor
    cos: Tensor
    sin: Tensor

    @property
    def num_seqs(self) -> int:
        return len(self.states)

    def seq_slices(self):
        """Yield (b, start, end, state) for each sequence."""
        for b, st in enumerate(self.states):
            yield b, self.cu_seqlens[b], self.cu_seqlens[b + 1], st

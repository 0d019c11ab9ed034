"""Per-sequence inference state of the torch path (spec/model.md §10.1).

One `SequenceState` per sequence holds everything an incremental forward needs to carry:
GDN conv and recurrent state, QSA K/V with the indexer's raw and compressed keys, the PLE
conv history and n-gram context. Layers create their entry on first use. This is the path of
notebooks, parity tests and references; serving runs on the paged hybrid cache instead (cache/, with
`forward.PagedMeta`), where the engine's runner passes empty states. The model reads state only
through `ForwardMeta`, so both paths share the layer code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class GDNState:
    conv: Tensor  # [K-1, conv_dim] last pre-conv, pre-activation inputs (oldest first)
    recurrent: Tensor  # [HV, K, V] fp32


@dataclass
class QSAState:
    k: Tensor  # [n, KVH, D] post-norm, post-RoPE keys
    v: Tensor  # [n, KVH, D]
    index_keys: Tensor  # [n, Di] raw (pre-norm, pre-RoPE) indexer keys, kept for not-yet-complete blocks
    block_keys: Tensor  # [n // c, Di] pooled, normed, RoPEd keys of complete blocks (they never change)
    block_cos: Tensor  # [n, R] cos of every token's position (the block's first token drives its key)
    block_sin: Tensor  # [n, R]

    @property
    def num_tokens(self) -> int:
        return self.k.shape[0]


@dataclass
class PLEState:
    conv: Tensor  # [dilation*(W-1), wide] last normed gated values (conv inputs)
    context: list[int]  # last ngram_size-1 raw token ids, oldest first (EOS-filled at start)


@dataclass
class SequenceState:
    """Everything carried between forwards of one sequence."""

    num_tokens: int = 0  # tokens already processed (the next token's index)
    layers: dict[str, object] = field(default_factory=dict)  # state_key -> GDNState | QSAState | PLEState
    rope_delta: int = 0  # mRoPE offset of positions after media: position = index + rope_delta

"""ForwardMeta: the per-step data every layer receives (flat varlen token stream)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from .state import SequenceState

if TYPE_CHECKING:
    from .kernels.ops import KernelOps


class PagedCache(Protocol):
    """What the paged layers read of the cache tensors (cache/storage.py's CacheStorage is one). A protocol,
    so that the model does not import cache/: the engine hands the storage in with each step."""

    layout: Any  # cache.capacity.CacheLayout: kv_cache_dtype, draft_kv_cache_dtype, block_size, ...
    qsa: Mapping[int, Any]  # layer -> K/V pages and their scales
    mtp: Any  # the MTP layer's K/V pages
    gdn: Mapping[int, Any]  # layer -> recurrent state and conv window per slot
    ple: Mapping[int, Any]  # layer -> conv history and n-gram context per slot
    pending_keys: Mapping[int | str, Tensor]  # raw index keys of each slot's incomplete compress group


@dataclass
class GDNRecord:
    """What one GDN layer's verify leaves for the commit. mixed: [T, conv_dim] pre-conv inputs;
    replay_inputs (kept only for replay): q, k [B, R, H, K], v [B, R, HV, V], g, beta [B, R, HV] fp32,
    padded to R rows per request (views of the step's tensors when every request has R rows)."""

    layer_idx: int
    mixed: Tensor
    replay_inputs: tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None
    scale: float


@dataclass
class PLERecord:
    """One PLE layer: conv_in [T, h*d] pre-conv inputs; history [B, n-1] the n-gram context before the step."""

    layer_idx: int
    conv_in: Tensor
    history: Tensor


RecordBuffers = Callable[[str, tuple[int, ...], torch.dtype], Tensor]


@dataclass
class VerifyMeta:
    """A speculative verify step: every sequence runs its definite token plus its drafts, and the
    recurrent layers leave the committed state untouched until the accepted count is known.

    B sequences padded to `num_rows` rows each (the longest; padding rows get zero inputs, which
    leave a GDN state unchanged).
    flat_index: [T] int64, the padded position (b * num_rows + j) of each token of the flat stream.
    equal_rows: every sequence has exactly num_rows rows (T = B * num_rows, flat_index the identity;
    always so in the round graphs): padding is a view, and the QSA layers take the decode kernels'
    [B, num_rows] verify form.
    draft_slots: int32 [B, num_rows] state slots that receive the GDN state after each row
    (column 0 is the running slot, then the per-draft slots; padding rows point at the dummy
    slot 0), or None for replay (`spec_state_replay`: nothing is kept, the commit recomputes).
    record: filled by the layers with what the commit needs (spec/commit.py), keyed by layer.
    buffers: where the layers put what they record (`record_buffer`): None allocates fresh tensors;
    the round graphs (spec/graphs.py) pass storage that outlives the verify graph, so the commit graph
    reads the records where the layers wrote them, with no copy.
    """

    num_seqs: int
    num_rows: int
    flat_index: Tensor
    draft_slots: Tensor | None
    record: dict[str, Any] = field(default_factory=dict)
    equal_rows: bool = False
    buffers: RecordBuffers | None = None

    def pad(self, x: Tensor) -> Tensor:
        """[T, ...] flat rows -> [B, num_rows, ...], zeros in the padding rows (a view of x with equal rows)."""
        if self.equal_rows:
            return x.unflatten(0, (self.num_seqs, self.num_rows))
        out = x.new_zeros(self.num_seqs * self.num_rows, *x.shape[1:])
        out[self.flat_index] = x
        return out.view(self.num_seqs, self.num_rows, *x.shape[1:])

    def unpad(self, x: Tensor) -> Tensor:
        """[B, num_rows, ...] -> [T, ...] flat rows (a view with equal rows, when x allows one)."""
        if self.equal_rows:
            return x.flatten(0, 1)
        return x.reshape(-1, *x.shape[2:])[self.flat_index]

    def record_buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """Uninitialised storage for a record `name` (unique per layer and field) that the commit reads
        after the forward: from `buffers` when set, else a fresh tensor."""
        if self.buffers is None:
            return torch.empty(shape, dtype=dtype, device=device)
        return self.buffers(name, tuple(shape), dtype)


@dataclass
class PagedMeta:
    """Where a step's state lives when it runs on the paged hybrid cache (cache/storage.py).

    All tensors are on the model's device. B sequences, T new tokens.
    storage: the cache tensors; ops: torch references or Triton kernels (kernels/ops.py).
    slots: [B] int32 state slot of each sequence (GDN, PLE, QSA pending keys).
    has_initial_state: [B] bool, False where a sequence starts at token 0 this step.
    cu_seqlens: [B + 1] int32; seq_lens: [B] int32 tokens in the cache after this step.
    block_table: [B, max_blocks] int32; slot_mapping: [T] int64 page slot of each new token.
    group_cos, group_sin: [B, R] fp32 rotary tables of the first token of the compress group
    each sequence's first new token falls in (its pooled index key is rotated with them).
    max_new_tokens: the largest per-sequence token count of the step (python int, no sync).
    """

    storage: PagedCache
    ops: "KernelOps"
    slots: Tensor
    has_initial_state: Tensor
    cu_seqlens: Tensor
    seq_lens: Tensor
    block_table: Tensor
    slot_mapping: Tensor
    group_cos: Tensor
    group_sin: Tensor
    max_new_tokens: int
    spec: VerifyMeta | None = None  # set on a speculative verify step

    @property
    def is_decode(self) -> bool:
        return self.max_new_tokens == 1 and self.spec is None


@dataclass
class ForwardMeta:
    """One forward over B sequences laid end to end: T = cu_seqlens[-1] tokens.

    cu_seqlens: [B + 1] python ints; sequence b owns tokens cu_seqlens[b]:cu_seqlens[b+1].
    states: B per-sequence states (the simple torch path); state.num_tokens is the index of each
    sequence's first new token. With `paged` set, state lives in the paged cache instead and
    `states` only carries token counts and rope deltas.
    input_ids: [T] long (raw ids; the n-gram hash reads them, media pads included).
    positions: [3, T] long mRoPE positions (all rows equal for text).
    cos, sin: [T, rotary_dim] fp32 rotary tables for `positions`, shared by all QSA layers.
    taps: when set, its keys are decoder layer ids and the text model stores the wide residual leaving
    each of those layers, [T, h*d], under its id (a DFlash drafter's context, spec/engine.md §2.1).
    ple_lookups: n-gram lookups the PLE layers started before the trunk ran, by state key (layers/ngram.py).
    uniform_fresh: every sequence starts at token 0 and all have the same length (a [B, S] training batch, set by
    presets/train_model.py): the simple torch path may then run the sequences as one batch instead of one by one.
    """

    cu_seqlens: list[int]
    states: list[SequenceState]
    input_ids: Tensor
    positions: Tensor
    cos: Tensor
    sin: Tensor
    paged: PagedMeta | None = None
    taps: dict[int, Tensor | None] | None = None
    ple_lookups: dict[str, Any] = field(default_factory=dict)
    uniform_fresh: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.states)

    def seq_slices(self):
        """Yield (b, start, end, state) for each sequence."""
        for b, st in enumerate(self.states):
            yield b, self.cu_seqlens[b], self.cu_seqlens[b + 1], st

"""ModelRunner: turns one scheduled step into a forward over the paged hybrid cache.

The scheduler decides which tokens of which requests run; the allocator decides where their
K/V pages and state slots are. The runner only lays the step out as flat varlen tensors
(`PagedMeta`), runs the model and returns the logits the sampler needs.

All of a step's integer metadata (token ids, positions, slots, block table, slot mapping, ...)
is packed into one host buffer and reaches the device in a single copy, so building a step
costs no device round trip. Pure decode steps can replay captured CUDA graphs instead
(`cuda_graphs.DecodeGraphs`, which the Engine owns and asks first); they read the same packed
layout from static buffers.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..cache.storage import CacheStorage
from ..forward import PagedMeta, RecordBuffers, VerifyMeta
from ..kernels.batch_invariant import row_invariant
from ..kernels.ops import kernel_ops
from ..model import FlashNextModel
from ..ple.disk import DEFAULT_CAPACITY, DiskRowFeeder, has_disk_tables
from ..state import SequenceState


@dataclass
class StepSequence:
    """One request's share of a step.

    token_ids: the new tokens this step; num_computed: tokens already in the cache before them.
    block_ids: the request's pages, in order, covering num_computed + len(token_ids) tokens.
    slot: its state slot. positions: [3, P] mRoPE positions of its first P tokens (the prompt of a
    request with media); tokens from P on, and all tokens when None, sit at index + rope_delta.
    mm_embeds: [N_mm, d] vision rows for token_ids[mm_index] (N_mm indices into this step's tokens).
    """

    token_ids: list[int]
    num_computed: int
    block_ids: list[int]
    slot: int
    rope_delta: int = 0
    positions: Tensor | None = None
    mm_embeds: Tensor | None = None  # [N_mm, d] for the media pads among token_ids
    mm_index: list[int] | None = None  # [N_mm] which of token_ids they replace


# Sections of the packed int64 step buffer, in order, with their length for B sequences, T new
# tokens and a block table W wide.
_SECTIONS = ("input_ids", "positions", "group_pos", "slots", "has_initial_state", "cu_seqlens", "seq_lens",
             "block_table", "slot_mapping")


PACK_LIST_MAX_TOKENS = 512  # steps of up to this many new tokens are packed as one Python list (pack_buffer)


def offsets(lens: list[int]) -> list[int]:
    """[B + 1] cumulative offsets (cu_seqlens) of B lengths."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def section_sizes(B: int, T: int, W: int) -> list[int]:
    """Lengths of the packed step buffer's sections (_SECTIONS order) for B sequences, T tokens, a W-wide table."""
    return [T, 3 * T, 3 * B, B, B, B + 1, B, B * W, T]


def pack_buffer(seqs: list[StepSequence], block_size: int, ratio: int, num_rows: int | None = None,
                width: int | None = None) -> Tensor:
    """The packed host int64 buffer of a step (sections: `_SECTIONS`; `StepInputs.unpack` reads it).

    num_rows / width pad the batch to a captured graph's size and block-table width: padded rows are one-token
    sequences on the dummy slot 0 and the null block 0, which no request owns. `ratio`: the QSA compress group, whose
    first token's position `group_pos` holds. The buffer is assembled in an int64 array (the block table, as wide as a
    graph's max_model_len allows, by one slice copy a request); a step of at most PACK_LIST_MAX_TOKENS new tokens
    (decode, verification) builds its per-token sections as Python lists (`_token_lists`: a few small tensor ops per
    request cost more host time than the lists), a longer one with tensor ops over all its tokens (`_token_tensors`);
    both give the same buffer (tests/engine/test_pack_step.py).
    """
    lens = [len(s.token_ids) for s in seqs]
    if not seqs or min(lens) < 1:
        raise ValueError(f"every scheduled sequence needs at least one new token, got lengths {lens}")
    W = max(len(s.block_ids) for s in seqs) if width is None else width
    for s, n in zip(seqs, lens):
        end = s.num_computed + n
        need = -(-end // block_size)
        if len(s.block_ids) < need or len(s.block_ids) > W:
            raise ValueError(f"a sequence with {end} tokens needs {need} blocks of {block_size} (table width {W}), "
                             f"got {len(s.block_ids)}")
    pad = 0 if num_rows is None else num_rows - len(seqs)
    table = array("q", bytes(8 * (len(seqs) + pad) * W))  # [(B + pad) * W] zeros: the null block
    for i, s in enumerate(seqs):
        table[i * W:i * W + len(s.block_ids)] = array("q", s.block_ids)
    small = ([s.slot for s in seqs] + [0] * pad + [int(s.num_computed > 0) for s in seqs] + [0] * pad
             + offsets(lens + [1] * pad) + [s.num_computed + n for s, n in zip(seqs, lens)]
             + [1] * pad)  # slots, has_initial_state, cu_seqlens, seq_lens
    groups = [_group_first(s, ratio) for s in seqs]
    group_rows = [g[r] for r in range(3) for g in groups + [[0, 0, 0]] * pad]  # [3, B + pad] row-major
    if sum(lens) > PACK_LIST_MAX_TOKENS:
        table_t = torch.frombuffer(table, dtype=torch.int64)
        ids, positions, slot_mapping = _token_tensors(seqs, lens, block_size, pad, table_t.view(-1, W))
        return torch.cat([ids, positions, int64_tensor(group_rows + small), table_t, slot_mapping])
    ids, positions, slot_mapping = _token_lists(seqs, block_size, pad)
    buf = array("q", ids + positions + group_rows + small)
    buf += table
    buf.extend(slot_mapping)
    return torch.frombuffer(buf, dtype=torch.int64)


def int64_tensor(values: list[int]) -> Tensor:
    """torch.tensor(values) for a list of Python ints, through an int64 array: ~7x faster than torch.tensor reading
    each int (a 600-int step buffer: 13 against 93 us here)."""
    return torch.frombuffer(array("q", values), dtype=torch.int64) if values else torch.zeros(0, dtype=torch.long)


def _group_first(s: StepSequence, ratio: int) -> list[int]:
    """[3] position of the first token of the compress group holding the sequence's start."""
    first = (s.num_computed // ratio) * ratio
    if s.positions is not None and first < s.positions.shape[1]:
        return s.positions[:, first].tolist()
    return [first + s.rope_delta] * 3


def _token_lists(seqs: list[StepSequence], block_size: int, pad: int) -> tuple[list[int], list[int], list[int]]:
    """The per-token sections as Python lists, token by token: ids [T + pad], positions [3 * (T + pad)] row-major (a
    media prompt's first P given, then index + rope_delta), slot mapping [T + pad]; padded rows 0."""
    bs = block_size
    ids, rows, slot_mapping = [], ([], [], []), []
    for s in seqs:
        start, end = s.num_computed, s.num_computed + len(s.token_ids)
        known = 0 if s.positions is None else s.positions.shape[1]
        given = s.positions[:, start:min(end, known)].tolist() if start < known else ([], [], [])
        after = range(max(start, known) + s.rope_delta, max(end, known) + s.rope_delta)
        ids += s.token_ids
        for r in range(3):
            rows[r].extend(given[r] + list(after))
        slot_mapping += [s.block_ids[i // bs] * bs + i % bs for i in range(start, end)]
    zeros = [0] * pad
    return ids + zeros, rows[0] + zeros + rows[1] + zeros + rows[2] + zeros, slot_mapping + zeros


def _token_tensors(seqs: list[StepSequence], lens: list[int], block_size: int, pad: int,
                   table: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`_token_lists` for a long step, with tensor ops over all its tokens; table [B + pad, W]."""
    cu = offsets(lens)
    rep = torch.tensor(lens)
    to_index = torch.tensor([s.num_computed - c for s, c in zip(seqs, cu)])  # row of the step -> token index
    index = torch.arange(cu[-1]) + to_index.repeat_interleave(rep)  # [T]
    slot_mapping = table[torch.arange(len(seqs)).repeat_interleave(rep), index // block_size]
    slot_mapping = slot_mapping * block_size + index % block_size  # [T]
    positions = (index + torch.tensor([s.rope_delta for s in seqs]).repeat_interleave(rep)).expand(3, -1).clone()
    for s, c, n in zip(seqs, cu, lens):  # a media prompt's first P positions are given
        known, start = (0 if s.positions is None else s.positions.shape[1]), s.num_computed
        if start < known:
            m = min(start + n, known) - start
            positions[:, c:c + m] = s.positions[:, start:start + m].cpu()
    zeros, zeros3 = torch.zeros(pad, dtype=torch.long), torch.zeros(3, pad, dtype=torch.long)
    return (int64_tensor([t for s in seqs for t in s.token_ids] + [0] * pad),
            torch.cat([positions, zeros3], dim=1).reshape(-1), torch.cat([slot_mapping, zeros]))


@dataclass
class StepInputs:
    """The device tensors of one step, views into one packed buffer (see `pack_step`)."""

    input_ids: Tensor  # [T] long
    positions: Tensor  # [3, T] long
    group_pos: Tensor  # [3, B] long: position of the first token of each start's compress group
    slots: Tensor  # [B] int32
    has_initial_state: Tensor  # [B] bool
    cu_seqlens: Tensor  # [B + 1] int32
    seq_lens: Tensor  # [B] int32
    block_table: Tensor  # [B, W] int32
    slot_mapping: Tensor  # [T] int64

    @classmethod
    def unpack(cls, flat: Tensor, B: int, T: int, W: int) -> "StepInputs":
        """Views (with dtype conversions on the device) of `flat` [sum of sections] int64."""
        p = dict(zip(_SECTIONS, flat[: sum(section_sizes(B, T, W))].split(section_sizes(B, T, W))))
        return cls(input_ids=p["input_ids"], positions=p["positions"].view(3, T), group_pos=p["group_pos"].view(3, B),
                   slots=p["slots"].to(torch.int32), has_initial_state=p["has_initial_state"].bool(),
                   cu_seqlens=p["cu_seqlens"].to(torch.int32), seq_lens=p["seq_lens"].to(torch.int32),
                   block_table=p["block_table"].view(B, W).to(torch.int32), slot_mapping=p["slot_mapping"])


@dataclass(frozen=True)
class HiddenTaps:
    """What the hidden rows of a step are when a drafter needs more than the final wide state.

    layer_ids: decoder layers whose leaving residual [T, h*d] is kept during the forward;
    features: {layer id: residual} -> the rows [T, F] `execute(return_hidden=True)` and `verify` return
    instead of the final wide state (e.g. a DFlash drafter's context features, spec/dflash2/taps.py).
    """

    layer_ids: tuple[int, ...]
    features: Callable[[dict[int, Tensor]], Tensor]


class ModelRunner:
    """Runs `model` on `storage` with the torch references or the Triton kernels.

    hidden_taps: None (default) returns the final wide state [T, h*d] as the hidden rows (the MTP input);
    a HiddenTaps returns its features of the tapped layers instead.
    """

    def __init__(self, model: FlashNextModel, storage: CacheStorage, kernels: str = "torch",
                 row_invariant: bool | None = None, hidden_taps: HiddenTaps | None = None,
                 max_num_tokens: int | None = None):
        self.model, self.storage = model, storage
        # one GEMM per layer's input projections (GDN, QSA, the MoE router), on the weights as they will run
        # (however the model was built, loaded, cast or moved); before any CUDA graph captures their addresses
        model.merge_projections()
        model.prepare_logits()  # a vocab-masked head's allowed rows, gathered before graphs capture them
        # a disk-placed PLE table: the worker gathers each step's rows before it runs (ple/disk.py);
        # max_num_tokens bounds one forward (the engine's token budget plus verify rows)
        self.ple_feeder = DiskRowFeeder(model, storage, max_num_tokens or DEFAULT_CAPACITY) \
            if has_disk_tables(model) else None
        self.hidden_taps = hidden_taps
        self.ops = kernel_ops(kernels)
        self.block_size = storage.layout.block_size
        self.ratio = model.cfg.text.indexer_compress_ratio
        self.num_mtp_layers = max(1, model.cfg.text.num_mtp_layers)
        # decode and verify rows computed one at a time (kernels/batch_invariant.py); default on for the
        # torch path, whose greedy output and state must not depend on the batch or on speculation
        self.row_invariant = kernels == "torch" if row_invariant is None else row_invariant

    def stage_ple(self, inputs: StepInputs) -> None:
        """Before every forward or graph replay that reads PLE rows (not inside a capture): with a
        disk-placed table, have the worker gather the step's rows into the device buffers."""
        if self.ple_feeder is not None:
            self.ple_feeder.stage(inputs.input_ids, inputs.cu_seqlens, inputs.slots, inputs.has_initial_state)

    def check_health(self) -> None:
        """Raise a FatalEngineError when a process the forward needs (the PLE worker) has died."""
        if self.ple_feeder is not None:
            self.ple_feeder.check_health()

    def pack_step(self, seqs: list[StepSequence], num_rows: int | None = None, width: int | None = None) -> Tensor:
        """The packed host int64 buffer of a step (`pack_buffer`), pinned on CUDA."""
        flat = pack_buffer(seqs, self.block_size, self.ratio, num_rows, width)
        return flat.pin_memory() if self.model.device.type == "cuda" else flat

    def forward_packed(self, inputs: StepInputs, cu_seqlens: list[int], logits_indices: Tensor | None = None,
                       mm_embeds: Tensor | None = None, return_hidden: bool = False,
                       mm_index: Tensor | None = None):
        """The model on one step's device inputs (the graph path captures this).

        cu_seqlens: the same [B + 1] offsets as host ints; the paged layers read only the device
        copy, so nothing here waits on the device. mm_embeds [N_mm, d] replace the rows mm_index [N_mm].
        """
        B = inputs.slots.shape[0]
        paged = self.paged_meta(inputs, cu_seqlens)
        states = [SequenceState() for _ in range(B)]  # token counts live in the cache, not here
        taps = self._new_taps() if return_hidden else None
        out = self.model(inputs.input_ids, inputs.positions, cu_seqlens=cu_seqlens, states=states,
                         mm_embeds=mm_embeds, mm_index=mm_index,
                         logits_indices=logits_indices, return_hidden=return_hidden, paged=paged, taps=taps)
        return self._tapped(out, taps)

    def _new_taps(self) -> dict[int, Tensor | None] | None:
        return None if self.hidden_taps is None else dict.fromkeys(self.hidden_taps.layer_ids)

    def _tapped(self, out, taps: dict[int, Tensor | None] | None):
        """(logits, wide) -> (logits, the HiddenTaps features) when taps were kept."""
        return out if taps is None else (out[0], self.hidden_taps.features(taps))

    def paged_meta(self, inputs: StepInputs, cu_seqlens: list[int]) -> PagedMeta:
        """The PagedMeta of one step's device inputs (cu_seqlens: the host copy)."""
        group_cos, group_sin = self.model.model.language_model.rotary(inputs.group_pos)
        return PagedMeta(storage=self.storage, ops=self.ops, slots=inputs.slots,
                         has_initial_state=inputs.has_initial_state, cu_seqlens=inputs.cu_seqlens,
                         seq_lens=inputs.seq_lens, block_table=inputs.block_table,
                         slot_mapping=inputs.slot_mapping, group_cos=group_cos, group_sin=group_sin,
                         max_new_tokens=max(b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])))

    def _inputs(self, seqs: list[StepSequence]) -> StepInputs:
        """One packed host -> device copy of the step's metadata."""
        flat = self.pack_step(seqs)
        B, T, W = len(seqs), sum(len(s.token_ids) for s in seqs), max(len(s.block_ids) for s in seqs)
        return StepInputs.unpack(flat.to(self.model.device, non_blocking=True), B, T, W)

    @torch.no_grad()
    def execute(self, seqs: list[StepSequence], all_logits: bool = False, return_hidden: bool = False,
                logits_rows: list[int] | None = None, input_ids: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Forward the step; logits [B, V] of each sequence's last new token ([T, V] with all_logits,
        [len(logits_rows), V] for those rows of the flat token stream). input_ids: [T] int64 on the device, the
        step's tokens in place of the sequences' token_ids (async scheduling: the previous step's samples)."""
        lens = [len(s.token_ids) for s in seqs]
        decode = bool(seqs) and max(lens) == 1
        flat = self.pack_step(seqs)
        B, T, W = len(seqs), sum(lens), max(len(s.block_ids) for s in seqs)
        device = self.model.device
        inputs = StepInputs.unpack(flat.to(device, non_blocking=True), B, T, W)
        if input_ids is not None:
            if input_ids.shape != (T,):
                raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}; the step has {T} tokens")
            inputs.input_ids.copy_(input_ids)
        self.stage_ple(inputs)
        if logits_rows is not None:
            rows = torch.tensor(logits_rows).to(device, non_blocking=True)
        else:
            rows = None if all_logits or decode else (inputs.cu_seqlens[1:] - 1).long()
        mm_embeds, mm_index = self._media_rows(seqs, offsets(lens))
        with row_invariant(self.row_invariant and decode):
            return self.forward_packed(inputs, offsets(lens), logits_indices=rows, mm_embeds=mm_embeds,
                                       return_hidden=return_hidden, mm_index=mm_index)

    def _media_rows(self, seqs: list[StepSequence], cu: list[int]) -> tuple[Tensor | None, Tensor | None]:
        """Vision rows of the step [N_mm, d] and their flat token indices [N_mm] (None: no media this step).

        Rows go to explicit indices, not to every pad id, so a literal `<|image_pad|>` in a text request
        batched with a media request stays an ordinary token."""
        with_mm = [(b, s) for b, s in enumerate(seqs) if s.mm_embeds is not None]
        if not with_mm:
            return None, None
        index = [cu[b] + i for b, s in with_mm for i in s.mm_index]
        return (torch.cat([s.mm_embeds for _, s in with_mm]),
                torch.tensor(index, dtype=torch.long).to(self.model.device, non_blocking=True))

    # ---- speculative decoding (spec/) -----------------------------------------------------------
    @torch.no_grad()
    def verify(self, seqs: list[StepSequence], draft_slots: list[list[int]] | None
               ) -> tuple[Tensor, Tensor, PagedMeta]:
        """Verify forward, eager (steady-state rounds replay `spec.graphs.SpecGraphs` instead): each
        sequence's definite token and drafts, every row computed like a decode row.

        draft_slots: per sequence the slots receiving the GDN state after each row (running slot
        first), or None for replay. Returns (logits [T, V] of every row, wide hidden [T, h*d],
        the step's PagedMeta whose `spec.record` feeds spec.commit.commit_verified); with `hidden_taps`
        the hidden rows are its features instead of the wide state.
        """
        inputs = self._inputs(seqs)
        self.stage_ple(inputs)
        cu = offsets([len(s.token_ids) for s in seqs])
        device = inputs.slots.device
        R = max(b - a for a, b in zip(cu, cu[1:]))
        flat = [b * R + j for b, s in enumerate(seqs) for j in range(len(s.token_ids))]
        table = None
        if draft_slots is not None:
            table = torch.tensor([d + [0] * (R - len(d)) for d in draft_slots], dtype=torch.int32).to(device)
        return self.verify_packed(inputs, cu, table, torch.tensor(flat, dtype=torch.long).to(device))

    def verify_packed(self, inputs: StepInputs, cu_seqlens: list[int], draft_table: Tensor | None,
                      flat_index: Tensor, record_buffers: RecordBuffers | None = None
                      ) -> tuple[Tensor, Tensor, PagedMeta]:
        """The verify forward on one step's device inputs (the speculative graphs capture this).

        draft_table: int32 [B, R] per-draft state slots (None: replay); flat_index: [T] int64 padded
        position b * R + j of every flat row (R = the longest sequence); record_buffers: storage for
        the layers' records (forward.VerifyMeta.buffers; None: fresh tensors). Returns as `verify`.
        """
        paged = self.paged_meta(inputs, cu_seqlens)
        R = paged.max_new_tokens
        paged.spec = VerifyMeta(num_seqs=inputs.slots.shape[0], num_rows=R, draft_slots=draft_table,
                                flat_index=flat_index, buffers=record_buffers,
                                equal_rows=all(b - a == R for a, b in zip(cu_seqlens, cu_seqlens[1:])))
        states = [SequenceState() for _ in range(inputs.slots.shape[0])]
        taps = self._new_taps()
        with row_invariant(self.row_invariant):
            out = self.model(inputs.input_ids, inputs.positions, cu_seqlens=cu_seqlens, states=states,
                             return_hidden=True, paged=paged, taps=taps)
        logits, hidden = self._tapped(out, taps)
        return logits, hidden, paged

    @torch.no_grad()
    def mtp(self, seqs: list[StepSequence], hidden: Tensor, step: int = 0,
            logits_rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """One MTP forward on the paged cache (the MTP layer's own K/V pages).

        seqs: per sequence token_ids = the token after each hidden row, num_computed = the
        position of its first hidden row; hidden: [T, h*d]. Returns (logits of `logits_rows`
        (default every row) [N, V] fp32, wide output M [T, h*d]). A sequence's mm_embeds / mm_index
        are the vision rows of the media pads among its tokens (the target's rows for those tokens).
        """
        inputs = self._inputs(seqs)
        cu = offsets([len(s.token_ids) for s in seqs])
        mm_embeds, mm_index = self._media_rows(seqs, cu)
        return self.mtp_packed(inputs, cu, hidden, step, logits_rows, mm_embeds, mm_index)

    def mtp_packed(self, inputs: StepInputs, cu_seqlens: list[int], hidden: Tensor, step: int = 0,
                   logits_rows: Tensor | None = None, mm_embeds: Tensor | None = None,
                   mm_index: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """`mtp` on one step's device inputs (the speculative graphs capture the draft steps, without media)."""
        states = [SequenceState() for _ in range(inputs.slots.shape[0])]
        return self.model.mtp_forward(hidden, inputs.input_ids, inputs.positions, cu_seqlens, states,
                                      step=step % self.num_mtp_layers, paged=self.paged_meta(inputs, cu_seqlens),
                                      logits_indices=logits_rows, mm_embeds=mm_embeds, mm_index=mm_index)

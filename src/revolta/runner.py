"""ModelRunner: turns one scheduled step into a forward over the paged hybrid cache.

The scheduler decides which tokens of which requests run; the allocator decides where their
K/V pages and state slots are. The runner only lays the step out as flat varlen tensors
(`PagedMeta`), runs the model and returns the logits the sampler needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .cache.storage import CacheStorage
from .forward import PagedMeta, VerifyMeta
from .kernels.batch_invariant import row_invariant
from .kernels.ops import kernel_ops
from .model import FlashNextModel
from .state import SequenceState


@dataclass
class StepSequence:
    """One request's share of a step.

    token_ids: the new tokens this step; num_computed: tokens already in the cache before them.
    block_ids: the request's pages, in order, covering num_computed + len(token_ids) tokens.
    slot: its state slot. positions: [3, >= num_computed + n] mRoPE positions of all its tokens
    so far (None: text, position = index + rope_delta).
    """

    token_ids: list[int]
    num_computed: int
    block_ids: list[int]
    slot: int
    rope_delta: int = 0
    positions: Tensor | None = None
    mm_embeds: Tensor | None = None  # [N_mm, d] for the media pads among token_ids


class ModelRunner:
    """Runs `model` on `storage` with the torch references or the Triton kernels."""

    def __init__(self, model: FlashNextModel, storage: CacheStorage, kernels: str = "torch",
                 batch_invariant: bool | None = None):
        self.model, self.storage = model, storage
        self.ops = kernel_ops(kernels)
        # decode and verify rows computed one at a time (kernels/batch_invariant.py); default on for the
        # torch path, whose greedy output and state must not depend on the batch or on speculation
        self.row_invariant = kernels == "torch" if batch_invariant is None else batch_invariant
        self.block_size = storage.layout.block_size
        self.ratio = model.cfg.text.indexer_compress_ratio
        self.num_mtp_layers = max(1, model.cfg.text.num_mtp_layers)

    def _positions(self, seq: StepSequence, start: int, end: int) -> Tensor:
        if seq.positions is not None:
            return seq.positions[:, start:end]
        return torch.arange(start, end).unsqueeze(0).expand(3, -1) + seq.rope_delta

    def _layout(self, seqs: list[StepSequence]) -> tuple[Tensor, Tensor, list[int], list[SequenceState], PagedMeta]:
        """The step as flat varlen tensors: (input_ids [T], positions [3, T], cu_seqlens, states, paged meta)."""
        device = self.model.device
        lens = [len(s.token_ids) for s in seqs]
        if not seqs or min(lens) < 1:
            raise ValueError(f"every scheduled sequence needs at least one new token, got lengths {lens}")
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        bs = self.block_size
        slot_mapping, positions, group_pos = [], [], []
        for s in seqs:
            end = s.num_computed + len(s.token_ids)
            need = -(-end // bs)
            if len(s.block_ids) < need:
                raise ValueError(f"a sequence with {end} tokens needs {need} blocks of {bs}, got {len(s.block_ids)}")
            slot_mapping += [s.block_ids[i // bs] * bs + i % bs for i in range(s.num_computed, end)]
            positions.append(self._positions(s, s.num_computed, end))
            first = (s.num_computed // self.ratio) * self.ratio  # first token of the group holding the start
            group_pos.append(self._positions(s, first, first + 1))
        max_blocks = max(len(s.block_ids) for s in seqs)
        block_table = torch.tensor([s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s in seqs],
                                   dtype=torch.int32)
        group_cos, group_sin = self.model.model.language_model.rotary(torch.cat(group_pos, dim=1).to(device))
        paged = PagedMeta(
            storage=self.storage, ops=self.ops,
            slots=torch.tensor([s.slot for s in seqs], dtype=torch.int32, device=device),
            has_initial_state=torch.tensor([s.num_computed > 0 for s in seqs], device=device),
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
            seq_lens=torch.tensor([s.num_computed + n for s, n in zip(seqs, lens)], dtype=torch.int32,
                                  device=device),
            block_table=block_table.to(device),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            group_cos=group_cos, group_sin=group_sin, max_new_tokens=max(lens))
        input_ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.long, device=device)
        states = [SequenceState(num_tokens=s.num_computed, rope_delta=s.rope_delta) for s in seqs]
        return input_ids, torch.cat(positions, dim=1).to(device), cu, states, paged

    @torch.no_grad()
    def execute(self, seqs: list[StepSequence], all_logits: bool = False,
                return_hidden: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Forward the step; logits [B, V] of each sequence's last new token ([T, V] with all_logits)."""
        input_ids, positions, cu, states, paged = self._layout(seqs)
        mm = [s.mm_embeds for s in seqs if s.mm_embeds is not None]
        rows = None if all_logits else torch.tensor(cu[1:], device=input_ids.device) - 1
        with row_invariant(self.row_invariant and paged.is_decode):
            return self.model(input_ids, positions, cu_seqlens=cu, states=states,
                              mm_embeds=torch.cat(mm) if mm else None, logits_indices=rows,
                              return_hidden=return_hidden, paged=paged)

    # ---- speculative decoding (spec/) -----------------------------------------------------------
    @torch.no_grad()
    def verify(self, seqs: list[StepSequence], draft_slots: list[list[int]] | None
               ) -> tuple[Tensor, Tensor, PagedMeta]:
        """Verify forward: each sequence's definite token and drafts, every row like a decode row.

        draft_slots: per sequence the slots receiving the GDN state after each row (running slot
        first), or None for replay. Returns (logits [T, V] of every row, wide hidden [T, h*d],
        the step's PagedMeta whose `spec.record` feeds spec.commit.commit_verified).
        """
        input_ids, positions, cu, states, paged = self._layout(seqs)
        device = input_ids.device
        R = paged.max_new_tokens
        flat = [b * R + j for b, s in enumerate(seqs) for j in range(len(s.token_ids))]
        table = None
        if draft_slots is not None:
            table = torch.tensor([d + [0] * (R - len(d)) for d in draft_slots], dtype=torch.int32, device=device)
        paged.spec = VerifyMeta(num_seqs=len(seqs), num_rows=R, draft_slots=table,
                                flat_index=torch.tensor(flat, dtype=torch.long, device=device))
        with row_invariant(self.row_invariant):
            logits, wide = self.model(input_ids, positions, cu_seqlens=cu, states=states, return_hidden=True,
                                      paged=paged)
        return logits, wide, paged

    @torch.no_grad()
    def mtp(self, seqs: list[StepSequence], hidden: Tensor, step: int = 0,
            logits_rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """One MTP forward on the paged cache (the MTP layer's own K/V pages).

        seqs: per sequence token_ids = the token after each hidden row, num_computed = the
        position of its first hidden row; hidden: [T, h*d]. Returns (logits of `logits_rows`
        (default every row) [N, V] fp32, wide output M [T, h*d]).
        """
        input_ids, positions, cu, states, paged = self._layout(seqs)
        return self.model.mtp_forward(hidden, input_ids, positions, cu, states, step=step % self.num_mtp_layers,
                                      paged=paged, logits_indices=logits_rows)

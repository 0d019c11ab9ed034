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
from .forward import PagedMeta
from .kernels.ops import kernel_ops
from .model import FlashNextModel
from .state import SequenceState


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


class ModelRunner:
    """Runs `model` on `storage` with the torch references or the Triton kernels."""

    def __init__(self, model: FlashNextModel, storage: CacheStorage, kernels: str = "torch"):
        self.model, self.storage = model, storage
        self.ops = kernel_ops(kernels)
        self.block_size = storage.layout.block_size
        self.ratio = model.cfg.text.indexer_compress_ratio

    def _positions(self, seq: StepSequence, start: int, end: int) -> Tensor:
        known = 0 if seq.positions is None else seq.positions.shape[1]
        after = torch.arange(max(start, known), max(end, known)).unsqueeze(0).expand(3, -1) + seq.rope_delta
        if start >= known:
            return after
        return torch.cat([seq.positions[:, start:min(end, known)], after], dim=1)  # a chunk across the prompt end

    @torch.no_grad()
    def execute(self, seqs: list[StepSequence], all_logits: bool = False,
                return_hidden: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Forward the step; logits [B, V] of each sequence's last new token ([T, V] with all_logits)."""
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
        mm_embeds, mm_index = self._media_rows(seqs, cu)
        states = [SequenceState(num_tokens=s.num_computed, rope_delta=s.rope_delta) for s in seqs]
        rows = None if all_logits else torch.tensor(cu[1:], device=device) - 1
        return self.model(input_ids, torch.cat(positions, dim=1).to(device), cu_seqlens=cu, states=states,
                          mm_embeds=mm_embeds, mm_index=mm_index, logits_indices=rows,
                          return_hidden=return_hidden, paged=paged)

    def _media_rows(self, seqs: list[StepSequence], cu: list[int]) -> tuple[Tensor | None, Tensor | None]:
        """Vision rows of the step [N_mm, d] and their flat token indices [N_mm] (None: no media this step).

        Rows go to explicit indices, not to every pad id, so a literal `<|image_pad|>` in a text request
        batched with a media request stays an ordinary token."""
        with_mm = [(b, s) for b, s in enumerate(seqs) if s.mm_embeds is not None]
        if not with_mm:
            return None, None
        index = [cu[b] + i for b, s in with_mm for i in s.mm_index]
        return (torch.cat([s.mm_embeds for _, s in with_mm]),
                torch.tensor(index, dtype=torch.long, device=self.model.device))

"""The MTP drafter (spec/model.md §7.3, spec/engine.md §2.8): k recursive steps of the
checkpoint's MTP layer from the target's last hidden state, with the MTP layer's own K/V.

Pairing: the MTP row at position p takes the target's wide pre-mixer state at p and the token
at p + 1. Every target row of a committed position becomes such a row once the next token is
known, so the MTP K/V always covers what the target has computed:

- after a forward, the request's committed target rows (a prefill chunk, or the definite token
  and the accepted drafts of a verify) are kept as *pending rows*;
- at the request's next step, one varlen MTP forward runs the pending rows (the token after the
  last one is the step's first token, now known) and writes their MTP K/V; for a request about
  to verify, its last row's logits give draft d_1 (a guess for the token after the definite one);
- draft j >= 2: one MTP step at the next position from the previous step's wide output M and
  d_{j-1}. These rows' K/V are overwritten when the positions are seeded from target rows.

While the adaptive policy has drafting paused (engine/spec_policy.py), a plain decode step's item comes
with `defer_seed`: its pending rows are not run through MTP at once but grow by the step's row (up to
MAX_DEFERRED_ROWS), so the paused steps pay one MTP forward per MAX_DEFERRED_ROWS steps instead of one
each; the next round (or a full buffer) seeds them together.

Media: where the token after a pending row is an image / video pad, the MTP row embeds the vision row the
target embedded there (vLLM feeds its drafter the target's input embeddings). A prefill chunk's rows keep the
vision rows of their own chunk's pads past its first token; the pad opening the next step is the token after
the last row, and its row comes with that step. The rows go when the pending rows are seeded.

Drafts are the argmax ("greedy" draft_sample_method: q is one-hot in rejection sampling). A
request that was preempted (its pages are gone) or hit the prefix cache restarts without pending
rows; the MTP K/V it finds in hit pages came from the request that computed them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..engine.runner import ModelRunner, StepSequence

if TYPE_CHECKING:
    from .graphs import SpecGraphs

MAX_DEFERRED_ROWS = 16  # pending rows a paused request keeps before they are seeded anyway


@dataclass
class PendingRows:
    """Target wide states [m, h*d] at positions start .. start + m - 1, not yet run through MTP, and the
    vision rows [N_mm, d] of the media pads among the tokens after them (mm_index [N_mm]: row r's token,
    at position start + r + 1)."""

    hidden: Tensor
    start: int
    num_preemptions: int
    mm_embeds: Tensor | None = None
    mm_index: list[int] | None = None

    @property
    def end(self) -> int:
        return self.start + self.hidden.shape[0]

    def with_media(self, mm_embeds: Tensor | None, mm_index: list[int] | None, first: int) -> "PendingRows":
        """These rows plus the vision rows [N, d] of a step's tokens mm_index [N] (token i at position first + i)
        that are tokens after these rows; the others are not kept."""
        if mm_embeds is None:
            return self
        pairs = [(j, first + i - self.start - 1) for j, i in enumerate(mm_index)]
        pairs = [(j, r) for j, r in pairs if 0 <= r < self.hidden.shape[0]]
        if not pairs:
            return self
        if len(pairs) < len(mm_index) or mm_embeds.untyped_storage().nbytes() > mm_embeds.nbytes:
            # a copy of the rows kept: a view would hold the step's other vision rows (at tp > 1, every request's)
            mm_embeds = mm_embeds[torch.tensor([j for j, _ in pairs], device=mm_embeds.device)]
        rows, index = [mm_embeds], [r for _, r in pairs]
        if self.mm_embeds is not None:
            rows, index = [self.mm_embeds, mm_embeds], self.mm_index + index
        return replace(self, mm_embeds=torch.cat(rows) if len(rows) > 1 else mm_embeds, mm_index=index)


@dataclass
class DraftItem:
    """One scheduled request: where its step runs (`step`: block table, slot, positions; its
    num_computed is the position of the step's first token), all its known token ids, its
    preemption count and how many drafts to propose (0 for prefill chunks)."""

    request_id: str
    step: StepSequence
    all_token_ids: Sequence[int]
    num_preemptions: int
    num_drafts: int
    defer_seed: bool = False  # a plain decode step while drafting is paused: its pending rows may wait


class PendingRowsDrafter:
    """The engine-facing bookkeeping every drafter shares: each request's pending target rows."""

    rows_name = "target"  # what the rows are, for messages
    keeps_media = False  # whether pending rows keep the vision rows of the tokens after them (MTP embeds them)

    def __init__(self):
        self.pending: dict[str, PendingRows] = {}
        self.deferred: set[str] = set()  # requests whose pending rows this step left unseeded (`keep` extends them)

    def has_pending(self, request_id: str, num_computed: int, num_preemptions: int) -> bool:
        """Whether the request can draft: its pending rows end where its computed tokens end."""
        p = self.pending.get(request_id)
        return p is not None and p.end == num_computed and p.num_preemptions == num_preemptions

    def keep(self, request_id: str, hidden: Tensor, start: int, num_preemptions: int,
             mm_embeds: Tensor | None = None, mm_index: list[int] | None = None) -> None:
        """Rows [m, ...] of committed target positions start .. start + m - 1 (after the request's deferred
        pending rows, when this step left them unseeded); mm_embeds [N_mm, d]: the step's vision rows, of its
        tokens mm_index [N_mm] (token i at position start + i)."""
        p = self.pending.get(request_id)
        rows = PendingRows(hidden, start, num_preemptions)
        if request_id in self.deferred and p is not None and p.end == start and p.num_preemptions == num_preemptions:
            rows = replace(p, hidden=torch.cat([p.hidden, hidden]))
        self.deferred.discard(request_id)
        if self.keeps_media:
            rows = rows.with_media(mm_embeds, mm_index, start)
        self.pending[request_id] = rows

    def drop(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
        self.deferred.discard(request_id)

    def defer(self, item: DraftItem) -> bool:
        """Leave a `defer_seed` item's pending rows unseeded this step (its step's row joins them in `keep`)."""
        p = self.pending.get(item.request_id)
        if not (item.defer_seed and self.has_pending(item.request_id, item.step.num_computed, item.num_preemptions)
                and p.hidden.shape[0] + len(item.step.token_ids) <= MAX_DEFERRED_ROWS):
            return False
        self.deferred.add(item.request_id)
        return True

    def take(self, item: DraftItem) -> PendingRows | None:
        """Pop the item's pending rows; None (the request dropped) when they do not end at its step.

        Raises when such an item was scheduled with drafts."""
        if not self.has_pending(item.request_id, item.step.num_computed, item.num_preemptions):
            self.drop(item.request_id)
            if item.num_drafts:
                raise ValueError(f"request {item.request_id!r} was scheduled with {item.num_drafts} drafts but has "
                                 f"no pending {self.rows_name} rows")
            return None
        return self.pending.pop(item.request_id)


class MTPDrafter(PendingRowsDrafter):
    """Keeps each request's pending target rows and proposes drafts with the MTP head."""

    rows_name = "MTP"
    keeps_media = True

    def __init__(self, runner: ModelRunner, num_speculative_tokens: int):
        super().__init__()
        self.runner = runner
        self.k = num_speculative_tokens

    @torch.no_grad()
    def propose(self, items: list[DraftItem], graphs: "SpecGraphs | None" = None) -> list[list[int]] | Tensor:
        """Seed the MTP K/V with every item's pending rows and draft `num_drafts` tokens for each.

        Returns one list of draft token ids per item (empty where num_drafts is 0). With `graphs`
        (the engine passes them only for a round they can verify: every item drafts) and pending rows
        that fit the seed graph (at most 1 + k per item: not the first round after a prefill), the
        seed and the draft steps replay a CUDA graph and the drafts stay on the device: [n, k] int64.
        """
        drafts: list[list[int]] = [[] for _ in items]
        seed_seqs, seed_hidden, seed_items = [], [], []
        for i, it in enumerate(items):
            c = it.step.num_computed
            if self.defer(it):
                continue
            p = self.take(it)
            if p is None:
                continue
            p = p.with_media(it.step.mm_embeds, it.step.mm_index, c)  # a pad opening this step follows the last row
            seed_seqs.append(replace(it.step, token_ids=it.all_token_ids[p.start + 1:c + 1], num_computed=p.start,
                                     mm_embeds=p.mm_embeds, mm_index=p.mm_index))
            seed_hidden.append(p.hidden)
            seed_items.append(i)
        if not seed_seqs:
            return drafts
        if graphs is not None and len(seed_items) == len(items) and graphs.can_seed(seed_seqs):
            return graphs.draft(seed_seqs, seed_hidden, [it.step for it in items])
        lens = [len(s.token_ids) for s in seed_seqs]
        last = torch.tensor(lens).cumsum(0) - 1  # the last row of each seeded sequence
        want = [j for j, i in enumerate(seed_items) if items[i].num_drafts]
        if not want:
            self.runner.mtp(seed_seqs, torch.cat(seed_hidden), logits_rows=last[:0])
            return drafts
        rows = last[want].to(self.runner.model.device)
        logits, m = self.runner.mtp(seed_seqs, torch.cat(seed_hidden), logits_rows=rows)
        active = [seed_items[j] for j in want]  # item index of each drafting row
        tokens = logits.argmax(-1).tolist()
        hidden = m[rows]
        for i, t in zip(active, tokens):
            drafts[i].append(t)
        for step in range(1, self.k):
            keep = [r for r, i in enumerate(active) if items[i].num_drafts > step]
            if not keep:
                break
            active = [active[r] for r in keep]
            hidden = hidden[torch.tensor(keep, device=hidden.device)]
            seqs = [replace(items[i].step, token_ids=[drafts[i][-1]], num_computed=items[i].step.num_computed + step - 1,
                            mm_embeds=None, mm_index=None) for i in active]
            logits, hidden = self.runner.mtp(seqs, hidden, step=step)
            for i, t in zip(active, logits.argmax(-1).tolist()):
                drafts[i].append(t)
        return drafts

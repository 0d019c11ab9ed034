"""DFlash2's drafter context K/V for the engine: preallocated per request slot, written in place (issue 19).

Layer l keeps C_l rows per slot: max_model_len on a full-attention layer, min(sliding_window, max_model_len) on
a sliding one (the block's first query sits at the context's end e and sees context keys down to e - window + 1,
so a window's rows are all a sliding layer ever reads; the cache plan, cache/capacity.py `DraftKVGroup`, budgets
exactly these rows per request). Position p of a request goes to row p mod C_l: a full layer never wraps
(p < max_model_len), a sliding layer overwrites the row that left its window. Nothing is concatenated or
reallocated after start-up, so the tensors keep their shapes and addresses (what a CUDA graph of the drafter
forward needs) and the eager round stops paying for a growing dense copy.

Row j of a slot whose context covers positions [start, end) holds position

    k(j) = end - 1 - ((end - 1 - j) mod C),

which is valid when k(j) >= start: rows a previous occupant left, and rows not written yet, fall below start.
Attention reads a [B, view] slice: the whole ring, or, in eager mode on layers none of the batch's requests has
wrapped, the power-of-two prefix that covers the batch's longest context (fewer keys to mask off; a handful of
shapes). `static_view=True` always reads the whole ring (one shape per batch size).

Which request holds which slot, and where its context starts and ends, is known on the host from the engine's own
counts; the device copies of start / end (the write positions, the masks, the block's RoPE positions) change only
through kernels with scalar arguments or pinned non-blocking copies, never a copy that blocks the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .draft_config import DFlash2DraftConfig

MIN_VIEW = 16  # the smallest eager view: contexts shorter than this share one shape


def to_device(values: list[int], device: torch.device) -> Tensor:
    """A long tensor on `device` without blocking the host (pinned staging when the device is CUDA)."""
    host = torch.tensor(values, dtype=torch.long, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


@dataclass(frozen=True)
class SlotBatch:
    """The slots of one drafting batch, as the block's attention reads them."""

    slots: Tensor  # [B] long: each request's slot
    starts: Tensor  # [B] long: the first position of its context
    ends: Tensor  # [B] long: the position after its context's last row (the anchor's)
    views: tuple[int, ...]  # per layer: the rows read of each slot (C_l, or a prefix covering every context)


@dataclass(frozen=True)
class AppendPlan:
    """Where one batched append writes: rows of several requests, in request order, at their slots' ends."""

    counts: list[tuple[int, int]]  # (slot, rows appended) per request
    fed: list[int]  # per request, how many of its last rows go through the drafter (the rest no layer keeps)
    row_slot: Tensor  # [R] long: the slot of each fed row
    positions: Tensor  # [R] long: each fed row's position
    selects: dict[int, Tensor | None]  # capacity -> the fed rows a layer of that capacity keeps (None: all)


class DraftContextStore:
    """Per-layer K/V [num_slots, C_l, Hkv, D] (K after k_norm and RoPE) plus each slot's context span."""

    def __init__(self, cfg: DFlash2DraftConfig, num_slots: int, max_model_len: int, device: torch.device | str,
                 dtype: torch.dtype, static_view: bool = False, num_kv_heads: int | None = None):
        """num_kv_heads: the KV heads the drafter's layers hold (a tensor-parallel rank's share; None: the config's)."""
        if num_slots < 1 or max_model_len < 1:
            raise ValueError(f"a drafter context store needs num_slots >= 1 and max_model_len >= 1 (got {num_slots}, "
                             f"{max_model_len}); pass the engine's max_num_seqs and max_model_len")
        self.device = torch.device(device)
        self.max_model_len, self.static_view = max_model_len, static_view
        self.capacities = tuple(min(cfg.layer_window(i) or max_model_len, max_model_len)
                                for i in range(cfg.num_hidden_layers))
        hk, d = num_kv_heads or cfg.num_key_value_heads, cfg.head_dim
        self.keys = [torch.zeros(num_slots, c, hk, d, device=self.device, dtype=dtype) for c in self.capacities]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.starts = torch.zeros(num_slots, dtype=torch.long, device=self.device)
        self.ends = torch.zeros(num_slots, dtype=torch.long, device=self.device)
        self.host_start, self.host_end = [0] * num_slots, [0] * num_slots
        self.free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first

    @property
    def num_slots(self) -> int:
        return len(self.host_end)

    def tensors(self) -> list[Tensor]:
        """The per-layer K/V (what sleep frees: with no request left no row is read, and acquire empties a slot)."""
        return [*self.keys, *self.values]

    def length(self, slot: int) -> int:
        """Context rows the slot covers (its span; a sliding layer keeps only the last C_l of them)."""
        return self.host_end[slot] - self.host_start[slot]

    def acquire(self, start: int) -> int | None:
        """A free slot whose (empty) context starts at `start`; None when every slot is taken."""
        if not self.free:
            return None
        slot = self.free.pop()
        self.reset(slot, start)
        return slot

    def release(self, slot: int) -> None:
        if slot in self.free:
            raise ValueError(f"drafter context slot {slot} released twice")
        self.free.append(slot)

    def reset(self, slot: int, start: int) -> None:
        """Empty the slot's context, its next row at `start` (the rows left in it are masked off from now on)."""
        self.host_start[slot] = self.host_end[slot] = start
        self.starts[slot].fill_(start)  # scalar kernels: no host-to-device copy to wait for
        self.ends[slot].fill_(start)

    # ---- writes ------------------------------------------------------------------------------
    def plan_append(self, counts: list[tuple[int, int]]) -> AppendPlan:
        """The rows [(slot, n)] append at their slots' ends; fails before any write when one passes max_model_len."""
        for slot, n in counts:
            if self.host_end[slot] + n > self.max_model_len:
                raise ValueError(f"drafter context slot {slot} would reach position {self.host_end[slot] + n}, past "
                                 f"max_model_len={self.max_model_len}; build the store with the engine's max_model_len")
        keep = max(self.capacities)
        fed = [min(n, keep) for _, n in counts]
        row_slot, offset = [], []
        for (slot, n), f in zip(counts, fed):
            row_slot += [slot] * f
            offset += range(n - f, n)
        both = to_device(row_slot + offset, self.device).view(2, -1)
        positions = self.ends.index_select(0, both[0]) + both[1]  # device-side: where each request's context ends
        selects: dict[int, Tensor | None] = {}
        for c in set(self.capacities):
            if all(f <= c for f in fed):
                selects[c] = None
                continue
            rows, base = [], 0
            for f in fed:  # a ring keeps each request's last c rows; writing more would alias rows in one write
                rows += range(base + f - min(f, c), base + f)
                base += f
            selects[c] = to_device(rows, self.device)
        return AppendPlan(counts, fed, both[0], positions, selects)

    def write(self, layer: int, keys: Tensor, values: Tensor, plan: AppendPlan) -> None:
        """keys/values: [R, Hkv, D] for the plan's fed rows -> rows (slot, position mod C_l) of the layer."""
        c = self.capacities[layer]
        index = plan.row_slot * c + plan.positions % c  # [R] into the flattened [num_slots * C_l] rows
        select = plan.selects[c]
        if select is not None:
            index, keys, values = index[select], keys[select], values[select]
        self.keys[layer].view(-1, *keys.shape[1:]).index_copy_(0, index, keys)
        self.values[layer].view(-1, *values.shape[1:]).index_copy_(0, index, values)

    def commit(self, plan: AppendPlan) -> None:
        """Move the slots' ends past the appended rows (after every layer's write read the old ends)."""
        for slot, n in plan.counts:
            self.host_end[slot] += n
        both = to_device([s for s, _ in plan.counts] + [n for _, n in plan.counts], self.device).view(2, -1)
        self.ends.index_copy_(0, both[0], self.ends.index_select(0, both[0]) + both[1])  # one entry per slot

    # ---- reads -------------------------------------------------------------------------------
    def check_drafting(self, slots: list[int]) -> None:
        """Every slot must hold context before a block drafts from it."""
        if any(self.length(s) == 0 for s in slots):
            raise ValueError("a request has no drafter context yet: call extend_slots with its tapped target "
                             "states (the prompt's, at least) before drafting")

    def batch(self, slots: list[int]) -> SlotBatch:
        """The batch's slot indices, spans and per-layer views."""
        longest = max(self.host_end[s] for s in slots)  # positions < longest: a layer with C_l >= longest never wrapped
        bucket = max(MIN_VIEW, 1 << max(0, longest - 1).bit_length())
        views = tuple(c if self.static_view or longest > c else min(c, bucket) for c in self.capacities)
        index = to_device(slots, self.device)
        return SlotBatch(index, self.starts.index_select(0, index), self.ends.index_select(0, index), views)

    def ring_batch(self, slots: Tensor) -> SlotBatch:
        """`batch` of device slot indices [B] long with whole-ring views, from device values only (no host list):
        every shape depends on B alone, what a CUDA graph of the block forward needs (draft_graph.py)."""
        return SlotBatch(slots, self.starts.index_select(0, slots), self.ends.index_select(0, slots), self.capacities)

    def read(self, layer: int, batch: SlotBatch) -> tuple[Tensor, Tensor]:
        """The batch's rows of the layer: (K, V) [B, view, Hkv, D]."""
        n = batch.views[layer]
        return (self.keys[layer][:, :n].index_select(0, batch.slots),
                self.values[layer][:, :n].index_select(0, batch.slots))

    def positions(self, layer: int, batch: SlotBatch) -> tuple[Tensor, Tensor]:
        """(position [B, view] long, valid [B, view] bool) of the rows `read` returns."""
        c, n = self.capacities[layer], batch.views[layer]
        last = batch.ends[:, None] - 1
        pos = last - torch.remainder(last - torch.arange(n, device=self.device), c)
        return pos, pos >= batch.starts[:, None]

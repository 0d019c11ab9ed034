"""The DFlash2 drafter's block forward and greedy walk as one CUDA graph per batch size (issue 19 item 6).

A drafting round (drafter.py `propose`) first appends the requests' new context rows to the store (eager: their
count varies), then runs the block of [anchor, mask x D] through the drafter's layers against each request's
context K/V and walks the selector. With the store's whole-ring views (`DraftContextStore(static_view=True)`,
`ring_batch`) every shape of that second part depends on the batch size B alone: the ring capacities are fixed at
start-up, and what changes per round is B slot indices and B anchor ids. `DraftGraphs` captures it per captured
size into static buffers sized for the largest; the contexts' starts and ends (masks, RoPE positions) are read
from the store's device tensors inside the graph, so the round's eager context write is what the replay sees.

A round of b requests replays the smallest size B >= b: rows past b repeat the first request's slot with anchor
0 (they only read; their drafts are dropped). `capture(graphs=False)` runs the same static-shape function eagerly
on the same buffers (the CPU tests: bitwise the eager drafter on a static-view store). Greedy walks only: the
sampled walk draws from the drafter's own generator, which a graph would freeze.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ...engine.cuda_graphs import capture_graph, pool_bytes
from .context_store import DraftContextStore, to_device
from .model import DFlash2DraftModel


def static_draft(drafter: DFlash2DraftModel, store: DraftContextStore, embed: Callable[[Tensor], Tensor],
                 lm_head: Callable[[Tensor], Tensor], slots: Tensor, anchors: Tensor) -> Tensor:
    """Greedy drafts [B, D] long for blocks at the ends of the store's `slots` [B] long with anchor ids [B] long,
    from device values only (whole-ring views: the same arithmetic as the eager round on a static-view store)."""
    hidden = drafter.block_hidden_batch(drafter.block_embeds(anchors, embed), store, store.ring_batch(slots))
    return drafter.select(hidden, anchors, lm_head).tokens


class DraftGraphs:
    """Captured `static_draft` per batch size (see the module docstring)."""

    def __init__(self, drafter: DFlash2DraftModel, store: DraftContextStore, embed: Callable[[Tensor], Tensor],
                 lm_head: Callable[[Tensor], Tensor], batch_sizes: list[int]):
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"drafter graph batch sizes must be >= 1, got {batch_sizes}")
        if not store.static_view:
            raise ValueError("the drafter graphs read whole rings: build the DraftContextStore with static_view=True")
        self.drafter, self.store, self.embed, self.lm_head = drafter, store, embed, lm_head
        self.batch_sizes = sorted(set(batch_sizes))
        B = self.batch_sizes[-1]
        self.slots = torch.zeros(B, dtype=torch.long, device=store.device)  # [B] static inputs
        self.anchors = torch.zeros(B, dtype=torch.long, device=store.device)
        self.tokens: dict[int, Tensor] = {}  # B -> [B, D] drafts the replay writes
        self.graphs: dict[int, Callable[[], None]] = {}
        self._captured: list[torch.cuda.CUDAGraph] = []  # kept alive with their memory
        self.used_bytes = 0
        self.num_replays = 0

    def _run(self, B: int) -> Tensor:
        return static_draft(self.drafter, self.store, self.embed, self.lm_head, self.slots[:B], self.anchors[:B])

    @torch.no_grad()
    def capture(self, graphs: bool = True) -> None:
        """Capture every size, largest first (smaller ones reuse its pool memory); graphs=False runs `static_draft`
        eagerly on the static buffers at each replay instead."""
        if not graphs:
            for B in self.batch_sizes:
                self.graphs[B] = lambda B=B: self.tokens.__setitem__(B, self._run(B))
            return
        device = self.store.device
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        pool = torch.cuda.graph_pool_handle()
        for B in reversed(self.batch_sizes):
            graph, self.tokens[B] = capture_graph(lambda B=B: self._run(B), pool, device)
            self.graphs[B] = graph.replay
            self._captured.append(graph)
        torch.cuda.synchronize(device)
        self.used_bytes = max(pool_bytes(pool), free_before - torch.cuda.mem_get_info(device)[0])

    def can_run(self, num_requests: int) -> bool:
        return 0 < num_requests <= self.batch_sizes[-1]

    @torch.no_grad()
    def run(self, slots: list[int], anchors: Tensor) -> Tensor:
        """Drafts [b, D] long (a view of the static output, valid until the next replay) for the b requests whose
        contexts end at the store's `slots`, anchors [b] long on the device."""
        self.store.check_drafting(slots)
        b = len(slots)
        B = next(size for size in self.batch_sizes if size >= b)
        self.slots[:B].copy_(to_device(slots + [slots[0]] * (B - b), self.slots.device), non_blocking=True)
        self.anchors[:b].copy_(anchors)
        self.anchors[b:B].zero_()
        self.graphs[B]()
        self.num_replays += 1
        return self.tokens[B][:b]

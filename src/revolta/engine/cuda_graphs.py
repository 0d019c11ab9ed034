"""CUDA graphs for decode steps: capture the paged forward once per batch size, replay it.

A decode step (one new token per request) launches a few hundred small kernels; at small batch
sizes their launch cost, not the GPU, sets the step time. `DecodeGraphs` captures
`ModelRunner.forward_packed` for a fixed list of batch sizes into one shared memory pool. A step
with b requests replays the smallest captured size B >= b: the packed step buffer (the same layout
the eager path uploads, see runner.py) is copied into the graph's static input buffer, padded
rows run on the dummy state slot 0 and the null block 0 (which no request owns, so they change
nothing a request reads), and the first b rows of the static logits are returned.

The block table is captured at its full width, cdiv(max_model_len + lookahead, block_size), so any
request up to max_model_len fits every graph.

With `return_hidden` (speculation whose adaptive policy paused drafting, engine/spec_policy.py) the
graphs also return the rows' hidden states [b, h*d], which the drafter keeps to resume drafting.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from .runner import ModelRunner, StepInputs, StepSequence, section_sizes

logger = logging.getLogger(__name__)

MiB = 1 << 20


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8 up to max_num_seqs (max_num_seqs itself always included)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8)) + [max_num_seqs]
    return sorted(set(sizes))


def graph_warning(used_bytes: int, reserve_bytes: int) -> str | None:
    """The release note's check: warn when the graphs exceed the reserve by more than
    max(64 MiB, 5% of the reserve), and suggest a reserve that covers them."""
    slack = max(64 * MiB, reserve_bytes // 20)
    if used_bytes <= reserve_bytes + slack:
        return None
    suggest = -(-int(used_bytes * 1.1) // (64 * MiB)) * 64  # 10% headroom, rounded up to 64 MiB
    return (f"CUDA graphs use {used_bytes / MiB:,.0f} MiB but only {reserve_bytes / MiB:,.0f} MiB were reserved "
            f"before the KV cache was sized; the GPU may run out of memory. Set cudagraph_mem_mib={suggest} (or "
            f"REVOLTA_CUDAGRAPH_MEM_MIB={suggest}), or pass enforce_eager=True to run without graphs.")


def capture_graph(fn: Callable[[], Any], pool, device: torch.device, warmup: int = 2
                  ) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Run `fn` `warmup` times on a side stream (compiles the Triton kernels, sizes the workspaces),
    then capture one call into a graph in memory pool `pool` -> (graph, what the captured call returned).

    Python's cyclic garbage collector is off during the capture: a collection there may free an
    unreachable engine's CUDA graphs, memory pools or pinned buffers, whose teardown calls CUDA APIs
    that invalidate a capture (cudaErrorStreamCaptureInvalidated at the next launch). torch no longer
    collects before a capture, and when a collection falls depends on Python allocation counts (the
    likely cause of a spec-graph GPU test that failed only with a warm Triton cache: RESULTS.md G1)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
    finally:
        if collecting:
            gc.enable()
    return graph, out


def pool_bytes(pool) -> int:
    """Bytes of the caching allocator's segments that belong to graph memory pool `pool`."""
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", ())) == tuple(pool))


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: Tensor  # [B, V] fp32, written by every replay
    hidden: Tensor | None = None  # [B, h*d] with return_hidden


class DecodeGraphs:
    """Captured decode forwards of `runner` for `batch_sizes`; see the module docstring."""

    def __init__(self, runner: ModelRunner, batch_sizes: list[int], max_blocks_per_seq: int,
                 return_hidden: bool = False):
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"cudagraph batch sizes must be >= 1, got {batch_sizes}")
        self.runner, self.return_hidden = runner, return_hidden
        self.batch_sizes = sorted(set(batch_sizes))
        self.width = max_blocks_per_seq
        B = self.batch_sizes[-1]
        device = runner.model.device
        # one static input buffer sized for the largest batch: each graph reads a prefix of it
        self.static = torch.zeros(sum(section_sizes(B, B, self.width)), dtype=torch.int64, device=device)
        self.graphs: dict[int, _Graph] = {}
        self.used_bytes = 0
        self.num_replays = 0  # decode steps served by a graph (the engine's stats and tests read it)

    @torch.no_grad()
    def capture(self) -> None:
        """Capture every batch size, largest first (smaller graphs reuse its pool memory)."""
        device = self.runner.model.device
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        pool = torch.cuda.graph_pool_handle()
        for B in reversed(self.batch_sizes):
            self._fill_padding(B)
            cu = list(range(B + 1))
            graph, out = capture_graph(
                lambda: self.runner.forward_packed(StepInputs.unpack(self.static, B, B, self.width), cu,
                                                   return_hidden=self.return_hidden), pool, device)
            self.graphs[B] = _Graph(graph, *out) if self.return_hidden else _Graph(graph, out)
        torch.cuda.synchronize(device)
        # the graphs' own pool (what a replay keeps alive); the drop in free memory also counts
        # workspaces and Triton modules first created during capture
        self.used_bytes = max(pool_bytes(pool), free_before - torch.cuda.mem_get_info(device)[0])

    def _fill_padding(self, B: int) -> None:
        """Every row a one-token sequence on the dummy slot 0 / null block 0."""
        pad = StepSequence(token_ids=[0], num_computed=0, block_ids=[0], slot=0)
        flat = self.runner.pack_step([pad], num_rows=B, width=self.width)
        self.static[: flat.numel()].copy_(flat)

    def can_run(self, seqs: list[StepSequence]) -> bool:
        """A text-only decode step (one new token per request) that fits a captured size."""
        return (0 < len(seqs) <= self.batch_sizes[-1]
                and all(len(s.token_ids) == 1 and s.mm_embeds is None and len(s.block_ids) <= self.width
                        for s in seqs))

    @torch.no_grad()
    def run(self, seqs: list[StepSequence], input_ids: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Replay the graph for len(seqs) decode rows -> logits [b, V] fp32 (a copy); with return_hidden
        (logits, hidden rows [b, h*d]). input_ids: [b] int64 on the device, the rows' tokens in place of
        their token_ids (async scheduling: the previous step's samples)."""
        b = len(seqs)
        B = next(size for size in self.batch_sizes if size >= b)
        flat = self.runner.pack_step(seqs, num_rows=B, width=self.width)
        self.static[: flat.numel()].copy_(flat, non_blocking=True)
        if input_ids is not None:  # the input_ids section leads the buffer: one token per row
            self.static[:b].copy_(input_ids)
        if self.runner.ple_feeder is not None:  # a disk-placed PLE table: its rows are in place before the replay
            self.runner.stage_ple(StepInputs.unpack(self.static, B, B, self.width))
        g = self.graphs[B]
        g.graph.replay()
        self.num_replays += 1
        if self.return_hidden:
            return g.logits[:b].clone(), g.hidden[:b].clone()
        return g.logits[:b].clone()

"""CUDA graphs for steady-state speculative rounds (issue 6): a round of b requests that each verify
exactly k drafts replays three graphs captured per batch size B >= b, so it costs about one decode
step plus k - 1 small MTP steps instead of k + 1 eager forwards.

- draft graph: the MTP seed (each request's pending target rows, spec/mtp.py: 1 + the drafts it
  accepted last round, padded to R = 1 + k rows) then the draft steps 2..k, one row per request;
  each argmax feeds the next step's input id on the device, so the drafts never visit the host
  before sampling. Seed rows past a request's pending ones sit at the positions the draft steps
  write next (their MTP K/V is overwritten like a rejected draft's). The first round after a
  prefill (more pending rows) drafts eagerly and still replays the verify graph.
- verify graph: the target forward over B requests x R = 1 + k rows (runner.verify_packed), with
  per-draft state slots or for replay (spec_state_replay). What the commit needs (the layers'
  `VerifyMeta.record`) the layers write straight into static buffers shared by all batch sizes
  (VerifyMeta.buffers), and the logits and the wide hidden rows are copied into two more, so graph
  memory grows with the largest size only.
- commit graph: spec/commit.commit_verified on those static records, given the kept slots and the
  kept row counts (known after sampling); with replay this is the replay kernels of every GDN layer
  in one launch instead of a few hundred.

A drafter other than MTP (DFlash2) drafts eagerly and hands host drafts to the verify graph:
`SpecGraphs(..., draft_graph=False)` captures the verify and commit graphs only (the engine does so
unless `EngineConfig.dflash2_graph_rounds` is False: benchmarks/RESULTS.md S2b, F1 run I).

Padding (as cuda_graphs.DecodeGraphs): rows past b are R-token sequences on the dummy state slot 0
and the null block 0, which no request owns; their draft-slot rows, kept slots and draft steps point
there too, so they change nothing a request reads. The block table is captured at the decode graphs'
full width. Steps that do not fit (a prefill chunk in the step, fewer than k drafts near
max_model_len or max_tokens, media rows, more requests than the largest size) run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable

import torch
from torch import Tensor

from ..engine.cuda_graphs import capture_graph, pool_bytes
from ..forward import PagedMeta
from ..engine.runner import ModelRunner, StepInputs, StepSequence, offsets, pack_buffer, section_sizes
from .commit import check_replay_slots, commit_verified


def padding_sequence(num_rows: int, block_size: int) -> StepSequence:
    """A `num_rows`-token sequence from position 0 on the dummy slot 0, all pages the null block 0."""
    return StepSequence(token_ids=[0] * num_rows, num_computed=0, block_ids=[0] * -(-num_rows // block_size), slot=0)


def cover(step: StepSequence, num_tokens: int, block_size: int) -> StepSequence:
    """`step` with its pages extended by null blocks to hold `num_tokens` new tokens: rows past a
    request's own lookahead write their K/V into the null block 0."""
    need = -(-(step.num_computed + num_tokens) // block_size)
    return replace(step, block_ids=list(step.block_ids) + [0] * (need - len(step.block_ids)))


def pad_verify(steps: list[StepSequence], drafts: list[list[int]] | None, batch_size: int, num_rows: int,
               block_size: int) -> list[StepSequence]:
    """The verify sequences of a graph of `batch_size` requests x `num_rows` rows: each step's definite
    token, its drafts, then zeros up to num_rows (placeholders the device fills when drafts is None,
    or rows past a request's own draft count: computed like rejected drafts, their state kept
    nowhere but the dummy slot, their K/V past the lookahead in the null block), then padding
    sequences up to batch_size."""
    out = []
    for s, d in zip(steps, drafts if drafts is not None else [[]] * len(steps)):
        if len(s.token_ids) != 1 or len(d) >= num_rows:
            raise ValueError(f"a verify graph of {num_rows} rows takes one definite token and at most "
                             f"{num_rows - 1} drafts per request, got {len(s.token_ids)} and {len(d)}")
        out.append(cover(replace(s, token_ids=s.token_ids + d + [0] * (num_rows - 1 - len(d))), num_rows,
                         block_size))
    return out + [padding_sequence(num_rows, block_size)] * (batch_size - len(steps))


def pad_rows(rows: list[list[int]], batch_size: int, width: int, fill: int = 0) -> list[list[int]]:
    """Rows of ints padded to `batch_size` rows of `width` (with `fill`): draft-slot tables, kept slots."""
    return [r + [fill] * (width - len(r)) for r in rows] + [[fill] * width] * (batch_size - len(rows))


@dataclass
class _Round:
    """What one batch size replays: CUDA graphs' `replay`, or the same code run eagerly on the same
    static buffers (`capture(graphs=False)`)."""

    draft: Callable[[], None] | None  # None: no draft graph (the drafter drafts eagerly)
    verify: Callable[[], None]
    commit: Callable[[], None]


def _upload(dst: Tensor, host: Tensor) -> None:
    """dst <- host without waiting for the device (pinned staging on CUDA)."""
    dst.copy_(host.pin_memory() if dst.is_cuda else host, non_blocking=True)


class SpecGraphs:
    """Captured draft, verify and commit graphs of `runner` for `batch_sizes` (see the module docstring).

    num_drafts: k; replay: spec_state_replay (no per-draft slots); max_blocks_per_seq: the table width;
    draft_graph: capture the MTP draft graph too (False: the drafter drafts eagerly, as DFlash2's does).
    """

    def __init__(self, runner: ModelRunner, batch_sizes: list[int], num_drafts: int, replay: bool,
                 max_blocks_per_seq: int, draft_graph: bool = True):
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"cudagraph batch sizes must be >= 1, got {batch_sizes}")
        self.runner, self.k, self.replay, self.width = runner, num_drafts, replay, max_blocks_per_seq
        self.draft_graph = draft_graph
        self.rows = num_drafts + 1  # R: definite token + k drafts
        self.batch_sizes = sorted(set(batch_sizes))
        B, R, W = self.batch_sizes[-1], self.rows, self.width
        device = runner.model.device
        i32 = dict(dtype=torch.int32, device=device)
        self.verify_in = torch.zeros(sum(section_sizes(B, B * R, W)), dtype=torch.int64, device=device)
        # the MTP draft graph's inputs (empty without one)
        self.seed_in = torch.zeros(sum(section_sizes(B, B * R, W)) if draft_graph else 0, dtype=torch.int64,
                                   device=device)
        self.draft_in = torch.zeros(max(1, num_drafts - 1) * sum(section_sizes(B, B, W)) if draft_graph else 0,
                                    dtype=torch.int64, device=device)
        self.draft_table = torch.zeros(B, R, **i32)  # per-draft state slots (unused with replay)
        self.flat_index = torch.arange(B * R, device=device)  # every request has exactly R rows
        self.keep = torch.zeros(B, **i32)
        self.num_kept = torch.ones(B, **i32)
        self.seed_hidden = torch.zeros(B * R if draft_graph else 0, runner.model.cfg.text.wide_size,
                                       dtype=runner.model.dtype, device=device)  # [B * R, h*d] pending target rows
        self.seed_last = torch.arange(B, device=device) * R  # [B] the last pending row of each request
        self.drafts = torch.zeros(B, num_drafts, dtype=torch.int64, device=device)
        self.shared: dict[str, Tensor] = {}  # the layers' records, the logits and wide rows (by name)
        self.graphs: dict[int, _Round] = {}
        self._captured: list[torch.cuda.CUDAGraph] = []  # kept alive with their memory
        self._paged: dict[int, PagedMeta] = {}  # the verify's metadata per size (eager mode: the last one's)
        self.used_bytes = 0
        self.num_replays = 0  # rounds served by the graphs (the engine's stats and tests read it)

    # ---- capture -------------------------------------------------------------------------------
    def _buffer(self, B: int, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """A view `shape` of the buffer shared by all batch sizes for `name` (uninitialised).

        Every such tensor's first dim is B or B * R, so the largest size (captured first) sizes it."""
        buf = self.shared.get(name)
        if buf is None:
            buf = self.shared[name] = torch.empty(shape[0] // B * self.batch_sizes[-1], *shape[1:], dtype=dtype,
                                                  device=self.runner.model.device)
        if buf.dtype != dtype or buf.shape[1:] != shape[1:] or buf.shape[0] < shape[0]:
            raise RuntimeError(f"shared buffer {name!r} is {buf.dtype} {tuple(buf.shape)}, a batch of {B} asked "
                               f"for {dtype} {shape}: its first dim must scale with the batch size")
        return buf[: shape[0]]

    def _static(self, name: str, x: Tensor, B: int) -> Tensor:
        """x copied into the buffer shared by all batch sizes for `name`."""
        return self._buffer(B, name, tuple(x.shape), x.dtype).copy_(x)

    def _verify(self, B: int):
        """The verify forward of size B on the static inputs; the layers write their records straight
        into shared buffers (VerifyMeta.buffers), the logits and wide rows are copied into others."""
        R, W = self.rows, self.width
        inputs = StepInputs.unpack(self.verify_in, B, B * R, W)
        table = None if self.replay else self.draft_table[:B]
        logits, wide, paged = self.runner.verify_packed(inputs, offsets([R] * B), table, self.flat_index[: B * R],
                                                        record_buffers=lambda *a: self._buffer(B, *a))
        self._check_records(paged.spec.record)
        return self._static("logits", logits, B), self._static("wide", wide, B), paged

    def _check_records(self, record: dict) -> None:
        """Every recorded tensor must live in a shared buffer: the commit graph reads it after the verify
        graph, and other sizes' graphs reuse whatever else the verify allocated."""
        owned = {buf.untyped_storage().data_ptr() for buf in self.shared.values()}
        for name, rec in record.items():
            for f in fields(rec):
                value = getattr(rec, f.name)
                for t in value if isinstance(value, tuple) else (value,):
                    if isinstance(t, Tensor) and t.untyped_storage().data_ptr() not in owned:
                        raise RuntimeError(f"the verify record {name}.{f.name} is not in VerifyMeta.buffers' storage: "
                                           "allocate it with VerifyMeta.record_buffer")

    def _commit(self, B: int, paged: PagedMeta) -> None:
        commit_verified(self.runner.storage, self.runner.ops, paged.spec, paged.cu_seqlens,
                        self.verify_in[: B * self.rows], paged.slots, self.keep[:B], self.num_kept[:B])

    def _draft_inputs(self, B: int) -> list[StepInputs]:
        n = sum(section_sizes(B, B, self.width))
        return [StepInputs.unpack(self.draft_in[j * n:(j + 1) * n], B, B, self.width) for j in range(self.k - 1)]

    def _draft(self, B: int) -> None:
        """The MTP seed over R rows per request, then steps 2..k; each argmax is the next input id."""
        R = self.rows
        seed = StepInputs.unpack(self.seed_in, B, B * R, self.width)
        last = self.seed_last[:B]
        logits, m = self.runner.mtp_packed(seed, offsets([R] * B), self.seed_hidden[: B * R], logits_rows=last)
        tokens, hidden = logits.argmax(-1), m[last]
        self.drafts[:B, 0].copy_(tokens)
        cu = list(range(B + 1))
        for j, inputs in enumerate(self._draft_inputs(B), start=1):
            inputs.input_ids.copy_(tokens)
            logits, hidden = self.runner.mtp_packed(inputs, cu, hidden, step=j)
            tokens = logits.argmax(-1)
            self.drafts[:B, j].copy_(tokens)

    @torch.no_grad()
    def capture(self, graphs: bool = True) -> None:
        """Capture every batch size, largest first (it sizes the shared buffers; smaller graphs reuse
        its pool memory). graphs=False captures nothing: each replay runs the same code eagerly on the
        same static buffers (how the CPU tests check the padding and the buffer plumbing)."""
        if not graphs:
            for B in self.batch_sizes:
                self.graphs[B] = _Round(
                    (lambda B=B: self._draft(B)) if self.draft_graph else None,
                    lambda B=B: self._paged.__setitem__(B, self._verify(B)[2]),
                    lambda B=B: self._commit(B, self._paged[B]))
            return
        device = self.runner.model.device
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        pool = torch.cuda.graph_pool_handle()
        R, bs = self.rows, self.runner.block_size
        for B in reversed(self.batch_sizes):
            flat = self.runner.pack_step(pad_verify([], None, B, R, bs), width=self.width)
            self.verify_in[: flat.numel()].copy_(flat)
            self.draft_table.zero_()
            self.keep.zero_()
            self.num_kept.fill_(1)
            verify, (_, _, paged) = capture_graph(lambda: self._verify(B), pool, device)
            verify.replay()  # the commit's warm-up runs read the verify's outputs: make them the padding's
            commit, _ = capture_graph(lambda: self._commit(B, paged), pool, device)
            self._paged[B] = paged  # the commit graph reads these verify outputs: keep their memory
            self._captured += [verify, commit]
            if not self.draft_graph:
                self.graphs[B] = _Round(None, verify.replay, commit.replay)
                continue
            flat = self.runner.pack_step(pad_verify([], None, B, R, bs), width=self.width)
            self.seed_in[: flat.numel()].copy_(flat)
            self.seed_last.copy_(torch.arange(self.seed_last.shape[0], device=device) * R)
            if self.k > 1:
                flat = torch.cat([self.runner.pack_step([padding_sequence(1, bs)], num_rows=B, width=self.width)]
                                 * (self.k - 1))
                self.draft_in[: flat.numel()].copy_(flat)
            draft, _ = capture_graph(lambda: self._draft(B), pool, device)
            self.graphs[B] = _Round(draft.replay, verify.replay, commit.replay)
            self._captured.append(draft)
        torch.cuda.synchronize(device)
        self.used_bytes = max(pool_bytes(pool), free_before - torch.cuda.mem_get_info(device)[0])

    # ---- one round -----------------------------------------------------------------------------
    def can_run(self, steps: list[StepSequence], num_drafts: list[int]) -> bool:
        """A text-only round where every request verifies 0..k drafts after one definite token, at a
        captured size. A request with fewer than k (near max_model_len or max_tokens; none at its last
        token) runs all R rows and keeps only its own, as rejected drafts: were a request's last token
        eager, every request's last round would make its whole batch's round eager (a full forward's
        launches, and kernels compiled for its new row count on a fresh server)."""
        return (0 < len(steps) <= self.batch_sizes[-1]
                and all(0 <= n <= self.k for n in num_drafts)
                and all(len(s.token_ids) == 1 and s.mm_embeds is None and len(s.block_ids) <= self.width
                        for s in steps))

    def _size(self, b: int) -> int:
        return next(size for size in self.batch_sizes if size >= b)

    def can_seed(self, seeds: list[StepSequence]) -> bool:
        """Whether the seed graph takes these seed sequences (at most R pending rows each, no vision rows:
        a seed with media pads among its tokens runs eagerly)."""
        return (self.draft_graph and len(seeds) <= self.batch_sizes[-1]
                and all(len(s.token_ids) <= self.rows and s.mm_embeds is None for s in seeds))

    @torch.no_grad()
    def draft(self, seeds: list[StepSequence], hidden: list[Tensor], steps: list[StepSequence]) -> Tensor:
        """Replay the draft graph: seeds[i] (spec/mtp.py: the tokens after request i's pending rows,
        num_computed = the first pending position) with its pending wide rows hidden[i] [m_i, h*d];
        steps: the round's verify steps (num_computed = the definite token's position). Returns the
        drafts [b, k] int64 on the device (a copy; no host sync)."""
        b, R, bs = len(seeds), self.rows, self.runner.block_size
        B = self._size(b)
        lens = [len(s.token_ids) for s in seeds]
        padded = [cover(replace(s, token_ids=s.token_ids + [0] * (R - n)), R, bs) for s, n in zip(seeds, lens)]
        flat = self.runner.pack_step(padded + [padding_sequence(R, bs)] * (B - b), width=self.width)
        self.seed_in[: flat.numel()].copy_(flat, non_blocking=True)
        # one upload: the last pending row of each request (padding: its first row), then where each
        # pending row goes in the [B * R] seed rows
        index = torch.tensor([i * R + n - 1 for i, n in enumerate(lens)] + [i * R for i in range(b, B)]
                             + [i * R + j for i, n in enumerate(lens) for j in range(n)])
        index = (index.pin_memory() if self.seed_hidden.is_cuda else index).to(self.seed_hidden.device,
                                                                                 non_blocking=True)
        self.seed_last[:B].copy_(index[:B])
        self.seed_hidden.index_copy_(0, index[B:], torch.cat(hidden))
        if self.k > 1:
            # host buffers (pack_buffer, not the pinned pack_step): the one upload below pins their concatenation
            flat = torch.cat([pack_buffer(
                [cover(replace(s, token_ids=[0], num_computed=s.num_computed + j - 1), 1, bs) for s in steps],
                bs, self.runner.ratio, num_rows=B, width=self.width) for j in range(1, self.k)])
            _upload(self.draft_in[: flat.numel()], flat)
        self.graphs[B].draft()
        return self.drafts[:b].clone()

    @torch.no_grad()
    def verify(self, steps: list[StepSequence], drafts: Tensor | list[list[int]], num_drafts: list[int],
               slot_rows: list[list[int]] | None) -> tuple[Tensor, Tensor, list[list[int]]]:
        """Replay the verify graph for the b = len(steps) requests.

        steps: their decode steps (one definite token each); drafts: [b, k] on the device (from
        `draft`) or host lists; num_drafts: how many of them each request verifies; slot_rows: per
        request [running slot, its draft slots] (None for replay). Returns (logits [b * R, V] fp32,
        wide rows [b * R, h*d]: request i owns rows i * R .. i * R + num_drafts[i]; and its drafts as
        host lists cut to num_drafts: the round's one host sync).
        """
        b, R = len(steps), self.rows
        B = self._size(b)
        on_device = isinstance(drafts, Tensor)
        host = None if on_device else [d[:n] for d, n in zip(drafts, num_drafts)]
        flat = self.runner.pack_step(pad_verify(steps, host, B, R, self.runner.block_size), width=self.width)
        self.verify_in[: flat.numel()].copy_(flat, non_blocking=True)
        if on_device:
            self.verify_in[: B * R].view(B, R)[:b, 1:].copy_(drafts)
        if not self.replay:
            _upload(self.draft_table[:B], torch.tensor(pad_rows(slot_rows, B, R), dtype=torch.int32))
        if self.runner.ple_feeder is not None:  # a disk-placed PLE table: its rows are in place before the replay
            self.runner.stage_ple(StepInputs.unpack(self.verify_in, B, B * R, self.width))
        self.graphs[B].verify()
        self.num_replays += 1
        logits, wide = self.shared["logits"][: b * R].clone(), self.shared["wide"][: b * R].clone()
        if on_device:
            host = [d[:n] for d, n in zip(drafts.tolist(), num_drafts)]
        return logits, wide, host

    @torch.no_grad()
    def commit(self, slots: list[int], keep_slots: list[int], num_kept: list[int]) -> None:
        """After sampling: replay the commit graph of the last verify (same b) with each request's kept
        slot and kept row count (definite token + accepted drafts); spec/commit.py."""
        check_replay_slots(slots, keep_slots, self.replay)
        b = len(keep_slots)
        B = self._size(b)
        _upload(self.keep[:B], torch.tensor(keep_slots + [0] * (B - b), dtype=torch.int32))
        _upload(self.num_kept[:B], torch.tensor(num_kept + [1] * (B - b), dtype=torch.int32))
        self.graphs[B].commit()

"""Driving `revolta.engine.Engine` in the benchmarks and timing it: requests with greedy or sampled
targets (the engine samples, accepts drafts and stops them), wall-clock steps around a device sync, the GPU
time of every captured CUDA graph (events around each replay, no extra sync) and the copy-bandwidth
ceiling a roofline divides by.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import time
from dataclasses import dataclass, replace

import torch

from revolta.engine import Request
from revolta.engine.sampling import SamplingParams


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def Req(rid: str, prompt: list[int], max_tokens: int, temperature: float = 0.0, seed: int = 0,
        device: torch.device | str = "cpu") -> Request:
    """An engine request of exactly max_tokens tokens (end-of-sequence ignored): greedy (temperature 0) or
    sampled with its own seeded generator."""
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, ignore_eos=True)
    generator = torch.Generator(device=device).manual_seed(seed) if temperature else None
    return Request(rid, prompt, params, generator)


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`count` distinct prompts of `length` token ids below `vocab` (deterministic in `seed`)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(count)]


class Timed:
    """A replay callable timed on each call: CUDA events around it on a GPU (no extra sync), wall
    clock on the CPU (where the graphs' code runs eagerly). Each call appends (start, end, host time
    at the call): the host time places the replay inside its step (`host_split`)."""

    def __init__(self, fn, events: list, cuda: bool = True):
        self.fn, self.events, self.cuda = fn, events, cuda

    def __call__(self):
        called = time.perf_counter()
        if not self.cuda:
            self.fn()
            self.events.append((called, time.perf_counter(), called))
            return
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        self.fn()
        b.record()
        self.events.append((a, b, called))

    replay = __call__  # stands in for a CUDAGraph too


def time_graphs(engine) -> dict[str, list]:
    """Wrap every captured graph of the engine (speculative draft / verify / commit, or decode); the
    returned lists fill with one timing pair per replay."""
    parts: dict[str, list] = {}
    cuda = engine.model.device.type == "cuda"
    if engine.spec_graphs is not None:
        for B, rnd in engine.spec_graphs.graphs.items():
            names = [n for n in ("draft", "verify", "commit") if getattr(rnd, n) is not None]  # DFlash2: no draft
            engine.spec_graphs.graphs[B] = replace(rnd, **{
                name: Timed(getattr(rnd, name), parts.setdefault(name, []), cuda) for name in names})
    elif engine.graphs is not None:
        for g in engine.graphs.graphs.values():
            g.graph = Timed(g.graph.replay, parts.setdefault("decode", []), cuda)
    return parts


def _ms(a, b) -> float:
    return a.elapsed_time(b) if isinstance(a, torch.cuda.Event) else (b - a) * 1e3


def _sync_events(*event_lists: list) -> None:
    """Wait until every CUDA event in the Timed lists is recorded (their times are read next); no-op on the CPU."""
    if any(isinstance(ev[0][0], torch.cuda.Event) for ev in event_lists if ev):
        torch.cuda.synchronize()


def gpu_ms(parts: dict[str, list], skip: int = 2) -> dict[str, float]:
    """Median milliseconds of each wrapped graph (GPU time; after a sync), skipping the first `skip` calls."""
    _sync_events(*parts.values())
    return {f"{name}_gpu_ms": statistics.median([_ms(e[0], e[1]) for e in ev[skip:] or ev])
            for name, ev in parts.items() if ev}


def _called_inside(step: StepRecord, events: list) -> list:
    """The Timed entries (start, end, host call time) whose call fell inside `step`'s wall time."""
    return [e for e in events if step.start_s <= e[2] <= step.start_s + step.wall_s]


def host_split(steps: list[StepRecord], events: list) -> dict[str, float]:
    """Where a graph-served step's wall time goes besides its replay (median ms over `steps`): host work before the
    replay was called (scheduling, cache bookkeeping, packing and copying the inputs: the GPU idles, the step having
    started after a sync), the replay's GPU time, and the rest (everything after the replay on host and device:
    the logits copy, sampling and its sync, appending tokens, the scheduler's update). `events`: the Timed
    replays' (start, end, host call time), one per graph-served step among others."""
    _sync_events(events)
    before, gpu, after = [], [], []
    for s in steps:
        inside = _called_inside(s, events)
        if len(inside) != 1:
            continue
        before.append((inside[0][2] - s.start_s) * 1e3)
        gpu.append(_ms(inside[0][0], inside[0][1]))
        after.append(s.wall_s * 1e3 - before[-1] - gpu[-1])
    if not before:
        return {}
    return {"host_before_ms": statistics.median(before), "replay_gpu_ms": statistics.median(gpu),
            "after_replay_ms": statistics.median(after)}


def round_split(rounds: list[StepRecord], parts: dict[str, list]) -> dict[str, float]:
    """Where a graph-served speculative round's wall time goes on the host (median ms over `rounds`): from the
    round's start to the first replay's call, between the calls of successive replays (draft, verify, commit; the
    ones the method has), and from the last call to the round's end. A replay runs on the GPU while the host goes
    on, so an interval longer than the GPU work queued before it is time the GPU waited for the host: e.g. verify
    -> commit holds the verify's GPU time, then the logits' sync, sampling and acceptance on the host.
    `parts`: `time_graphs`' lists, whose (start, end, host call time) entries place each call inside its round."""
    names = [n for n in ("draft", "verify", "commit") if parts.get(n)]
    cols: dict[str, list[float]] = {}  # host call times only: no event is read, so no sync
    for s in rounds:
        end = s.start_s + s.wall_s
        calls = [_called_inside(s, parts[n]) for n in names]
        if any(len(c) != 1 for c in calls):
            continue
        # in call order: a step runs its round's draft, verify, commit (the first round's drafts came with the prefill
        # step, so that round has no draft call and is skipped above)
        marks = [("start", s.start_s)] + sorted(((n, c[0][2]) for n, c in zip(names, calls)), key=lambda m: m[1]) \
            + [("end", end)]
        for (a, ta), (b, tb) in zip(marks, marks[1:]):
            cols.setdefault(f"host_{a}_to_{b}_ms", []).append((tb - ta) * 1e3)
    return {k: statistics.median(v) for k, v in cols.items()}


def graph_replays(engine) -> int:
    """Steps the engine's graphs served so far (decode steps, or speculative rounds)."""
    graphs = engine.spec_graphs if engine.spec_graphs is not None else engine.graphs
    return graphs.num_replays if graphs is not None else 0


@dataclass(frozen=True)
class StepRecord:
    """One Engine.step: wall seconds (device synced on both sides), tokens the requests gained, how many
    were unfinished before it, whether every request was past its prefill (a pure decode / verify step)
    and whether a graph served it."""

    wall_s: float
    emitted: int
    active: int
    decoding: bool
    graphed: bool
    start_s: float = 0.0  # time.perf_counter() at the step's start (after the sync before it)


@torch.no_grad()
def step_once(engine, reqs: list[Request]) -> StepRecord:
    """One `engine.step` over the added `reqs`, timed."""
    device = engine.model.device
    before = sum(len(r.token_ids) for r in reqs)
    active = sum(not r.finished for r in reqs)
    decoding = all(r.token_ids for r in reqs)
    replays = graph_replays(engine)
    sync(device)
    t0 = time.perf_counter()
    engine.step()
    sync(device)
    return StepRecord(time.perf_counter() - t0, sum(len(r.token_ids) for r in reqs) - before, active, decoding,
                      graph_replays(engine) > replays, t0)


class HostProfile:
    """cProfile over chosen engine steps: where a step's host time goes, by Python function, blocking calls included
    (a `tolist` or `synchronize` that waits for the GPU shows its wait). `run(fn, keep)` profiles one call and counts
    it only if keep(its result) holds, so the profile covers the same steps as the timed medians (not the ragged
    last rounds, nor a round that compiled a kernel for a new shape). The profiler roughly doubles pure-Python time:
    read the entries against each other, not as absolute times."""

    def __init__(self) -> None:
        self.stats: pstats.Stats | None = None
        self.calls = 0

    def run(self, fn, keep=lambda result: True):
        profile = cProfile.Profile()
        profile.enable()
        try:
            result = fn()
        finally:
            profile.disable()
        if keep(result):
            self.calls += 1
            self.stats = pstats.Stats(profile) if self.stats is None else self.stats.add(profile)
        return result

    def top(self, n: int = 25, own: bool = False) -> list[dict]:
        """The n functions of the largest cumulative (own: own) time: per kept call, ms and call counts."""
        if self.stats is None:
            return []
        stats = self.stats.stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}
        rows = sorted(stats.items(), key=lambda kv: -kv[1][2 if own else 3])[:n]
        return [{"function": f"{name} ({file.rsplit('/', 1)[-1]}:{line})", "calls": calls / self.calls,
                 "cum_ms": cum * 1e3 / self.calls, "own_ms": own_s * 1e3 / self.calls}
                for (file, line, name), (_, calls, own_s, cum, _) in rows]


def drive(engine, reqs: list[Request]) -> list[StepRecord]:
    """Add `reqs` and step the engine until they finish; one record per step."""
    for r in reqs:
        engine.add_request(r)
    records = []
    while engine.has_unfinished():
        records.append(step_once(engine, reqs))
    return records


@torch.no_grad()
def decode_loop_ms(engine, reqs: list[Request], warmup: int) -> tuple[float, int]:
    """Add `reqs` (one batch that decodes together), run `warmup` steps untimed (the prefill and the first decode
    steps), then run the rest with one device sync at each end and none between steps, so that an engine with
    async_scheduling overlaps a step's host work with the previous step's GPU work -> (ms per decode step, steps
    timed), a step being one token for each request (a step left in flight with ended rows is run and counted)."""
    for r in reqs:
        engine.add_request(r)
    for _ in range(warmup):
        engine.step()
    device = engine.model.device
    sync(device)
    before = sum(len(r.token_ids) for r in reqs)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    engine.step()  # lands what is left in flight (rows of ended requests): part of the async run's cost
    sync(device)
    steps = (sum(len(r.token_ids) for r in reqs) - before) / len(reqs)
    return (time.perf_counter() - t0) * 1e3 / steps, int(steps)


def copy_bandwidth_gbs(device: torch.device | str, gib: float = 1.0, reps: int = 10) -> float:
    """Device-to-device copy bandwidth (read + write) of a `gib` GiB fp16 buffer, median of `reps`."""
    device = torch.device(device)
    a = torch.empty(int(gib * 2**29), dtype=torch.float16, device=device).normal_()
    b = torch.empty_like(a)
    times = []
    for i in range(reps + 2):
        sync(device)
        t0 = time.perf_counter()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            b.copy_(a)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            b.copy_(a)
            seconds = time.perf_counter() - t0
        if i >= 2:
            times.append(seconds)
    return 2 * a.numel() * a.element_size() / statistics.median(times) / 1e9

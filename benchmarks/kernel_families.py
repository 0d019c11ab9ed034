"""Where a forward's GPU time goes, by kernel family (MoE, GDN, QSA, HyperConnections, norms,
lm_head/sampling, other), measured with the torch profiler over CUDA-graph replays.

A replay tells the profiler only kernel names, and cuBLAS GEMMs carry no family in theirs. So the
same forward first runs once eagerly with a `record_function` scope open around each family's modules
(`family_scopes`); each eager kernel takes the innermost scope open when it was launched (found
through the launch's correlation id, or the kernel's external id). The replay's kernels are then
matched to the eager ones in order (a graph replays what its capture launched, in launch order; the
match skips the few kernels only one side has) and take their families; unmatched ones fall back to
their names. Norm kernels count as norms whichever module launched them. On CPU there is no graph
and no kernel: the eager run's leaf operators are attributed the same way.

Also here: `count_routing`, the distinct experts each MoE layer touched in an eager forward (the
roofline's measured routing).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from revolta.layers.gdn import GatedDeltaNet
from revolta.layers.hyperconnection import HyperConnection
from revolta.layers.moe import MoE
from revolta.layers.ngram import PLELayer
from revolta.layers.norm import GatedRMSNorm, ZCRMSNorm
from revolta.layers.qsa import QSAttention

FAMILIES = ("MoE", "GDN", "QSA", "HC", "norms", "lm_head/sampling", "other")
FAMILY, PHASE = "family:", "phase:"  # scope name prefixes
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
_NAME_RULES = (  # (substring of a kernel name, family), first match wins: revolta's Triton kernels
    ("rms_norm", "norms"), ("moe", "MoE"), ("_hc_", "HC"), ("gdn", "GDN"), ("conv1d", "GDN"), ("qsa", "QSA"),
    ("index_score", "QSA"), ("index_compress", "QSA"), ("_topk_kernel", "QSA"), ("store_kv", "QSA"),
    ("_combine_kernel", "QSA"), ("_sample_kernel", "lm_head/sampling"))


def name_family(name: str) -> str | None:
    """The family a kernel's own name gives (Triton kernels are named after their op), or None."""
    low = name.lower()
    return next((family for key, family in _NAME_RULES if key in low), None)


# ---- scopes ---------------------------------------------------------------------------------------


@contextmanager
def family_scopes(model: torch.nn.Module) -> Iterator[None]:
    """Open a `family:<name>` profiler scope around every call of each family's modules while inside."""
    families = ((MoE, "MoE"), (GatedDeltaNet, "GDN"), (QSAttention, "QSA"), ((ZCRMSNorm, GatedRMSNorm), "norms"),
                (PLELayer, "other"))  # PLE's conv must not count as GDN's by its kernel name
    handles, patched, open_scopes = [], [], []

    def enter(name: str):
        def pre(*_):
            scope = record_function(FAMILY + name)
            scope.__enter__()
            open_scopes.append(scope)
        return pre

    def leave(*_):
        open_scopes.pop().__exit__(None, None, None)

    def scoped(fn: Callable, name: str) -> Callable:
        def call(*args, **kwargs):
            with record_function(FAMILY + name):
                return fn(*args, **kwargs)
        return call

    lm_head = getattr(model, "lm_head", None)
    for m in model.modules():
        name = "lm_head/sampling" if m is lm_head else next((n for cls, n in families if isinstance(m, cls)), None)
        if name is not None:
            handles += [m.register_forward_pre_hook(enter(name)), m.register_forward_hook(leave)]
        if isinstance(m, HyperConnection):  # read/combine are methods, not forward
            for method in ("read", "combine"):
                object.__setattr__(m, method, scoped(getattr(m, method), "HC"))
                patched.append((m, method))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for m, method in patched:
            object.__delattr__(m, method)


@contextmanager
def count_routing(runner) -> Iterator[list[int]]:
    """Inside: every MoE routing of `runner`'s model appends the number of distinct experts it chose
    (one entry per MoE layer call, in call order; a host sync per call)."""
    counts: list[int] = []

    def counting(route: Callable) -> Callable:
        def call(*args, **kwargs):
            ids, weights = route(*args, **kwargs)
            counts.append(int(ids.unique().numel()))
            return ids, weights
        return call

    ops = runner.ops
    moes = [m for m in runner.model.modules() if isinstance(m, MoE)]
    if ops.moe_route is not None:  # the Triton path routes through the op table
        runner.ops = replace(ops, moe_route=counting(ops.moe_route))
    else:  # the torch path: MoE.route
        for m in moes:
            object.__setattr__(m, "route", counting(m.route))
    try:
        yield counts
    finally:
        runner.ops = ops
        for m in moes:
            m.__dict__.pop("route", None)


# ---- attribution ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Work:
    """One unit of device work (a kernel, copy or memset; on CPU a leaf operator) and where it came from."""

    name: str
    ts: float  # µs
    dur: float  # µs
    scope_family: str | None  # the innermost family scope open at its launch
    phase: str | None  # the innermost phase scope (e.g. "eager", "replay0")

    @property
    def family(self) -> str:
        by_name = name_family(self.name)
        if by_name == "norms":
            return by_name
        return self.scope_family or by_name or "other"


def _innermost(intervals: list[dict], points: list[tuple[float, int]], prefix: str) -> dict[int, str]:
    """For each (time, key) point, the name (without `prefix`) of the innermost interval with that prefix
    containing it. Intervals on one thread nest properly, so one sweep with a stack does it."""
    items = sorted([(e["ts"], 0, -e["dur"], i) for i, e in enumerate(intervals)]
                   + [(t, 1, 0.0, k) for t, k in points])
    stack: list[dict] = []
    out = {}
    for t, kind, _, ref in items:
        while stack and stack[-1]["ts"] + stack[-1]["dur"] < t:
            stack.pop()
        if kind == 0:
            stack.append(intervals[ref])
        elif stack:
            out[ref] = stack[-1]["name"][len(prefix):]
    return out


def attribute(events: list[dict]) -> list[Work]:
    """Device work (CPU leaf operators when there is none) of a chrome trace, in start order, each
    with the family and phase scopes open where it was launched."""
    spans = [e for e in events if e.get("ph") == "X" and isinstance(e.get("dur"), (int, float))]
    gpu = [e for e in spans if e.get("cat") in GPU_CATEGORIES]
    cpu_ops = sorted((e for e in spans if e.get("cat") == "cpu_op"), key=lambda e: (e["ts"], -e["dur"]))
    if gpu:
        by_corr = {e["args"]["correlation"]: e for e in spans
                   if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
        by_ext = {e["args"]["External id"]: e for e in spans
                  if e.get("cat") in ("cpu_op", "user_annotation") and "External id" in e.get("args", {})}
        work = sorted(gpu, key=lambda e: e["ts"])
        anchors = []
        for e in work:
            args = e.get("args", {})
            launch = by_corr.get(args.get("correlation")) or by_ext.get(args.get("External id"))
            anchors.append(None if launch is None else launch["ts"])
    else:  # CPU: an operator is a leaf when the next one (by start) begins after it ends
        work = [e for e, nxt in zip(cpu_ops, cpu_ops[1:] + [None]) if nxt is None or nxt["ts"] >= e["ts"] + e["dur"]]
        anchors = [e["ts"] for e in work]
    notes = [e for e in spans if e.get("cat") == "user_annotation"]
    points = [(t, i) for i, t in enumerate(anchors) if t is not None]
    family = _innermost([e for e in notes if e["name"].startswith(FAMILY)], points, FAMILY)
    phase = _innermost([e for e in notes if e["name"].startswith(PHASE)], points, PHASE)
    out, last = [], None
    for i, e in enumerate(work):
        if anchors[i] is None and last is not None:  # not traced back to a launch: eager order is launch order
            out.append(replace(last, name=e["name"], ts=e["ts"], dur=e["dur"]))
        else:
            out.append(Work(e["name"], e["ts"], e["dur"], family.get(i), phase.get(i)))
        last = out[-1]
    return out


def align(a: list[str], b: list[str], window: int = 64, run: int = 4) -> list[int | None]:
    """For each a[i], the index in b of the item it matches (in order), or None. Equal names match; at a
    difference the sequences resync at the nearest place (fewest items skipped, within `window`) where
    `run` names agree again: items only one side has stay unmatched, equally long differing stretches
    (another GEMM kernel chosen at the same place) are matched position by position."""

    def agree(i: int, j: int) -> bool:
        n = min(run, len(a) - i, len(b) - j)
        return n > 0 and a[i:i + n] == b[j:j + n]

    def resync(i: int, j: int) -> tuple[int, int] | None:
        for total in range(1, 2 * window):  # the nearest first; for one total, the most even split first
            for da in sorted(range(max(0, total - window + 1), min(total, window - 1) + 1),
                             key=lambda d: abs(2 * d - total)):
                if agree(i + da, j + total - da):
                    return da, total - da
        return None

    out: list[int | None] = []
    i = j = 0
    searches = 32  # failed resyncs allowed: unrelated sequences would cost window^2 per item otherwise
    while i < len(a):
        if j < len(b) and a[i] == b[j]:
            out.append(j)
            i, j = i + 1, j + 1
            continue
        skip = resync(i, j) if j < len(b) and searches > 0 else None
        if skip is None:  # nothing agrees nearby: take the places as the same op
            searches -= 1
            skip = (1, 1) if j < len(b) else (len(a) - i, 0)
        da, db = skip
        out += [j + t for t in range(da)] if da == db else [None] * da
        i, j = i + da, j + db
    return out


def _totals(items: list[tuple[str, float]]) -> dict[str, float]:
    """(family, µs) pairs -> ms per family, every family present."""
    ms = dict.fromkeys(FAMILIES, 0.0)
    for family, us in items:
        ms[family] += us / 1e3
    return ms


def summarise(work: list[Work], replays: int) -> dict:
    """Family milliseconds of the eager phase and (matched to it) of each replay's median."""
    eager = [w for w in work if w.phase == "eager"]
    out = {"eager_ms": _totals([(w.family, w.dur) for w in eager]), "eager_items": len(eager)}
    if not replays:
        out.update(source="eager", family_ms=out["eager_ms"], items=len(eager), matched=1.0)
    else:
        names = [w.name for w in eager]
        per_replay, matched, counts = [], [], []
        for r in range(replays):
            run = [w for w in work if w.phase == f"replay{r}"]
            match = align([w.name for w in run], names)
            per_replay.append(_totals([(eager[j].family if j is not None else name_family(w.name) or "other", w.dur)
                                       for w, j in zip(run, match)]))
            matched.append(sum(j is not None for j in match) / max(1, len(run)))
            counts.append(len(run))
        out.update(source="graph replay", items=counts[-1], matched=min(matched),
                   family_ms={f: statistics.median(p[f] for p in per_replay) for f in FAMILIES})
    out["total_ms"] = sum(out["family_ms"].values())
    out["share"] = {f: v / out["total_ms"] if out["total_ms"] else 0.0 for f, v in out["family_ms"].items()}
    top: dict[str, float] = {}
    for w in eager:
        top[w.name] = top.get(w.name, 0.0) + w.dur / 1e3
    out["top_eager_kernels_ms"] = dict(sorted(top.items(), key=lambda kv: -kv[1])[:12])
    return out


def breakdown(model: torch.nn.Module, eager_fn: Callable[[], object], replay_fn: Callable[[], object] | None,
              replays: int = 3) -> dict:
    """Profile `eager_fn` once under the family scopes, then `replay_fn` (a graph replay of the same
    forward; None on CPU) `replays` times; returns `summarise`'s family times."""
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def synced(fn):
        fn()
        if cuda:
            torch.cuda.synchronize(device)

    with torch.no_grad(), profile(activities=activities) as prof:
        with family_scopes(model), record_function(PHASE + "eager"):
            synced(eager_fn)
        for r in range(replays if replay_fn is not None else 0):
            with record_function(f"{PHASE}replay{r}"):
                synced(replay_fn)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    return summarise(attribute(events), replays if replay_fn is not None else 0)

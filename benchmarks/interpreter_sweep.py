"""Runs Triton launches under the interpreter for benchmarks/bounds_real_widths.py: each case's kernels once with every
masked-on load and store checked against the launch's tensors (tests/interpreter_bounds.py), its outputs NaN-poisoned
first (as tests/kernels/conftest.py's `poison`), long grid axes cut to their boundary programs, the finished outputs
compared with the torch reference; one table row printed per case.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from interpreter_bounds import bounds_checked

# ---- the interpreter: sampled grids, poisoned outputs ------------------------------------------------------------


class Runner:
    """Runs one case: grids (sampled or full) recorded, outputs poisoned, every access bounds-checked."""

    def __init__(self, full: bool):
        import triton.runtime.interpreter as interp

        self.interp, self.full = interp, full
        self.launches: list[str] = []
        self.rows: list[dict] = []  # one per case run
        self.picks: dict = {}  # (kernel name, axis) -> program ids to run, or f(n, launch) -> ids (launch: the
        # kernel's earlier launches in this case, for entry points that launch one kernel over slices of the rows)
        self.count: dict = {}  # kernel name -> launches so far in this case
        self.case_full = False  # this case runs every program (cheap grids, in-place outputs)

    def axis(self, name: str, a: int, n: int) -> list[int]:
        if (name, a) in self.picks:
            pick = self.picks[(name, a)]
            pick = pick(n, self.count.get(name, 0)) if callable(pick) else pick
            return [i for i in pick if 0 <= i < n]
        if self.full or self.case_full or n <= 6:
            return list(range(n))
        return sorted({0, 1, n // 2, n - 2, n - 1})

    @contextlib.contextmanager
    def patched(self):
        interp, runner = self.interp, self
        real_call = interp.GridExecutor.__call__

        def call(ex, *args_dev, **kwargs):  # GridExecutor.__call__ of triton 3.x with the program loop sampled
            spec = inspect.getfullargspec(ex.fn)
            kwargs = {k: v for k, v in kwargs.items() if k in spec.args or k in spec.kwonlyargs}
            args_hst, kwargs_hst = ex._init_args_hst(args_dev, kwargs)
            for hook in ex.pre_run_hooks:
                hook(*args_hst, **kwargs_hst)
            scope = interp._patch_lang(ex.fn)
            try:
                args = inspect.getcallargs(ex.fn, *args_hst, **kwargs_hst)
                args = {k: v if k in ex.constexprs else interp._implicit_cvt(v) for k, v in args.items()}
                grid = ex.grid(args) if callable(ex.grid) else ex.grid
                grid = tuple(grid) + (1,) * (3 - len(grid))
                interp.interpreter_builder.set_grid_dim(*grid)
                name = ex.fn.__name__
                axes = [runner.axis(name, a, n) for a, n in enumerate(grid)]
                runner.count[name] = runner.count.get(name, 0) + 1
                ran = math.prod(len(a) for a in axes)
                total = math.prod(grid)
                runner.launches.append(f"{name.strip('_')}{[g for g in grid if g > 0]}"
                                       + ("" if ran == total else f"~{ran}"))
                for x in axes[0]:
                    for y in axes[1]:
                        for z in axes[2]:
                            interp.interpreter_builder.set_grid_idx(x, y, z)
                            ex.fn(**args)
            finally:
                scope.restore()
            ex._restore_args_dev(args_dev, args_hst, kwargs, kwargs_hst)

        interp.GridExecutor.__call__ = call
        try:
            yield
        finally:
            interp.GridExecutor.__call__ = real_call


POISON_INT = 123456789


@contextlib.contextmanager
def poisoned():
    """torch.empty / empty_like filled with NaN (ints: POISON_INT), as tests/kernels/conftest.py's `poison`."""
    real_empty, real_like = torch.empty, torch.empty_like

    def fill(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype in (torch.int32, torch.int64):
            t.fill_(POISON_INT)
        return t

    torch.empty = lambda *a, **k: fill(real_empty(*a, **k))
    torch.empty_like = lambda *a, **k: fill(real_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_like


def finished(t) -> torch.Tensor:
    """The entries of a poisoned output that a kernel wrote (finite / not POISON_INT)."""
    return torch.isfinite(t) if t.is_floating_point() else t != POISON_INT


def compare(got, ref, atol: float, rtol: float) -> tuple[str, bool]:
    """(text, ok) over the entries the kernels finished of each output; ref() (the torch reference, called only when
    some entries finished: at the real widths it can take longer than the sampled kernels) gives the expected ones."""
    gots = list(got) if isinstance(got, (tuple, list)) else [got]
    gots = [g.detach().cpu() if g is not None else None for g in gots]
    done = sum(int(finished(g).sum()) for g in gots if g is not None)
    total = sum(g.numel() for g in gots if g is not None)
    if done == 0:
        return f"0/{total} (sampled)", True
    want = ref()
    wants = list(want) if isinstance(want, (tuple, list)) else [want]
    worst, ok = 0.0, True
    for g, w in zip(gots, wants):
        if g is None or w is None:
            continue
        w = w.detach().cpu().to(g.dtype)
        fin = finished(g)
        if not fin.any():
            continue
        if g.is_floating_point():
            d = (g[fin].float() - w[fin].float()).abs()
            lim = atol + rtol * w[fin].float().abs()
            ok &= bool((d <= lim).all())
            worst = max(worst, float(d.max()))
        else:
            bad = int((g[fin] != w[fin]).sum())
            ok &= bad == 0
            worst = max(worst, bad)
    return f"{done}/{total} {'ok' if ok else 'WRONG'} d={worst:.2g}", ok


def case(runner: Runner, kernel: str, rows: int, path: str, shapes: str, config: str, fn, ref=None,
         tol=(2e-2, 2e-2), picks: dict | None = None, full: bool = False) -> None:
    """Run fn() once bounds-checked (sampled grids, poisoned outputs), compare with ref() where given, print a row."""
    runner.launches, runner.picks, runner.case_full, runner.count = [], picks or {}, full, {}
    t0 = time.perf_counter()
    err, out, cmp_text = "", None, "-"
    try:
        with runner.patched(), poisoned(), bounds_checked(raise_at_exit=False) as violations:
            out = fn()
    except Exception as e:  # noqa: BLE001 - a failing case is a row of the table, not the end of the sweep
        err = f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        violations = []
    secs = time.perf_counter() - t0
    ok_cmp = True
    if not err and ref is not None:
        cmp_text, ok_cmp = compare(out, ref, *tol)
    status = err or (f"OUT OF BOUNDS ({len(violations)}): {violations[0]}" if violations else "OK")
    launches = Counter(runner.launches)  # an entry point that loops (experts, row slices): one item, "xN"
    grid = " ".join(f"{g} x{n}" if n > 1 else g for g, n in launches.items())
    row = {"kernel": kernel, "rows": rows, "path": path, "shapes": shapes, "grid": grid,
           "config": config, "status": status, "cmp": cmp_text, "s": secs,
           "ok": not violations and not err and ok_cmp}
    runner.rows.append(row)
    print(f"| {kernel} | {rows} | {path} | {shapes} | {row['grid']} | {config} | {status} | {cmp_text} | "
          f"{secs:.1f} |", flush=True)


def short(cfg: dict, keys) -> str:
    return " ".join(f"{k}={cfg[k]}" for k in keys if k in cfg)


def sweep_main(doc: str, sections: dict, add_args=None, full_help: str = "every program of every grid",
               argv=None) -> int:
    """The command line of a sweep script: --only SECTIONS (each `fn(runner, gen, args)`), --full, --experts (MoE cases'
    routed experts; `add_args(parser)` adds the script's own), the table's header, each section in turn, a summary of
    the cases not OK; exit status 1 when any is not."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(sections), help=f"comma-separated sections of {list(sections)}")
    ap.add_argument("--full", action="store_true", help=full_help)
    if add_args is not None:
        add_args(ap)
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("run under the Triton interpreter: TRITON_INTERPRET=1")
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    gen = torch.Generator().manual_seed(0)
    runner = Runner(args.full)
    print("| kernel | rows | path | shapes | grid (~programs run) | config | bounds | compared | s |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for name in args.only.split(","):
        sections[name](runner, gen, args)
    bad = [r for r in runner.rows if not r["ok"]]
    print(f"\n{len(runner.rows)} cases, {len(bad)} not OK" + "".join(f"\n  {r['kernel']} {r['rows']} {r['path']}: "
                                                            f"{r['status']} {r['cmp']}" for r in bad))
    return 1 if bad else 0

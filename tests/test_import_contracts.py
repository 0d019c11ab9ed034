"""Imports go one way (docs/architecture.md): the import-linter contracts of pyproject.toml hold, and no
revolta module imports itself through others (TYPE_CHECKING imports count: they are what a reader follows)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def _env() -> dict[str, str]:
    """This checkout's sources first (an editable install may point at another worktree)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def test_import_linter_contracts_hold():
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is missing: pip install -e '.[test]' (import-linter is in the test extra)")
    run = subprocess.run([exe, "--no-cache", str(ROOT / "pyproject.toml")], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"lint-imports failed:\n{run.stdout}\n{run.stderr}"


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycles_among_revolta_modules():
    sys.path.insert(0, str(SRC))
    try:
        graph = grimp.build_graph("revolta", include_external_packages=False, cache_dir=None)
    finally:
        sys.path.remove(str(SRC))
    assert graph.find_modules_directly_imported_by("revolta.engine.engine"), "the graph is empty: wrong package?"
    cycles = _cycles(graph)
    report = []
    for comp in cycles:
        edges = [f"  {a} -> {b}" for a in comp for b in sorted(graph.find_modules_directly_imported_by(a)) if b in comp]
        report.append(f"cycle of {len(comp)} modules:\n" + "\n".join(edges))
    assert not cycles, "\n".join(report)

"""The notebooks run top to bottom headless, are stored without outputs and use only public names.

Each notebook runs in its own ipykernel ("python3"; jupyter_client starts it with this test's
interpreter) with the repository root as working directory, so relative paths such as
`benchmarks/RESULTS.md` resolve, and with this checkout's `revolta` first on PYTHONPATH, so the
notebook exercises the code under test rather than some other install.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300
IDS = [p.stem for p in NOTEBOOKS]


def _code_cells(nb) -> list[str]:
    return [c.source for c in nb.cells if c.cell_type == "code"]


def _kernel_env() -> dict[str, str]:
    import revolta

    src = str(Path(revolta.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([src] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    # the notebooks run many tiny ops; one intra-op thread avoids thread hand-off costs that dominate
    # at these sizes (10x on a shared 2-core machine) and does not change any result
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


# notebook -> a module it needs that lands on another branch (the lead merges them)
REQUIRES = {"04_speculative_decoding": "revolta.spec"}


def test_the_five_notebooks_exist():
    assert IDS == ["01_quickstart", "02_model_walkthrough", "03_kernels", "04_speculative_decoding", "05_cache"], IDS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name} cell {i} has outputs"


def private_names(source: str) -> list[str]:
    """Underscore names a cell imports or reaches through an attribute (dunders such as
    `__version__` are public)."""
    def private(name: str) -> bool:
        return any(part.startswith("_") and not (part.startswith("__") and part.endswith("__"))
                   for part in name.split("."))

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if private(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.module and private(node.module):
                found.append(node.module)
            found += [f"{node.module}.{a.name}" for a in node.names if private(a.name)]
        elif isinstance(node, ast.Attribute) and private(node.attr):
            found.append(node.attr)
    return found


def test_private_name_check_catches_private_use():
    assert private_names("from revolta.layers.ngram import _is_prime") == ["revolta.layers.ngram._is_prime"]
    assert private_names("import revolta._x") == ["revolta._x"]
    assert private_names("from revolta.model import _Backbone as B") == ["revolta.model._Backbone"]
    assert private_names("llm._step()") == ["_step"]
    assert private_names("import revolta\nprint(revolta.__version__, llm.model_path)") == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_public_api_only(path):
    nb = nbformat.read(path, as_version=4)
    found = [name for src in _code_cells(nb) for name in private_names(src)]
    assert not found, f"{path.name} uses private names: {found}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_runs_top_to_bottom_with_a_picture(path):
    if path.stem in REQUIRES:
        pytest.importorskip(REQUIRES[path.stem], reason=f"{path.name} needs {REQUIRES[path.stem]} (MTP branch)")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute(env=_kernel_env())  # raises CellExecutionError on the first failing cell
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.get("output_type") in ("display_data", "execute_result") and "image/png" in o.get("data", {})]
    assert images, f"{path.name} drew no picture"

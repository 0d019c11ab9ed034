"""A newcomer's mistakes end in one line that names the fix, not a traceback (issue 18 item 5), and a Volta GPU
under a Triton that computes fp16 tl.dot wrong is refused at start-up (item 7).

Each command path runs as a subprocess, as a user would meet it; a missing package is simulated by a module on
PYTHONPATH that raises ModuleNotFoundError on import. Every case fails before a model loads (a few seconds each).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import revolta
from revolta import LLM, load_model
from revolta.device import MIN_TRITON_FOR_VOLTA, DeviceError, check_triton, resolve_device

ROOT = Path(__file__).resolve().parents[1]
SRC = str(Path(revolta.__file__).resolve().parents[1])


def _missing(tmp_path: Path, *modules: str) -> str:
    """A PYTHONPATH entry on which importing each of `modules` fails as if it were not installed."""
    shim = tmp_path / "shim"
    for name in modules:
        (shim / name).mkdir(parents=True)
        error = f"ModuleNotFoundError(\"No module named {name!r}\", name={name!r})"
        (shim / name / "__init__.py").write_text(f"raise {error}\n")
    return str(shim)


def _run(args: list[str], tmp_path: Path, pythonpath: list[str] = ()) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*pythonpath, SRC]), "REVOLTA_CACHE": str(tmp_path / "cache")}
    env.pop("REVOLTA_DEBUG", None)
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=120)


def _one_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("revolta: error: "), proc.stderr
    return lines[0]


@pytest.mark.parametrize("package", ["fastapi", "uvicorn"])
def test_serve_without_the_server_extra(package, tmp_path):
    proc = _run(["-m", "revolta.cli", "serve"], tmp_path, [_missing(tmp_path, package)])
    line = _one_line(proc)
    assert f"({package} is not installed)" in line and "pip install 'revolta[server]'" in line
    assert not (tmp_path / "cache").exists()  # refused before the embedded default is built


@pytest.mark.parametrize("device,needle", [("cuda", "does not exist on this machine"),
                                           ("cuda:64", "does not exist on this machine"),
                                           ("tpu", "is not a device name")])
def test_generate_on_a_device_that_does_not_exist(device, needle, tmp_path):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = _run(["-m", "revolta.cli", "generate", "--device", device, "hi"], tmp_path)
    line = _one_line(proc)
    assert f"device {device!r} {needle}" in line and "available here: cpu" in line
    assert not (tmp_path / "cache").exists()  # refused before the embedded default is built


def test_notebook_01_names_its_install_line(tmp_path):
    """Its first cell gives the install line; without matplotlib its install check stops with that line."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(ROOT / "notebooks" / "01_quickstart.ipynb", as_version=4)
    assert "pip install" in nb.cells[0].source and ".[notebooks]" in nb.cells[0].source
    nb.cells = nb.cells[:2]  # the title and the install check
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([_missing(tmp_path, "matplotlib"), SRC])}
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    with pytest.raises(nbclient.exceptions.CellExecutionError) as failed:
        client.execute(env=env)
    error = next(o for o in nb.cells[1].outputs if o.output_type == "error")
    assert error.ename == "SystemExit" and "pip install 'revolta[notebooks]'" in error.evalue, failed.value


# ---- Triton on Volta -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("capability,version,refused", [
    ((7, 0), "3.3.1", True), ((7, 5), "3.2.0", True), ((7, 0), "3.4.0", False), ((7, 0), "3.9.0", False),
    ((7, 0), "3.3.0+git4f6a", True), ((7, 0), "3.4.0rc1", False), ((7, 0), None, False),  # None: no Triton
    ((8, 0), "3.2.0", False), ((9, 0), "3.3.1", False), ((6, 1), "3.3.1", False),
])  # fmt: skip
def test_check_triton(capability, version, refused):
    if refused:
        fix = r"fp16 tl.dot wrong .* 3478, 4037\); upgrade it: pip install 'triton>=3.4'"
        with pytest.raises(DeviceError, match=fix):
            check_triton(capability, version)
    else:
        check_triton(capability, version)


@pytest.fixture
def fake_volta(monkeypatch):
    """One CUDA device of compute capability 7.0, as torch would report a V100; the test sets the Triton version."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))

    def triton(version: str) -> None:
        monkeypatch.setattr("revolta.device.triton_version", lambda: version)
    return triton


def test_a_volta_device_under_an_old_triton_is_refused_at_start_up(fake_volta, tmp_path):
    fake_volta("3.3.1")
    for start in (lambda: resolve_device(None), lambda: resolve_device("cuda:0"),
                  lambda: LLM(model=tmp_path / "none", device="cuda"),  # before the checkpoint is even looked at
                  lambda: load_model(tmp_path, device="cuda")):  # before its (absent) config.json is read
        with pytest.raises(DeviceError, match="triton 3.3.1 computes fp16 tl.dot wrong"):
            start()
    fake_volta("3.4.0")
    assert resolve_device(None) == torch.device("cuda")
    with pytest.raises(DeviceError, match="'cuda:1' does not exist on this machine; available here: cpu, cuda:0"):
        resolve_device("cuda:1")


def test_pyproject_requires_the_fixed_triton():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"triton>={'.'.join(map(str, MIN_TRITON_FOR_VOLTA))}" in deps

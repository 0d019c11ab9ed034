import os
import sys

# Under pytest-xdist (the README's test command runs `-n 2` on the 2-core CI machine) each worker is one of n
# processes sharing the cores: with an OpenMP thread per core in every worker they spin against each other (single
# tests ran 7-11x slower). One intra-op thread per worker, and for every process a test starts (servers, ranks).
XDIST_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))
if XDIST_WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

if XDIST_WORKER:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # also where a plugin imported torch first

# Without a GPU, Triton kernels run in the interpreter. The flag is read when a kernel is
# decorated, so it must be set before any revolta.kernels module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence Triton 3.9's default-change warning
# speculative tests count rounds and acceptance: draft every decode step unless a test asks for the adaptive
# policy (engine/spec_policy.py), whose choices follow wall time
os.environ.setdefault("REVOLTA_SPEC_DRAFT_POLICY", "always")
# "default" / LLM() name the random-weight preset in tests (small, fast, fixed shapes); tests of the trained default
# name it ("trained-default") or set REVOLTA_DEFAULT_MODEL=trained themselves
os.environ.setdefault("REVOLTA_DEFAULT_MODEL", "random")

import pytest  # noqa: E402

# tests/parity holds the oracle helpers (hf_oracle.py), tests/engine the engine-test helpers that spec and
# GPU tests reuse (test_engine.run, test_spec_engine.make_engine), tests/ple the PLE checkpoint writer
# (test_placement.write_checkpoint), tests/quant the tool-written quantized checkpoints (quant_checkpoints);
# make them importable by name
for _helpers in ("parity", "engine", "ple", "quant"):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), _helpers))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_dir(tmp_path_factory):
    """The embedded default preset, built once per session into a temporary cache root."""
    from revolta.presets import default as preset

    return preset.ensure_default_model(tmp_path_factory.getbasetemp() / "revolta_cache")


@pytest.fixture(autouse=True)
def _bounds_checked_kernels(request):
    """Every interpreted Triton load and store of a test is checked against its launch's tensors
    (tests/interpreter_bounds.py), and a test whose kernels touched memory outside them errors at teardown: on a GPU
    such an access is an illegal memory access far from its kernel, or silent corruption. On for tests/kernels (about
    20% slower there); REVOLTA_BOUNDS_CHECK=1 turns it on for every test, =0 off. Needs the interpreter."""
    flag = os.environ.get("REVOLTA_BOUNDS_CHECK")
    on = flag == "1" or (flag != "0" and request.node.path.parent.name == "kernels")
    if not on or os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from interpreter_bounds import bounds_checked

    with bounds_checked():
        yield

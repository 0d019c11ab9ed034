"""Pins the kernels one M = 1 decode step launches per layer type (benchmarks/launch_census.py, issue 19):
a change that adds launches to the decode path fails here and names the layer type that grew.

The census runs the stand-in's layer pattern (GDN GDN GDN QSA, PLE at layer 2) at the embedded default's
widths in fp16 on the Triton path, under the interpreter, as the decode CUDA graph captures the step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import launch_census as L  # noqa: E402

# kernels per instance of each layer type at M = 1 (before the issue-19 fusions: setup 23, PLE 105, HC read 3,
# HC write 1, GDN 16, QSA 45, MoE 7, final 20; 1,996 per step at the real 48-layer pattern)
PINNED = {L.SETUP: 23, L.PLE: 78, L.HC_READ: 3, L.HC_WRITE: 1, L.GDN: 9, L.QSA: 15, L.MOE: 6, L.FINAL: 6}
PINNED_GLUE = 1  # the PLE layer's residual add, once per step
INSTANCES = {L.PLE: 1, L.HC_READ: 8, L.HC_WRITE: 8, L.GDN: 3, L.QSA: 1, L.MOE: 4, L.FINAL: 1, L.GLUE: 4}


@pytest.fixture(scope="module")
def census():
    return L.decode_census(L.tiny_model(torch.float16), rows=1, prompt_len=0)


def test_decode_launches_per_layer_type_are_pinned(census):
    assert {k: census.instances[k] for k in INSTANCES} == INSTANCES, "the census lost track of the layers"
    grown = []
    for label, pinned in PINNED.items():
        got = census.per_instance(label)
        if got != pinned:
            grown.append(f"{label}: {got:g} kernels per instance, pinned {pinned} "
                         f"({'grew' if got > pinned else 'shrank'}); now {census.first_instance(label)}")
    glue = len(census.launches[L.GLUE])
    if glue != PINNED_GLUE:
        grown.append(f"{L.GLUE}: {glue} kernels per step, pinned {PINNED_GLUE}: {census.launches[L.GLUE]}")
    assert not grown, ("decode launches changed (update PINNED in tests/test_launch_census.py only when "
                       "the change is meant):\n" + "\n".join(grown))
    # the full-depth figure the report quotes follows from the same counts
    counts = census.counts()
    assert L.full_depth_total(counts) == pytest.approx(1295.0)


def test_only_kernel_launching_ops_count():
    aten = torch.ops.aten
    assert L.kernel_name(aten.view.default) is None and L.kernel_name(aten.expand.default) is None
    assert L.kernel_name(aten.empty.memory_format) is None and L.kernel_name(aten.split.Tensor) is None
    assert L.kernel_name(aten._to_copy.default) == "_to_copy" and L.kernel_name(aten.mm.default) == "mm"
    assert L.kernel_name(aten.clone.default) == "clone"

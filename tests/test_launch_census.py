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

# kernels per instance of each layer type at M = 1 (per step for the step setup, the PLE layer, the layer glue and
# the final mixer). Before the issue-19 fusions: setup 23, PLE 105, HC read 3 (x 8), HC write 1 (x 8), GDN 16,
# QSA 45, MoE 7, glue 1, final 20: 299 here, 1,985 per step at the real 48-layer pattern. The merged input
# projections (layers/merged_linear.py) took GDN from 8 to 5 and QSA from 14 to 11 (1,141 -> 997 per step), the
# merged router and shared-expert gate MoE from 6 to 5 (997 -> 949), the n-gram row ids in one kernel
# (kernels/ple_rows.py) PLE from 78 to 20 (949 -> 891).
PINNED = {L.SETUP: 23, L.PLE: 20, L.HC_READ: 3, L.HC_WRITE: 1, L.HC_WRITE_READ: 3, L.GDN: 5, L.QSA: 11, L.MOE: 5,
          L.GLUE: 1, L.FINAL: 6}
# the first layer's attention read and the PLE layer's (its write goes first, standalone) read no pending write
INSTANCES = {L.HC_READ: 2, L.HC_WRITE: 1, L.HC_WRITE_READ: 6, L.GDN: 3, L.QSA: 1, L.MOE: 4, L.GLUE: 4}
FULL_DEPTH = 891


@pytest.fixture(scope="module")
def census():
    return L.decode_census(L.tiny_model(torch.float16), rows=1, prompt_len=0)


def test_decode_launches_per_layer_type_are_pinned(census):
    assert {k: census.instances[k] for k in INSTANCES} == INSTANCES, "the census lost track of the layers"
    changed = []
    for label, pinned in PINNED.items():
        got = census.per_instance(label)
        if got != pinned:
            changed.append(f"{label}: {got:g} kernels per {'step' if label in L.PER_STEP else 'instance'}, pinned "
                           f"{pinned} ({'grew' if got > pinned else 'shrank'}); now {census.first_instance(label)}")
    assert not changed, ("decode launches changed (update PINNED in tests/test_launch_census.py only when "
                         "the change is meant):\n" + "\n".join(changed))
    assert L.full_depth_total(census, num_layers=4) == FULL_DEPTH  # the figure the report quotes


def test_only_kernel_launching_ops_count():
    aten = torch.ops.aten
    assert L.kernel_name(aten.view.default) is None and L.kernel_name(aten.expand.default) is None
    assert L.kernel_name(aten.empty.memory_format) is None and L.kernel_name(aten.split.Tensor) is None
    assert L.kernel_name(aten._to_copy.default) == "_to_copy" and L.kernel_name(aten.mm.default) == "mm"
    assert L.kernel_name(aten.clone.default) == "clone"

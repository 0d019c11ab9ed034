"""Programmatic dependent launch (PDL, sm_90+) for chains of small kernels: a kernel launched with
`launch_pdl=True` may be scheduled while the grid before it still runs; it waits inside (`gdc_wait`)
until that grid has finished and its writes are visible, so what PDL saves is the launch latency and
the ramp-up between two dependent grids, not any ordering. Every kernel of such a chain calls
`pdl_start` before its first global read or write, so a chain is exactly as ordered as plain launches
(also against kernels launched without PDL, which the wait covers as well). The HyperConnection kernels
(hc.py, hc_dot.py) place their own waits (weight loads issued before `gdc_wait`) and share the host side here:
`pdl_allowed`, `pdl_launch`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """With PDL: wait for the grids before this one (their writes visible from here on), then let the next grid
    of the stream be scheduled (its programs wait in their own pdl_start). Without: nothing."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_allowed(arch: int | None) -> bool:
    """Whether kernels may launch with PDL on compute capability `arch` (70, 90; None: not a CUDA device): sm_90 or
    later, and not under the Triton interpreter (which has no grid dependency control)."""
    return arch is not None and arch >= 90 and os.environ.get("TRITON_INTERPRET", "0") == "0"


def use_pdl(x: Tensor, wanted: bool) -> bool:
    """Whether kernels working on x's device launch with PDL: asked for and `pdl_allowed` there (the device is
    only queried when asked)."""
    if not (wanted and x.is_cuda):
        return False
    major, minor = torch.cuda.get_device_capability(x.device)
    return pdl_allowed(10 * major + minor)


def pdl_launch(pdl: bool) -> dict:
    """The launch keywords of a kernel launched with PDL (or none)."""
    return dict(launch_pdl=True) if pdl else {}

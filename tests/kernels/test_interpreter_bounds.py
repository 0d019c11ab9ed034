"""The interpreter bounds checker (tests/interpreter_bounds.py) catches what it is for: a masked-on lane one element
past a tensor, for loads and stores, and lets in-bounds and masked-off accesses through (a Triton update that renamed
the interpreter's hooks would otherwise turn every bounds-checked test into a silent pass)."""

import pytest
import torch
import triton
import triton.language as tl

from interpreter_bounds import OutOfBounds, bounds_checked


@triton.jit
def _shift_copy(x, y, N, SHIFT: tl.constexpr, LIMIT: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(y + o + SHIFT, tl.load(x + o + SHIFT, mask=o < LIMIT), mask=o < LIMIT)


def test_in_bounds_and_masked_off_lanes_pass():
    x, y = torch.arange(8.0), torch.zeros(8)
    with bounds_checked() as violations:
        _shift_copy[(1,)](x, y, 8, SHIFT=1, LIMIT=7, BLOCK=8)  # lane 7 would read x[8]: masked off
    assert not violations and torch.equal(y[1:], x[1:])


@pytest.mark.parametrize("what", ["load", "store"])
def test_one_element_past_the_end_is_caught(what):
    x, y = (torch.arange(9.0), torch.zeros(8)) if what == "store" else (torch.arange(8.0), torch.zeros(9))
    with pytest.raises(OutOfBounds, match=f"{what} out of bounds in _shift_copy"):
        with bounds_checked():
            _shift_copy[(1,)](x, y, 8, SHIFT=1, LIMIT=8, BLOCK=8)

"""Out-of-bounds accesses of Triton kernels run by the interpreter (TRITON_INTERPRET=1).

`bounds_checked()` patches the interpreter so that every address a load or store touches with its mask on must lie
inside the storage of one tensor argument of that launch. On a GPU such an access reads or writes a neighbour's
bytes or, past the end of an allocator segment, faults: a CUDA illegal memory access, reported asynchronously by
some later call, far from the kernel. The interpreter itself checks nothing. Offending lanes are masked off (so the
run stays safe) and recorded; leaving the block raises OutOfBounds naming the kernel, the program and the nearest
argument, and `violations` lists them all.

    with bounds_checked():
        index_compress(...)
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pytest
import triton.runtime.interpreter as interp


class OutOfBounds(AssertionError):
    pass


@dataclass
class _Arg:
    name: str
    lo: int
    hi: int
    shape: tuple[int, ...]


@dataclass
class _Launch:
    kernel: str = "?"
    args: tuple[_Arg, ...] = ()


def _arguments(names, args_hst, kwargs_hst) -> tuple[_Arg, ...]:
    out = []

    def add(name, a):
        if isinstance(a, tuple):
            for i, x in enumerate(a):
                add(f"{name}[{i}]", x)
        elif hasattr(a, "data_ptr"):
            st = interp._unwrap_tensor(a).untyped_storage()
            out.append(_Arg(name, st.data_ptr(), st.data_ptr() + st.nbytes(), tuple(a.shape)))

    for name, a in list(zip(names, args_hst)) + list(kwargs_hst.items()):
        add(name, a)
    return tuple(out)


@contextmanager
def bounds_checked(raise_at_exit: bool = True):
    """Check every interpreted load and store inside the block (see the module docstring); yields the list of
    violation messages. Skips the test off the interpreter (compiled kernels are not checked)."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        pytest.skip("bounds checks need the Triton interpreter (TRITON_INTERPRET=1)")
    launch, violations = _Launch(), []
    init, load, store = (interp.GridExecutor._init_args_hst, interp.InterpreterBuilder.create_masked_load,
                         interp.InterpreterBuilder.create_masked_store)

    def checked_init(self, args_dev, kwargs):
        args_hst, kwargs_hst = init(self, args_dev, kwargs)
        launch.kernel = getattr(self.fn, "__name__", str(self.fn))
        launch.args = _arguments(self.arg_names, args_hst, kwargs_hst)
        return args_hst, kwargs_hst

    def in_bounds(ptrs, mask, what):
        """The mask with lanes outside every argument's storage turned off (each recorded)."""
        addr = np.asarray(ptrs.data).astype(np.uint64)
        on = np.broadcast_to(np.asarray(mask.data), addr.shape).astype(bool)
        size = np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize
        inside = np.zeros(addr.shape, dtype=bool)
        for a in launch.args:
            inside |= (addr >= a.lo) & (addr + size <= a.hi)
        bad = on & ~inside
        if bad.any():
            first = int(addr[bad].ravel()[0])
            near = min(launch.args, key=lambda a: min(abs(first - a.lo), abs(first - a.hi)))
            violations.append(f"{what} out of bounds in {launch.kernel} program {interp.interpreter_builder.grid_idx}: "
                              f"{int(bad.sum())} of {int(on.sum())} lanes; the first is {first - near.lo} bytes from "
                              f"the start of {near.name} {list(near.shape)} ({near.hi - near.lo} bytes)")
            mask = interp.TensorHandle(on & inside, mask.dtype)
        return mask

    def checked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        return load(self, ptrs, in_bounds(ptrs, mask, "load"), other, cache_policy, is_volatile)

    def checked_store(self, ptrs, value, mask, cache_policy):
        return store(self, ptrs, value, in_bounds(ptrs, mask, "store"), cache_policy)

    interp.GridExecutor._init_args_hst = checked_init
    interp.InterpreterBuilder.create_masked_load = checked_load
    interp.InterpreterBuilder.create_masked_store = checked_store
    try:
        yield violations
    finally:
        interp.GridExecutor._init_args_hst = init
        interp.InterpreterBuilder.create_masked_load = load
        interp.InterpreterBuilder.create_masked_store = store
    if violations and raise_at_exit:
        raise OutOfBounds(f"{len(violations)} out-of-bounds accesses; the first: {violations[0]}")

import numpy as np
import pytest
import torch


@pytest.fixture
def poison(monkeypatch):
    """NaN-poison torch.empty / empty_like so a kernel that leaves part of an output unwritten fails."""
    real_empty, real_like = torch.empty, torch.empty_like

    def fill(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype in (torch.int32, torch.int64):
            t.fill_(123456789)
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(real_like(*a, **k)))


@pytest.fixture
def bf16_dots(monkeypatch):
    """The interpreter stores bf16 as uint16 and runs tl.dot and + - * / on those bits: both get fp32 operands here
    (exact), and arithmetic results are rounded back to bf16 (nearest even), as on the GPU."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    def f32(h):
        return (h.data.astype(np.uint32) << 16).view(np.float32)

    def bf16(a):
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(
            np.uint16)

    real_dot, real_op = InterpreterBuilder.create_dot, InterpreterBuilder.binary_op

    def dot(self, a, b, d, *args):
        a, b = (TensorHandle(f32(h), tl.float32) if h.dtype.scalar.name == "bf16" else h for h in (a, b))
        return real_dot(self, a, b, d, *args)

    def binary_op(self, lhs, rhs, op):
        if lhs.dtype.scalar.name != "bf16":
            return real_op(self, lhs, rhs, op)
        return TensorHandle(bf16(op(f32(lhs), f32(rhs))), lhs.dtype.scalar)

    monkeypatch.setattr(InterpreterBuilder, "create_dot", dot)
    monkeypatch.setattr(InterpreterBuilder, "binary_op", binary_op)

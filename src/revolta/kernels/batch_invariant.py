"""Row-invariant decode and verify steps on the CPU torch path: a row's result does not
depend on how many rows share the step.

Two CPU effects break that (both measured here): BLAS picks its GEMM kernel by the shape of the
whole product, so row r of `x @ W.T` differs in the last bits between 1, 2 and 40 rows (MKL,
batched GEMM at small K included); and ATen's vectorised transcendental kernels (exp, sigmoid,
silu, ...) compute SIMD lanes with a vector approximation and the loop tail with the scalar
libm one, so an element's result depends on its offset in the tensor. Speculative decoding
verifies 1 + k rows per request where decoding without it computes one, and its contract is
bitwise equal greedy output and committed recurrent state. Inside `row_invariant()`:

- every 2-D product (F.linear, matmul, mm, @) is computed one row at a time;
- every transcendental elementwise op (and softmax) on a tensor of rows is applied one row at
  a time;
each row first copied to its own contiguous buffer, so it is computed exactly as a lone decode
row (which goes through the same per-row path). Correctly rounded arithmetic (+ - * /, sqrt),
row-local reductions and the per-row attention and recurrence references are invariant already.
The engine uses it for decode and verify steps only: their row counts are small (at most
max_num_seqs x (1 + drafts)); prefill chunks keep the fast batched kernels.
"""

from __future__ import annotations

import contextlib

import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

_MATMULS = ("matmul", "mm", "__matmul__")  # torch.*, Tensor.* and `@` reach the mode under these names
# elementwise ops whose CPU kernels differ between SIMD lanes and the scalar tail, and softmax-likes
_PER_ROW = frozenset({"exp", "expm1", "log", "log1p", "sigmoid", "silu", "softplus", "tanh", "erf", "gelu", "rsqrt",
                      "softmax", "log_softmax", "logsigmoid"})


def rows_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x [..., K], weight [N, K], bias [N]) -> [..., N], every row a separate 1-row call."""
    flat = x.reshape(-1, x.shape[-1])
    out = flat.new_empty(flat.shape[0], weight.shape[0])
    for r in range(flat.shape[0]):
        out[r] = F.linear(flat[r:r + 1].clone(), weight, bias)[0]
    return out.view(*x.shape[:-1], weight.shape[0])


def rows_mm(a: Tensor, b: Tensor) -> Tensor:
    """a [M, K] @ b [K, N] -> [M, N], every row a separate 1-row product."""
    out = a.new_empty(a.shape[0], b.shape[1])
    for r in range(a.shape[0]):
        out[r] = (a[r:r + 1].clone() @ b)[0]
    return out


def _row_dim_ok(x: Tensor, args: tuple, kwargs: dict) -> bool:
    """False when a softmax-like op reduces over dim 0 (the rows themselves)."""
    dim = kwargs.get("dim", args[1] if len(args) > 1 and isinstance(args[1], int) else None)
    return dim is None or dim % x.dim() != 0


def per_row(func, x: Tensor, args: tuple, kwargs: dict) -> Tensor:
    """func(x, *rest) applied to each row x[r] (as a contiguous [1, ...] tensor) separately."""
    out = None
    for r in range(x.shape[0]):
        y = func(x[r:r + 1].clone(), *args[1:], **kwargs)
        if out is None:
            out = y.new_empty((x.shape[0], *y.shape[1:]))
        out[r] = y[0]
    return out if out is not None else func(x, *args[1:], **kwargs)


class RowInvariant(TorchFunctionMode):
    """Context manager: CPU 2-D products inside compute each row alone (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if isinstance(x, Tensor) and x.device.type == "cpu" and x.dim() >= 2:
                return rows_linear(x, w, b)
        elif getattr(func, "__name__", None) in _PER_ROW and args and isinstance(args[0], Tensor) \
                and args[0].dim() >= 2 and args[0].device.type == "cpu" and _row_dim_ok(args[0], args, kwargs):
            return per_row(func, args[0], args, kwargs)
        elif getattr(func, "__name__", None) in _MATMULS and not kwargs and len(args) == 2:
            a, b = args
            if isinstance(a, Tensor) and isinstance(b, Tensor) and a.dim() == 2 and b.dim() == 2 \
                    and a.device.type == "cpu":
                return rows_mm(a, b)
        return func(*args, **kwargs)


def row_invariant(enabled: bool = True):
    """`with row_invariant():` ... (a no-op context when not enabled)."""
    return RowInvariant() if enabled else contextlib.nullcontext()

"""One GEMM for the projections of a layer that read the same input (vLLM's merged column-parallel linear).

At M = 1 a projection is one launch whose cost is mostly latency: GDN reads its input with four (in_proj_qkv,
in_proj_z, in_proj_b, in_proj_a; b and a are 48 wide), QSA with four (q_proj, k_proj, v_proj,
indexer.index_qk_proj). `merge_linears` concatenates their weights into one [sum N_i + pad, K] tensor and makes
each part's parameter a row slice (a view) of it; `project` then runs one F.linear and hands the parts' outputs on
as column views of the [T, sum N_i + pad] product (that row stride: the decode kernels take row strides).

Why views instead of a second copy or renamed parameters:
- parameter names, shapes and state_dict entries stay the checkpoint's (save_checkpoint clones a tensor whose
  storage is larger than it), and the memory is not doubled;
- whatever writes weights in place writes the merged tensor: load_weights / load_state_dict (`copy_`), a TP
  rank's loader (a rank merges its LOCAL shards, so any tp works), sleep level 1 (the storage shrinks and grows
  in place) and level 2 (the reload copies into the views);
- whatever rebinds a parameter to a new tensor (`.to()`, `to_dtype`, materialize to another dtype or device)
  takes the parts off the merged tensor: `project` checks the data pointers, then runs the separate GEMMs,
  which is always correct, and `merge_linears` again brings the one GEMM back.

The merged weight has zero rows past the parts' up to a multiple of ROW_ALIGN, so the product's row stride is a
multiple of 16 bytes. Why: an odd width leaves cuBLAS only its unaligned kernels, and at 2-16 rows the one it picks
is slow. MoE's router plus its shared-expert gate is E + 1 wide (65 on the 64-expert stand-in, 513 on the real
model): on the H100 at 8 rows that GEMM took 33 us a layer (`cutlass_75_wmma_tensorop_f16_s161616gemm_f16_16x16`,
1.6 ms of a 16.8 ms C8 stand-in step and of the MTP4 verify at C1; RESULTS.md F1 run G) where one row takes a 4 us
gemv. The padding's outputs are computed and dropped (columns of a GEMM are independent); its rows are not a
parameter, so a reload that skips them (sleep level 2) leaves values that reach only those dropped columns.

Only plain 16-bit/fp32 `nn.Linear`s merge (exact type): a packed quantized layer (QuantLinear: AWQ,
compressed-tensors, NVFP4) or a parallel subclass keeps its own forward and runs alone; the plain parts of the
same group still merge when there are two or more. With autograd on and a part requiring grad (training) every
part runs separately, so gradients reach the parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROW_ALIGN = 8  # rows of the merged weight: a multiple of 8 keeps a 16-bit product's rows 16-byte aligned


@dataclass(frozen=True)
class MergedLinear:
    """The merged weight of the parts `index` (positions in the layer's part list, in order)."""

    weight: Tensor  # [sum N_i + pad, K]; the parts' rows in `index` order, sizes[j] rows each, then pad zero rows
    bias: Tensor | None  # [sum N_i + pad]; zeros where a part has no bias (has_bias False) and in the pad
    index: tuple[int, ...]
    sizes: tuple[int, ...]
    has_bias: tuple[bool, ...]


def _plain(m: nn.Module) -> bool:
    return type(m) is nn.Linear and not m.weight.is_meta


@torch.no_grad()
def merge_linears(parts: Sequence[nn.Module], merged: MergedLinear | None = None) -> MergedLinear | None:
    """Merge the plain nn.Linear `parts` (same input) into one weight and rebind each part's weight and bias to
    its rows of it (module docstring). `merged`: the layer's current merge, returned as is while it holds.
    None: fewer than two plain parts, or parts that disagree on input width, dtype or device."""
    if merged is not None and is_current(merged, parts):
        return merged
    index = tuple(i for i, p in enumerate(parts) if _plain(p))
    if len(index) < 2:
        return None
    mods = [parts[i] for i in index]
    w0 = mods[0].weight
    tensors = [t for m in mods for t in (m.weight, m.bias) if t is not None]
    if any(m.in_features != mods[0].in_features for m in mods) or \
            any(t.dtype != w0.dtype or t.device != w0.device for t in tensors):
        return None
    pad = -sum(m.out_features for m in mods) % ROW_ALIGN
    weight = torch.cat([m.weight for m in mods] + [w0.new_zeros(pad, w0.shape[1])])
    has_bias = tuple(m.bias is not None for m in mods)
    bias = torch.cat([m.bias if m.bias is not None else w0.new_zeros(m.out_features) for m in mods]
                     + [w0.new_zeros(pad)]) if any(has_bias) else None
    row = 0
    for m in mods:
        n = m.out_features
        m.weight.data = weight[row:row + n]  # the old storage goes when nothing else holds it
        if m.bias is not None:
            m.bias.data = bias[row:row + n]
        row += n
    return MergedLinear(weight, bias, index, tuple(m.out_features for m in mods), has_bias)


def is_current(merged: MergedLinear, parts: Sequence[nn.Module]) -> bool:
    """Whether the merged parts' parameters are still the merged tensor's rows (nothing rebound them)."""
    w = merged.weight
    w_step, b_step = w.stride(0) * w.element_size(), w.element_size()
    row = 0
    for i, n, has_b in zip(merged.index, merged.sizes, merged.has_bias):
        m = parts[i]
        if type(m) is not nn.Linear or m.weight.dtype != w.dtype or m.weight.device != w.device \
                or m.weight.shape[0] != n or m.weight.data_ptr() != w.data_ptr() + row * w_step:
            return False
        if (m.bias is not None) != has_b or (has_b and m.bias.data_ptr() != merged.bias.data_ptr() + row * b_step):
            return False
        row += n
    return True


def project(parts: Sequence[nn.Module], merged: MergedLinear | None, x: Tensor) -> list[Tensor]:
    """[part(x) for part in parts] for x [..., K], the merged parts in one GEMM (their outputs column views)."""
    if merged is None or not is_current(merged, parts) \
            or (torch.is_grad_enabled() and any(parts[i].weight.requires_grad for i in merged.index)):
        return [p(x) for p in parts]
    out: list[Tensor | None] = [None] * len(parts)
    y_all = F.linear(x, merged.weight, merged.bias)  # [..., sum N_i + pad]
    for i, y in zip(merged.index, y_all.narrow(-1, 0, sum(merged.sizes)).split(merged.sizes, dim=-1)):
        out[i] = y
    return [y if y is not None else p(x) for y, p in zip(out, parts)]

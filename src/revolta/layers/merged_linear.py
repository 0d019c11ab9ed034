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

`merge_linears` takes the plain 16-bit/fp32 `nn.Linear`s (exact type). `merge_quant_linears` does the same for
the packed parts (`QuantLinear`, exact type) of one format and scheme: each packed tensor of the parts concatenated
along its output axis (the format's TensorSpec.out_axis: AWQ packs along its last axis, compressed-tensors along
its first), the parts' buffers rebound to their slices, one packed GEMV (layers/linear.quant_linear) with its own
split-K counters. At decode on the full-size AWQ model that makes GDN's in_proj_qkv and in_proj_z one 16,384-wide
GEMV and QSA's q / k / v / indexer projections one: two and three launches fewer a layer, and the 512-wide ones
stop paying a whole launch's latency for 0.7 MB. A format with a per-linear value (NVFP4's global scale: out_axis
None; WeightFormat.merged_value) does not merge: the parts' values differ in general and a reload may change one of
them. Where the output axis is not the first (AWQ), a part's slices are strided views; its own forward (the fallback
when the merge no longer holds) runs on contiguous copies. A parallel subclass keeps its own forward and runs alone.
With autograd on and a part requiring grad (training) every part runs separately, so gradients reach the parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .linear import QuantLinear, quant_linear

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
    bias = _merged_bias(mods, pad)
    row = 0
    for m in mods:
        m.weight.data = weight[row:row + m.out_features]  # the old storage goes when nothing else holds it
        row += m.out_features
    return MergedLinear(weight, bias, index, tuple(m.out_features for m in mods), has_bias)


def _merged_bias(mods: Sequence[nn.Module], pad: int = 0) -> Tensor | None:
    """The parts' biases end to end (zeros for a part without one, then `pad` zeros), each part's bias rebound to
    its slice; None when no part has one."""
    b0 = next((m.bias for m in mods if m.bias is not None), None)
    if b0 is None:
        return None
    bias = torch.cat([m.bias if m.bias is not None else b0.new_zeros(m.out_features) for m in mods]
                     + [b0.new_zeros(pad)])
    row = 0
    for m in mods:
        if m.bias is not None:
            m.bias.data = bias[row:row + m.out_features]
        row += m.out_features
    return bias


def _bias_current(m: nn.Module, has_bias: bool, bias: Tensor | None, row: int) -> bool:
    """Whether part `m`'s bias is still what the merge made of it: none, or the merged bias's slice from `row`."""
    if (m.bias is not None) != has_bias:
        return False
    return not has_bias or m.bias.data_ptr() == bias.data_ptr() + row * bias.element_size()


@dataclass(frozen=True)
class MergedQuant:
    """The merged packed tensors of the QuantLinear parts `index` (positions in the layer's part list, in order)."""

    packed: dict[str, Tensor]  # name -> the parts' tensors concatenated along the format's output axis, and the
    # merged linear's per-linear metadata (WeightFormat.merged_value: compressed-tensors' weight_shape)
    views: tuple[dict[str, Tensor], ...]  # per part: its slices of `packed` (what its buffers must still be)
    bias: Tensor | None  # [sum N_i]; zeros where a part has no bias
    counters: Tensor  # int32 [ceil(sum N_i / 8)] zeros: the merged GEMV's split-K counters (QuantLinear's rule)
    index: tuple[int, ...]
    sizes: tuple[int, ...]
    has_bias: tuple[bool, ...]


def _packed_plain(m: nn.Module) -> bool:
    return type(m) is QuantLinear and not any(t.is_meta for t in m.packed().values())


def _same_format(a: QuantLinear, b: QuantLinear) -> bool:
    return type(a.fmt) is type(b.fmt) and a.fmt.scheme == b.fmt.scheme and a.in_features == b.in_features


@torch.no_grad()
def merge_quant_linears(parts: Sequence[nn.Module], merged: MergedQuant | None = None) -> MergedQuant | None:
    """Merge the packed QuantLinear `parts` (same input, format and scheme as the first of them) into one packed
    weight and rebind each part's buffers and bias to its slices (module docstring). `merged`: the layer's current
    merge, returned as is while it holds. None: fewer than two such parts, a format with a per-linear value, or
    parts on different devices."""
    if merged is not None and is_current(merged, parts):
        return merged
    index = tuple(i for i, p in enumerate(parts) if _packed_plain(p))
    index = tuple(i for i in index if _same_format(parts[i], parts[index[0]])) if index else ()
    if len(index) < 2:
        return None
    mods = [parts[i] for i in index]
    specs = [{k: s for k, s in m.fmt.specs(m.out_features, m.in_features).items() if s.out_axis is not None}
             for m in mods]
    dev, n_all, k_in = mods[0].splitk_counters.device, sum(m.out_features for m in mods), mods[0].in_features
    fmt = mods[0].fmt
    per_linear = {k: fmt.merged_value(k, n_all, k_in, dev) for k, s in fmt.specs(n_all, k_in).items()
                  if s.out_axis is None}
    unaligned = any(m.out_features % s.out_pack for m, sp in zip(mods, specs) for s in sp.values())
    tensors = [t for m in mods for t in (*m.packed().values(), m.bias) if t is not None]
    elsewhere = any(t.device != dev for t in tensors)
    if None in per_linear.values() or unaligned or elsewhere:
        return None
    packed = {name: torch.cat([m.packed()[name] for m in mods], dim=spec.out_axis) for name, spec in specs[0].items()}
    packed.update(per_linear)
    has_bias = tuple(m.bias is not None for m in mods)
    bias = _merged_bias(mods)
    views, row = [], 0
    for m, spec in zip(mods, specs):
        n = m.out_features
        view = {name: packed[name].narrow(s.out_axis, row // s.out_pack, n // s.out_pack) for name, s in spec.items()}
        for name, v in view.items():
            getattr(m, name).data = v  # the old storage goes when nothing else holds it
        views.append(view)
        row += n
    counters = torch.zeros(-(-row // 8), dtype=torch.int32, device=dev)
    return MergedQuant(packed, tuple(views), bias, counters, index, tuple(m.out_features for m in mods), has_bias)


def _same_view(t: Tensor, v: Tensor) -> bool:
    return t.data_ptr() == v.data_ptr() and t.shape == v.shape and t.stride() == v.stride() and t.dtype == v.dtype


def _part_current(merged: MergedLinear | MergedQuant, parts: Sequence[nn.Module], j: int, row: int) -> bool:
    """Whether part j of the merge (parts[merged.index[j]], its rows from `row`) still holds the merged tensors'
    slices: a plain part its weight rows, a packed part every packed tensor's view."""
    m, n = parts[merged.index[j]], merged.sizes[j]
    if isinstance(merged, MergedQuant):
        if type(m) is not QuantLinear or m.out_features != n or not _same_format(m, parts[merged.index[0]]):
            return False
        return all(_same_view(getattr(m, name), v) for name, v in merged.views[j].items())
    w = merged.weight
    return (type(m) is nn.Linear and m.weight.dtype == w.dtype and m.weight.device == w.device
            and m.weight.shape[0] == n and m.weight.data_ptr() == w.data_ptr() + row * w.stride(0) * w.element_size())


def is_current(merged: MergedLinear | MergedQuant, parts: Sequence[nn.Module]) -> bool:
    """Whether the merged parts' tensors are still the merged tensors' slices (nothing rebound them)."""
    row = 0
    for j, (i, n, has_b) in enumerate(zip(merged.index, merged.sizes, merged.has_bias)):
        if not _part_current(merged, parts, j, row) or not _bias_current(parts[i], has_b, merged.bias, row):
            return False
        row += n
    return True


def _needs_grad(merged: MergedLinear | MergedQuant, parts: Sequence[nn.Module]) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for i in merged.index for t in parts[i].parameters())


def _merged_product(merged: MergedLinear | MergedQuant, parts: Sequence[nn.Module], x: Tensor) -> Tensor:
    """x [..., K] through the merged weight -> [..., sum N_i (+ pad)]."""
    if isinstance(merged, MergedLinear):
        return F.linear(x, merged.weight, merged.bias)
    first = parts[merged.index[0]]
    n = sum(merged.sizes)
    y = quant_linear(x.reshape(-1, x.shape[-1]), first.fmt, merged.packed, n, merged.bias, first.kernel,
                     merged.counters)
    return y.view(*x.shape[:-1], n)


Merge = MergedLinear | MergedQuant


def project(parts: Sequence[nn.Module], merged: Merge | None | tuple[Merge | None, ...], x: Tensor) -> list[Tensor]:
    """[part(x) for part in parts] for x [..., K]; each merge in `merged` (one, or a tuple: the plain parts' and the
    packed parts') runs its parts as one GEMM / GEMV whose column views are their outputs; the rest run alone."""
    out: list[Tensor | None] = [None] * len(parts)
    for m in merged if isinstance(merged, tuple) else (merged,):
        if m is None or not is_current(m, parts) or _needs_grad(m, parts):
            continue
        y_all = _merged_product(m, parts, x)  # [..., sum N_i + pad]
        for i, y in zip(m.index, y_all.narrow(-1, 0, sum(m.sizes)).split(m.sizes, dim=-1)):
            out[i] = y
    return [y if y is not None else p(x) for y, p in zip(out, parts)]

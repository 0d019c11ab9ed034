"""Launch census: every kernel one decode step launches, per layer type (issue 19, build item 3).

A C1 decode step of the full-depth stand-in is a long chain of small kernels, each costing a few µs of
launch, ramp and tail even inside a CUDA graph. This tool lists them without a GPU: it runs one decode
step of a model on the Triton path (under TRITON_INTERPRET=1 on CPU) exactly as `DecodeGraphs` captures
it (`ModelRunner.forward_packed` on the unpacked static step buffer), then the greedy argmax of the
sampler, and records
  * every Triton launch (`JITFunction.run` / the interpreter's `InterpretedFunction.run`, by kernel name);
  * every aten op that becomes a device kernel (a TorchDispatchMode; views, allocations and other
    metadata-only ops launch nothing and are left out; ops run by the interpreter inside a Triton
    launch are not the model's and are left out too; `_local_scalar_dense` is a host sync, kept);
and attributes each to the innermost labelled scope (module forward hooks; the HyperConnection
read/combine and PLE prefetch methods are wrapped per instance for the time of the census).

    TRITON_INTERPRET=1 python benchmarks/launch_census.py --rows 1,8
    python benchmarks/launch_census.py --json census.json   # on a GPU: the compiled kernels' launches

The per-step total at full depth multiplies each layer type's per-instance count by its instance count
in the real 48-layer pattern (36 GDN, 12 QSA, 48 MoE, 96 HC reads and writes, 1 PLE).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__":  # the interpreter flag is read when a kernel is decorated: before revolta imports
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from standin import build_model, standin_config  # noqa: E402

# layer-type labels, in table order
SETUP, PLE, HC_READ, HC_WRITE, HC_WRITE_READ, GDN, QSA, MOE, GLUE, FINAL = (
    "step setup", "PLE layer", "HC read", "HC write", "HC write + next read", "GDN layer", "QSA layer", "MoE block",
    "layer glue", "final mixer + lm_head + sampling")
LABELS = (SETUP, PLE, HC_READ, HC_WRITE, HC_WRITE_READ, GDN, QSA, MOE, GLUE, FINAL)
PER_STEP = (SETUP, PLE, GLUE, FINAL)  # counted per step; the others per instance

# aten ops that launch no kernel: allocations and metadata-only ops (views are caught by OpOverload.is_view)
NO_KERNEL = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach", "alias",
    "_unsafe_view", "view", "reshape", "expand", "as_strided", "t", "slice", "select", "unsqueeze", "squeeze",
    "permute", "transpose", "split", "split_with_sizes", "unbind", "unflatten", "flatten", "_reshape_alias",
    "resize_", "set_", "is_same_size", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim",
    "record_stream"})


def kernel_name(func) -> str | None:
    """The aten op's name when it launches a device kernel, else None."""
    name = func.overloadpacket.__name__
    if func.is_view or name in NO_KERNEL:
        return None
    return name


@dataclass
class Census:
    """Launches of one step: per label, the ordered kernel names and how many times the scope was entered."""

    launches: dict[str, list[str]] = field(default_factory=lambda: {k: [] for k in LABELS})
    instances: Counter = field(default_factory=Counter)

    def per_instance(self, label: str) -> float:
        return len(self.launches[label]) / self.num_instances(label)

    def num_instances(self, label: str) -> int:
        return 1 if label in PER_STEP else max(1, self.instances[label])

    def first_instance(self, label: str) -> list[str]:
        """The names of one instance (the launches split evenly between the instances)."""
        names, n = self.launches[label], self.num_instances(label)
        return names[: len(names) // n] if len(names) % n == 0 else names  # uneven (layer glue): all of them

    def counts(self) -> dict[str, float]:
        return {k: self.per_instance(k) for k in LABELS}


class _Recorder(TorchDispatchMode):
    def __init__(self, census: Census, stack: list[str], depth: list[int]):
        super().__init__()
        self.census, self.stack, self.depth = census, stack, depth

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.depth[0] == 0:
            name = kernel_name(func)
            if name is not None:
                self.census.launches[self.stack[-1]].append(f"aten.{name}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _triton_hook(census: Census, stack: list[str], depth: list[int]):
    """Record each Triton launch under the current label; ops the launch itself runs are not recorded."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    originals = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}

    def wrap(run):
        def hooked(self, *args, grid, warmup, **kwargs):
            if not warmup and depth[0] == 0:
                census.launches[stack[-1]].append(self.fn.__name__ if hasattr(self, "fn") else self.__name__)
            depth[0] += 1
            try:
                return run(self, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                depth[0] -= 1
        return hooked

    try:
        for cls, run in originals.items():
            cls.run = wrap(run)
        yield
    finally:
        for cls, run in originals.items():
            cls.run = run


def _scope(stack: list[str], census: Census, label: str, fn, counts: bool = True):
    """fn under `label`; `counts`: one call is one instance of the label (False: part of an instance)."""
    def scoped(*args, **kwargs):
        stack.append(label)
        census.instances[label] += counts
        try:
            return fn(*args, **kwargs)
        finally:
            stack.pop()
    return scoped


def _combine_read(mod, scoped):
    """HyperConnection.combine_read with no write pending is the module's plain read (counted as one)."""
    def call(x, inject, out, ops=None):
        return (x, *mod.read(x, ops)) if inject is None else scoped(x, inject, out, ops)
    return call


@contextlib.contextmanager
def _labelled(model, census: Census, stack: list[str]):
    """Module hooks and per-instance method wrappers that keep `stack[-1]` the innermost layer type."""
    from revolta.layers.gdn import GatedDeltaNet
    from revolta.layers.hyperconnection import HyperConnection
    from revolta.layers.moe import MoE
    from revolta.layers.ngram import PLELayer
    from revolta.layers.qsa import QSAttention
    from revolta.model import DecoderLayer

    handles, patched = [], []

    def push(label):
        def pre(mod, args):
            stack.append(label)
            census.instances[label] += 1
        return pre

    def pop(mod, args, out):
        stack.pop()

    by_type = ((GatedDeltaNet, GDN), (QSAttention, QSA), (MoE, MOE), (PLELayer, PLE), (DecoderLayer, GLUE))
    mixers = {id(m.hyper_connection_mixer) for m in model.modules() if hasattr(m, "hyper_connection_mixer")}
    for mod in model.modules():
        for cls, label in by_type:
            if isinstance(mod, cls):
                handles += [mod.register_forward_pre_hook(push(label)), mod.register_forward_hook(pop)]
        if isinstance(mod, HyperConnection):
            read = FINAL if id(mod) in mixers else HC_READ
            patched += [(mod, "read", _scope(stack, census, read, mod.read)),
                        (mod, "combine", _scope(stack, census, HC_WRITE, mod.combine))]
            if hasattr(mod, "combine_read"):  # trees before the fused write + read have none
                label = FINAL if id(mod) in mixers else HC_WRITE_READ
                patched.append((mod, "combine_read", _combine_read(mod, _scope(stack, census, label, mod.combine_read))))
        if isinstance(mod, PLELayer):
            patched.append((mod, "prefetch", _scope(stack, census, PLE, mod.prefetch, counts=False)))
    patched.append((model, "compute_logits", _scope(stack, census, FINAL, model.compute_logits, counts=False)))
    try:
        for obj, name, fn in patched:
            setattr(obj, name, fn)  # an instance attribute shadows the class method until deleted
        yield
    finally:
        for obj, name, _ in patched:
            delattr(obj, name)
        for h in handles:
            h.remove()


def tiny_model(dtype: torch.dtype = torch.float16, num_layers: int = 4, device: str = "cpu"):
    """The stand-in's layer pattern (GDN GDN GDN QSA, PLE at layer 2) at the embedded default's widths."""
    cfg = standin_config(num_layers, widths="tiny")
    return build_model(cfg, device, dtype, seed=0, draw_on_device=False)


def decode_census(model, rows: int = 1, prompt_len: int = 5, kernels: str = "triton") -> Census:
    """Prefill `rows` requests of `prompt_len` tokens (not counted), then count one decode step of all of them
    as the decode graph runs it (`forward_packed` on the unpacked step buffer), plus the greedy argmax."""
    from revolta.cache.capacity import CacheLayout
    from revolta.cache.storage import CacheStorage
    from revolta.engine.runner import ModelRunner, StepInputs, StepSequence

    kv = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[model.dtype]
    dtype = str(model.dtype).removeprefix("torch.")
    bs, per = 8, 4
    layout = CacheLayout(num_blocks=1 + rows * per, block_size=bs, num_slots=rows + 1, kv_cache_dtype=kv,
                         draft_kv_cache_dtype=kv, dtype=dtype)
    runner = ModelRunner(model, CacheStorage(model.cfg, layout), kernels=kernels)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.cfg.text.vocab_size - 1, (prompt_len + 1,), generator=gen).tolist()
               for _ in range(rows)]
    blocks = [list(range(1 + b * per, 1 + (b + 1) * per)) for b in range(rows)]
    with torch.no_grad():
        if prompt_len:  # 0: the step decodes each request's first token (the same launches, no prefill to wait for)
            runner.execute([StepSequence(p[:-1], 0, blocks[b], slot=b + 1) for b, p in enumerate(prompts)])
        seqs = [StepSequence(p[-1:], prompt_len, blocks[b], slot=b + 1) for b, p in enumerate(prompts)]
        flat = runner.pack_step(seqs, num_rows=rows, width=per).to(model.device)
        census, stack, depth = Census(), [SETUP], [0]
        with _labelled(model, census, stack), _triton_hook(census, stack, depth), _Recorder(census, stack, depth):
            logits = runner.forward_packed(StepInputs.unpack(flat, rows, rows, per), list(range(rows + 1)))
            stack.append(FINAL)
            logits.argmax(dim=-1)  # the sampler's greedy pick (engine/sampling.py)
            stack.pop()
    return census


def full_depth_total(census: Census, num_layers: int, full_layers: int = 48, gdn_per_qsa: int = 3) -> float:
    """Kernels per decode step of the real pattern (`full_layers` layers, one QSA after every `gdn_per_qsa` GDN,
    the PLE layers of this census) from a census of a `num_layers`-layer model of the same pattern."""
    qsa = full_layers // (gdn_per_qsa + 1)
    total = 0.0
    for label in LABELS:
        # the writes left standalone (before a PLE layer or a tap) are per step, unless every layer has its own
        per_step = label in PER_STEP or (label == HC_WRITE and census.instances[label] < num_layers)
        if per_step:
            total += len(census.launches[label])
        elif label in (GDN, QSA):
            total += census.per_instance(label) * (qsa if label == QSA else full_layers - qsa)
        else:  # HC reads / writes and MoE blocks: as many per layer as in the census
            total += len(census.launches[label]) / num_layers * full_layers
    return total


def table(census: Census, rows: int, num_layers: int) -> str:
    lines = [f"decode step, M = {rows}: kernels per instance of each layer type",
             "| layer type | instances | kernels | triton | torch | names, in order |",
             "| --- | --- | --- | --- | --- | --- |"]
    counts = census.counts()
    for k in LABELS:
        names = census.first_instance(k)
        triton_n = sum(not n.startswith("aten.") for n in names)
        lines.append(f"| {k} | {census.num_instances(k)} | {counts[k]:g} | {triton_n} | {len(names) - triton_n} | "
                     f"{', '.join(names) or '-'} |")
    total = sum(len(v) for v in census.launches.values())
    lines.append(f"total this model ({num_layers} layers): {total}; at the real 48-layer pattern: "
                 f"{full_depth_total(census, num_layers):g}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8", help="decode batch sizes (comma-separated)")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None, help="write the census here")
    args = ap.parse_args(argv)
    model = tiny_model(getattr(torch, args.dtype), args.layers, args.device)
    out = {}
    for rows in (int(r) for r in args.rows.split(",")):
        census = decode_census(model, rows)
        print(table(census, rows, args.layers), end="\n\n")
        counts = census.counts()
        out[rows] = {"counts": counts, "names": census.launches, "instances": dict(census.instances),
                     "full_depth_total": full_depth_total(census, args.layers)}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()

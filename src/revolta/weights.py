"""Checkpoint I/O: stream safetensors shards into a model whose parameter names are the checkpoint names.

In-memory names equal the official names (STYLE.md §4 convention 6) except for the few renames in the
rule table below (spec/model.md §5.1, §9): the PLE table is one `ngram_embedding.weight` in memory but
`shard_{s}` row parts on disk; per-expert split keys (`experts.{e}.{gate,up,down}_proj.weight`) pack into the
grouped `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I]; `model.lm_head.weight` is an alias
of `lm_head.weight`. Block-FP8 tensors (`X` + `X_scale_inv`, one scale per 128x128 block) are dequantised on
load (the writer, `save_checkpoint`, is in weights_save.py). Every name is validated against the model before a byte of weight data is read: the loader raises one
`CheckpointError` naming every missing, unexpected, wrongly shaped or doubly written tensor.

Memory: files are memory-mapped through `safetensors.safe_open`, each piece is copied straight into its slice
of the destination (large tensors in row chunks of `CHUNK_BYTES`), and a mapping is dropped after every
`MAP_BYTES` read, so loading a meta-device model peaks near one checkpoint size, not two.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from .weights_save import INDEX_FILE, SINGLE_FILE, checkpoint_tensors, save_checkpoint  # noqa: F401 (re-exported)

FP8_BLOCK = 128
SCALE_SUFFIX = "_scale_inv"  # `X.weight` -> `X.weight_scale_inv`, `experts.gate_up_proj` -> `..._scale_inv`
CHUNK_BYTES = 32 << 20  # largest temporary made while copying one tensor
MAP_BYTES = 32 << 20  # bytes read through one file mapping before it is dropped (see _Reader)
MAX_LISTED = 25  # names listed per category in a CheckpointError

# The rule table. Disk name -> in-memory name (+ where in that tensor); a name the model has maps to itself first.
_LM_HEAD_ALIAS = re.compile(r"^model\.lm_head\.weight$")
_PLE_SHARD = re.compile(r"^(?P<base>.*\.ngram_embedding)\.shard_(?P<s>\d+)\.weight$")
_EXPERT = re.compile(r"^(?P<base>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
# Per-expert tensors of packed experts (layers.quant_moe): the experts module places them (`disk_piece`).
_PACKED_EXPERT = re.compile(r"^(?P<base>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\."
                            r"(?P<tensor>\w+)$")
# On disk, dropped when the model has no such tensor (spec §2.3: the final mixer has no W_inj; activation
# scales of quantized checkpoints: revolta runs their formats weight-only, activations stay 16-bit).
_IGNORED_IF_ABSENT = (re.compile(r"(^|\.)hyper_connection_mixer\.block_inject_weight\.weight$"),
                      re.compile(r"\.(input_scale|input_global_scale)$"))
# Kept fp32 in memory whatever the model or checkpoint dtype (spec §2.6, §9.1).
_FP32_PARAMS = (re.compile(r"(^|\.)linear_attn\.(A_log|dt_bias)$"),)
# May be absent on disk: the module derives them from the config (spec §5.1).
# fp8 KV-cache calibration scales: cache metadata, not model weights; read by `read_kv_scales`.
_KV_SCALE = re.compile(r"\.self_attn\.[kv]_scale$")
_OPTIONAL_ON_DISK = (re.compile(r"\.ple_embedding\.(layer_multipliers|ngram_heads_vocab_sizes|ngram_heads_offsets)$"),)


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names every offending tensor."""


@dataclass(frozen=True)
class _Piece:
    """One on-disk tensor (`src`, plus its block-FP8 scale) written into `target[index]`."""

    src: str
    file: Path
    target: str
    index: tuple  # ints / slices into the target; () means the whole tensor
    src_shape: tuple[int, ...]
    src_dtype: torch.dtype
    scale: str | None = None
    scale_file: Path | None = None
    scale_shape: tuple[int, ...] | None = None

    @property
    def dequant(self) -> bool:
        return self.src_dtype in _FP8 and self.scale is not None


# ---------------------------------------------------------------------------------------------- files


def checkpoint_files(path: str | Path) -> dict[str, Path]:
    """Map every tensor name of a checkpoint to the safetensors file that holds it.

    `path` is a directory with `model.safetensors.index.json` (preferred) or `model.safetensors`, or one of
    those files itself. Raises `CheckpointError` naming a shard file the index lists but that does not exist.
    """
    path = Path(path)
    if path.is_dir():
        if (path / INDEX_FILE).is_file():
            path = path / INDEX_FILE
        elif (path / SINGLE_FILE).is_file():
            path = path / SINGLE_FILE
        else:
            raise CheckpointError(f"no {INDEX_FILE} or {SINGLE_FILE} in {path}")
    elif not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.name.endswith(".json"):
        weight_map = json.loads(path.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{path} has no 'weight_map'")
        files = {name: path.parent / f for name, f in weight_map.items()}
        per_file: dict[Path, int] = defaultdict(int)
        for f in files.values():
            per_file[f] += 1
        absent = sorted(f for f in per_file if not f.is_file())
        if absent:
            listed = ", ".join(f"{f.name} ({per_file[f]} tensors)" for f in absent)
            raise CheckpointError(f"{path.name} lists shard files missing from {path.parent}: {listed}")
        return files
    with safe_open(path, framework="pt") as f:
        return {name: path for name in f.keys()}


def checkpoint_has(path: str | Path, prefix: str) -> bool:
    """Whether the checkpoint at `path` holds any tensor whose name starts with `prefix` (reads names only)."""
    return any(name.startswith(prefix) for name in checkpoint_files(path))


def _read_headers(files: Mapping[str, Path]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name, file in files.items():
        by_file[file].append(name)
    out = {}
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            present = set(f.keys())
            lost = sorted(set(names) - present)
            if lost:
                raise CheckpointError(f"{file.name} lacks tensors its index assigns to it: {_listing(lost)}")
            for name in names:
                sl = f.get_slice(name)
                out[name] = (tuple(sl.get_shape()), _DTYPES[sl.get_dtype()])
    return out


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


# ---------------------------------------------------------------------------------------------- names


def _targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer by state_dict name (tied tensors appear under each name)."""
    out = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for n, p in mod._parameters.items():
            if p is not None:
                out[prefix + n] = p
        for n, b in mod._buffers.items():
            if b is not None and n not in mod._non_persistent_buffers_set:
                out[prefix + n] = b
    return out


def _translate(name: str, target_shapes: Mapping[str, tuple[int, ...]],
               packed_experts: Mapping[str, object] = {}) -> tuple[str, tuple]:
    """Disk name -> (in-memory name, index into it). PLE shards are placed by `_plan` once all are known.
    packed_experts: experts-module name -> the module, for per-expert tensors of packed experts."""
    if name in target_shapes:
        return name, ()
    if _LM_HEAD_ALIAS.match(name):
        return "lm_head.weight", ()
    m = _PACKED_EXPERT.match(name)
    if m and m["base"] in packed_experts:
        piece = packed_experts[m["base"]].disk_piece(int(m["e"]), m["proj"], m["tensor"])
        return (f"{m['base']}.{piece[0]}", piece[1]) if piece is not None else (name, ())
    m = _EXPERT.match(name)
    if m:
        base, e, proj = m["base"], int(m["e"]), m["proj"]
        if proj == "down_proj":
            return f"{base}.down_proj", (e,)
        target = f"{base}.gate_up_proj"
        shape = target_shapes.get(target)
        inter = shape[1] // 2 if shape is not None and len(shape) == 3 else 0
        rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
        return target, (e, rows)
    return name, ()


def _plan(
    files: Mapping[str, Path],
    headers: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    target_shapes: Mapping[str, tuple[int, ...]],
    target_dtypes: Mapping[str, torch.dtype],
    skip_prefixes: tuple[str, ...],
    renames: Mapping[str, str],
    packed_experts: Mapping[str, object] = {},
) -> tuple[list[_Piece], list[str]]:
    """Map each on-disk tensor to a piece; return (pieces, error lines). Reads headers only."""
    errors: list[str] = []
    unexpected: list[str] = []
    pieces: list[_Piece] = []
    scales = {n for n in headers
              if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in headers and n not in target_shapes}
    ple_shards: dict[str, dict[int, str]] = defaultdict(dict)

    def piece(src: str, target: str, index: tuple) -> None:
        shape, dtype = headers[src]
        scale = src + SCALE_SUFFIX if src + SCALE_SUFFIX in scales else None
        pieces.append(_Piece(src, files[src], target, index, shape, dtype, scale,
                             files[scale] if scale else None, headers[scale][0] if scale else None))

    for name in sorted(headers):
        if name in scales or name.startswith(skip_prefixes) or _KV_SCALE.search(name):
            continue
        m = _PLE_SHARD.match(name) if name not in target_shapes else None
        if m:
            ple_shards[f"{m['base']}.weight"][int(m["s"])] = name
            continue
        target, index = _translate(name if name in target_shapes else renames.get(name, name), target_shapes,
                                   packed_experts)
        if target.startswith(skip_prefixes):
            continue
        if target not in target_shapes:
            if not any(p.search(name) for p in _IGNORED_IF_ABSENT):
                unexpected.append(name)
            continue
        piece(name, target, index)

    for target, shards in sorted(ple_shards.items()):
        if target.startswith(skip_prefixes):
            continue
        if target not in target_shapes:
            unexpected.extend(shards[s] for s in sorted(shards))
            continue
        ids = sorted(shards)
        if ids != list(range(len(ids))):
            gaps = sorted(set(range(ids[-1] + 1)) - set(ids))
            errors.append(f"{target}: shard files hold shards {ids}; missing shard_{gaps} (shards concatenate "
                          f"in index order, so every shard_0..shard_{ids[-1]} must be present)")
        row = 0
        for s in ids:
            rows = headers[shards[s]][0][0] if headers[shards[s]][0] else 0
            piece(shards[s], target, (slice(row, row + rows),))
            row += rows
        if row != target_shapes[target][0]:
            errors.append(f"{target}: the {len(ids)} shards on disk hold {row} rows in total, the model's table "
                          f"has {target_shapes[target][0]} (check split_ngram_parts and the n-gram vocab config)")

    if unexpected:
        errors.append(f"{len(unexpected)} unexpected tensors in the checkpoint (nothing in the model maps to "
                      f"them; pass skip_prefixes to ignore a whole subtree):{_block(unexpected)}")
    errors.extend(_check_pieces(pieces, target_shapes, target_dtypes))
    return pieces, errors


def _check_pieces(pieces: list[_Piece], target_shapes, target_dtypes) -> list[str]:
    bad_shape, bad_dtype, bad_scale = [], [], []
    for p in pieces:
        want = _dst_shape(target_shapes[p.target], p.index)
        if want is None:
            bad_shape.append(f"{p.src}: {p.target}{_fmt_index(p.index)} is out of range for the model's shape "
                             f"{list(target_shapes[p.target])}")
        elif p.src_shape != want:
            where = f" (for {p.target}{_fmt_index(p.index)})" if p.index else ""
            bad_shape.append(f"{p.src}: checkpoint shape {list(p.src_shape)}, expected {list(want)}{where}")
        is_float = target_dtypes[p.target].is_floating_point
        if is_float != p.src_dtype.is_floating_point:
            bad_dtype.append(f"{p.src}: checkpoint dtype {p.src_dtype}, model dtype {target_dtypes[p.target]} "
                             f"(integer tensors must stay integer, e.g. the PLE int64 buffers)")
        if p.scale is not None and p.src_dtype not in _FP8:
            bad_scale.append(f"{p.scale}: a block scale for {p.src}, which is {p.src_dtype}, not float8")
        elif p.src_dtype in _FP8 and target_dtypes[p.target] not in _FP8:
            if p.scale is None:
                bad_scale.append(f"{p.src}: {p.src_dtype} without {p.src}{SCALE_SUFFIX}")
            else:
                want_scale = p.src_shape[:-2] + tuple(math.ceil(d / FP8_BLOCK) for d in p.src_shape[-2:])
                if len(p.src_shape) < 2 or p.scale_shape != want_scale:
                    bad_scale.append(f"{p.scale}: shape {list(p.scale_shape)}, expected {list(want_scale)} "
                                     f"(one scale per {FP8_BLOCK}x{FP8_BLOCK} block of {list(p.src_shape)})")
    errors = []
    for title, lines in (("wrong shapes", bad_shape), ("wrong dtypes", bad_dtype), ("bad FP8 scales", bad_scale)):
        if lines:
            errors.append(f"{len(lines)} tensors with {title}:{_block(lines)}")
    return errors


def _coverage_errors(
    pieces: list[_Piece],
    target_shapes: Mapping[str, tuple[int, ...]],
    aliases: Mapping[str, str],
    skip_prefixes: tuple[str, ...],
    optional: set[str],
) -> list[str]:
    """Missing (never or partly written) and doubly written targets.

    Tied names (one tensor, several names) count as present when any of them is fully written.
    """
    written: dict[str, int] = defaultdict(int)
    sources: dict[str, list[str]] = defaultdict(list)
    for p in pieces:
        shape = _dst_shape(target_shapes[p.target], p.index)
        written[p.target] += math.prod(shape) if shape is not None else 0  # () is a scalar: 1 element
        sources[p.target].append(p.src)
    full = {aliases[n] for n, shape in target_shapes.items() if written.get(n, 0) == math.prod(shape)}
    missing, twice = [], []
    for name, shape in target_shapes.items():
        numel, got = math.prod(shape), written.get(name, 0)
        if got > numel:
            twice.append(f"{name} <- {sorted(sources[name])}")
        elif aliases[name] not in full and not name.startswith(skip_prefixes) and not (got == 0 and name in optional):
            missing.append(name if got == 0 else f"{name} (only {got} of {numel} elements on disk)")
    errors = []
    if missing:
        errors.append(f"{len(missing)} model tensors missing from the checkpoint:{_block(sorted(missing))}")
    if twice:
        errors.append(f"{len(twice)} model tensors written more than once (duplicate or aliased names on disk):"
                      f"{_block(sorted(twice))}")
    return errors


def _dst_shape(shape: tuple[int, ...], index: tuple) -> tuple[int, ...] | None:
    """Shape of `tensor[index]` for a tensor of `shape`, or None when the index is out of range."""
    try:
        return tuple(torch.empty(shape, device="meta")[index].shape)
    except IndexError:
        return None


def _fmt_index(index: tuple) -> str:
    parts = [f"{i.start}:{i.stop}" if isinstance(i, slice) else str(i) for i in index]
    return "[" + ", ".join(parts) + "]"


def _block(lines: list[str]) -> str:
    return "\n  " + _listing(lines, sep="\n  ")


def _listing(names: list[str], sep: str = ", ") -> str:
    shown = sep.join(names[:MAX_LISTED])
    return shown + (f"{sep}... and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else "")


# ---------------------------------------------------------------------------------------------- materialise


def _target_dtype(name: str, current: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    if not current.is_floating_point:
        return current
    if any(p.search(name) for p in _FP32_PARAMS):
        return torch.float32
    return dtype or current


@torch.no_grad()
def materialize(
    model: nn.Module, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
) -> None:
    """Give every meta tensor real (uninitialised) storage on `device`, and move/cast the others, in place.

    `device=None` keeps real tensors where they are and puts meta tensors on the CPU. `dtype` applies to
    floating tensors only; `linear_attn.A_log` / `dt_bias` always become fp32 and integer buffers keep their
    dtype; `dtypes` (name -> dtype) overrides both for the names it lists. Tied tensors stay tied. Afterwards every submodule that owned a meta buffer and defines
    `init_buffers()` has it called, so derived buffers (RoPE tables, PLE int64 constants) get their values back;
    other formerly-meta buffers stay uninitialised until loaded (see `uninitialised_buffers`).
    """
    # Group every holder of a tensor first, while all originals are alive, so ids stay unique.
    groups: dict[int, list[tuple[nn.Module, bool, str, str]]] = defaultdict(list)
    tensors: dict[int, torch.Tensor] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for store_is_param, store in ((True, mod._parameters), (False, mod._buffers)):
            for n, t in store.items():
                if t is not None:
                    groups[id(t)].append((mod, store_is_param, n, prefix + n))
                    tensors[id(t)] = t
    reinit = []
    for key, holders in groups.items():
        t = tensors.pop(key)
        mod, is_param, n, full = holders[0]
        dev = torch.device(device) if device is not None else (torch.device("cpu") if t.is_meta else t.device)
        want = dtypes[full] if dtypes and full in dtypes else _target_dtype(full, t.dtype, dtype)
        if t.is_meta:
            new = torch.empty(t.shape, dtype=want, device=dev)
            reinit.extend(m for m, p, _, _ in holders if not p)
        elif t.device != dev or t.dtype != want:
            new = t.detach().to(dev, want)
        else:
            continue
        if is_param:
            new = nn.Parameter(new, requires_grad=t.requires_grad)
        del t
        for m, p, name, _ in holders:
            (m._parameters if p else m._buffers)[name] = new
    done: set[int] = set()
    for mod in reinit:
        if id(mod) not in done and callable(getattr(mod, "init_buffers", None)):
            done.add(id(mod))
            mod.init_buffers()


def uninitialised_buffers(model: nn.Module) -> tuple[set[str], set[str]]:
    """(persistent, non-persistent) meta buffers that `materialize` cannot fill: their module has no `init_buffers`."""
    persistent, other = set(), set()
    for mod_name, mod in model.named_modules():
        if callable(getattr(mod, "init_buffers", None)):
            continue
        for n, b in mod._buffers.items():
            if b is not None and b.is_meta:
                name = f"{mod_name}.{n}" if mod_name else n
                (other if n in mod._non_persistent_buffers_set else persistent).add(name)
    return persistent, other


# ---------------------------------------------------------------------------------------------- load


def dequantize_block_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.bfloat16, block: int = FP8_BLOCK
) -> torch.Tensor:
    """Block-FP8 dequantisation: `weight` [..., out, in] (float8) times `scale_inv` [..., ceil(out/b), ceil(in/b)],
    one scale per `block` x `block` tile (the last tiles may be partial). Returns [..., out, in] in `dtype`."""
    out_dim, in_dim = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block, -2)[..., :out_dim, :]
    scale = scale.repeat_interleave(block, -1)[..., :in_dim]
    return (weight.float() * scale).to(dtype)


class _Reader:
    """A `safe_open` handle that is reopened after `MAP_BYTES` of reads.

    Pages of a memory-mapped file that were read count towards RSS until the mapping goes away; dropping
    it every `MAP_BYTES` keeps a big single-file checkpoint from costing twice its size in RSS.
    """

    def __init__(self, file: Path):
        self.file, self.handle, self.read = file, None, 0

    def __call__(self, nbytes: int):
        if self.handle is None or self.read >= MAP_BYTES:
            self.close()
            self.handle = safe_open(self.file, framework="pt", device="cpu")
            self.read = 0
        self.read += nbytes
        return self.handle

    def close(self) -> None:
        self.handle = None  # the mapping is released when the handle is collected


def _copy_piece(reader: _Reader, p: _Piece, dst: torch.Tensor) -> None:
    """Copy `p` into `dst` (same shape), in row chunks of at most CHUNK_BYTES of temporaries."""
    fp8 = p.dequant and dst.dtype not in _FP8
    row_bytes = math.prod(p.src_shape[1:]) * p.src_dtype.itemsize * (5 if fp8 else 1)  # fp8 -> fp32 product
    rows = p.src_shape[0] if p.src_shape else 1
    if not p.src_shape or rows * row_bytes <= CHUNK_BYTES or rows == 1:
        src = reader(rows * row_bytes).get_tensor(p.src)
        if fp8:
            src = dequantize_block_fp8(src, _scale_rows(reader, p, None), dst.dtype)
        dst.copy_(src)
        return
    step = max(1, CHUNK_BYTES // max(row_bytes, 1))
    if fp8 and len(p.src_shape) == 2:  # whole scale blocks per chunk
        step = max(FP8_BLOCK, step // FP8_BLOCK * FP8_BLOCK)
    for a in range(0, rows, step):
        b = min(rows, a + step)
        src = reader((b - a) * row_bytes).get_slice(p.src)[a:b]
        if fp8:
            # 2-D weights: scale rows cover FP8_BLOCK weight rows each; 3-D (grouped experts): one per expert
            rng = (a // FP8_BLOCK, math.ceil(b / FP8_BLOCK)) if len(p.src_shape) == 2 else (a, b)
            src = dequantize_block_fp8(src, _scale_rows(reader, p, rng), dst.dtype)
        dst[a:b].copy_(src)
        del src


def _scale_rows(reader: _Reader, p: _Piece, rows: tuple[int, int] | None) -> torch.Tensor:
    """The block scales of `p` (rows [a, b) of them, or all); they may sit in another shard file."""
    if p.scale_file == reader.file:
        f = reader(0)
        return f.get_tensor(p.scale) if rows is None else f.get_slice(p.scale)[rows[0]:rows[1]]
    with safe_open(p.scale_file, framework="pt", device="cpu") as f:
        return f.get_tensor(p.scale) if rows is None else f.get_slice(p.scale)[rows[0]:rows[1]]


@torch.no_grad()
def load_weights(
    model: nn.Module,
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    skip_prefixes: Iterable[str] = (),
    renames: Mapping[str, str] | None = None,
    progress: bool = True,
) -> None:
    """Load a safetensors checkpoint (official names) into `model` in place.

    `model` may live on the meta device: it is materialised on `device` (default: CPU for meta tensors,
    other tensors stay put) in `dtype` (default: keep each tensor's dtype) first; `A_log`/`dt_bias` end fp32;
    packed quantized tensors (and their scales) keep the checkpoint's dtypes.
    `skip_prefixes` (e.g. `("mtp.",)` or `("model.visual.",)`) drops on-disk names and model names with those
    prefixes from loading and from the missing/unexpected check; skipped model tensors are left as they are.
    `renames` maps further on-disk names the model does not have to its own names (another model's layout).
    Everything is checked from the file headers before any data is read; problems raise one `CheckpointError`.
    """
    skip = tuple(skip_prefixes)
    files = checkpoint_files(path)
    headers = _read_headers(files)

    targets = _targets(model)
    shapes = {n: tuple(t.shape) for n, t in targets.items()}
    kept = _disk_dtype_names(model)  # packed quantized tensors: stored as the checkpoint has them
    dtypes = {n: t.dtype if n in kept else _target_dtype(n, t.dtype, dtype) for n, t in targets.items()}
    first_name: dict[int, str] = {}
    aliases = {n: first_name.setdefault(id(t), n) for n, t in targets.items()}
    # A meta buffer has no derived value to fall back on unless its module re-derives it in init_buffers().
    blank, blank_volatile = uninitialised_buffers(model)
    optional = {n for n in targets if any(p.search(n) for p in _OPTIONAL_ON_DISK) and n not in blank}

    packed_experts = {n: m for n, m in model.named_modules() if callable(getattr(m, "disk_piece", None))}
    pieces, errors = _plan(files, headers, shapes, dtypes, skip, renames or {}, packed_experts)
    errors += _coverage_errors(pieces, shapes, aliases, skip, optional)
    disk_dtypes, dtype_errors = _disk_dtypes(pieces, kept)
    errors += dtype_errors
    blank_volatile = sorted(n for n in blank_volatile if not n.startswith(skip))
    if blank_volatile:
        errors.append(f"{len(blank_volatile)} non-persistent buffers are on the meta device and no checkpoint "
                      f"holds them; give their modules an init_buffers() method:{_block(blank_volatile)}")
    if errors:
        raise CheckpointError(f"checkpoint {path} does not match the model:\n" + "\n".join(errors))

    materialize(model, device, dtype, disk_dtypes)
    targets = _targets(model)
    by_file: dict[Path, list[_Piece]] = defaultdict(list)
    for p in pieces:
        by_file[p.file].append(p)
    bar = tqdm(total=len(pieces), desc="Loading weights", unit="tensor", disable=not progress)
    for file in sorted(by_file):
        reader = _Reader(file)
        for p in by_file[file]:
            dst = targets[p.target]
            _copy_piece(reader, p, dst[p.index] if p.index else dst)
            bar.update()
        reader.close()
    bar.close()


def _disk_dtype_names(model: nn.Module) -> set[str]:
    """Names of tensors whose modules list them in `disk_dtype_tensors` (packed quantized weights)."""
    out = set()
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        out.update(prefix + n for n in getattr(mod, "disk_dtype_tensors", ()))
    return out


def _disk_dtypes(pieces: list[_Piece], kept: set[str]) -> tuple[dict[str, torch.dtype], list[str]]:
    """The checkpoint's dtype of each kept tensor (all pieces of one tensor must agree), and errors."""
    seen: dict[str, dict[torch.dtype, str]] = defaultdict(dict)
    for p in pieces:
        if p.target in kept:
            seen[p.target].setdefault(p.src_dtype, p.src)
    mixed = [f"{t}: " + ", ".join(f"{src} is {dt}" for dt, src in by.items()) for t, by in seen.items() if len(by) > 1]
    errors = [f"{len(mixed)} packed tensors assembled from pieces of different dtypes:{_block(mixed)}"] if mixed else []
    return {t: next(iter(by)) for t, by in seen.items()}, errors


def read_kv_scales(path: str | Path) -> dict[str, torch.Tensor]:
    """The checkpoint's fp8 KV-cache scales (`*.self_attn.k_scale` / `v_scale`), by name; {} when none ship.

    They size no parameter: `cache.storage.kv_scales_from_state_dict` turns them into per-layer scales.
    """
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    files = checkpoint_files(path)
    for name in sorted(n for n in files if _KV_SCALE.search(n)):
        with safe_open(str(files[name]), framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


VOCAB_MASK = "vocab_mask.json"


def read_vocab_mask(path: str | Path, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """`vocab_mask.json` of the checkpoint ({"allowed_token_ids": [...]}) as a [vocab_size] bool mask, or None.
    A model trained on part of the vocabulary (the trained default) ships it: its untrained LM-head rows are zeros,
    whose logit 0 could beat the trained ones, so they must never be predicted."""
    file = Path(path) / VOCAB_MASK
    if not file.is_file():
        return None
    ids = json.loads(file.read_text())["allowed_token_ids"]
    if not ids or min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(f"{file}: allowed_token_ids must be a non-empty list of ids in [0, {vocab_size}); rewrite "
                         "it or delete it to allow every token")
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[torch.tensor(ids, dtype=torch.long)] = True
    return mask.to(device)

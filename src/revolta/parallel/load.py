"""Load a rank's model from a safetensors checkpoint, reading only that rank's slices of each tensor.

The checkpoint is planned against the *full* model's shapes by the single-process loader's rules
(weights._plan: renames, per-expert keys packed into the grouped experts, PLE shards, the lm_head alias),
so every check and error message is the same as a TP1 load. Each planned piece is then intersected with
the rank's `Slices` of its target (parallel/shard.py) and only the overlap is read, through
`safe_open(...).get_slice` on the memory-mapped file: a rank reads each byte of its part once and nothing
of the other ranks' parts (replicated tensors are read whole).

Packed int4 / fp4 checkpoints: the full model is packed like the rank's (quantize_modules), so per-expert and
fused expert layouts plan as at TP1, and each packed tensor's slices follow its layout (parallel/packed.py); the
packed tensors keep the checkpoint's dtypes, as load_weights keeps them.

Not yet: block-FP8 checkpoints (dequantised per 128x128 block, so slices would have to follow blocks).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from ..config import ModelConfig
from ..model import FlashNextModel
from ..ple.load import PLELoader
from ..weights import (_OPTIONAL_ON_DISK, CheckpointError, _coverage_errors, _disk_dtype_names, _disk_dtypes, _Piece,
                       _plan, _read_headers, _targets, checkpoint_files, materialize, read_kv_scales,
                       read_vocab_mask)
from .config import ParallelConfig
from .context import ParallelContext
from .packed import localise_weight_shapes, packed_tensors
from .ple import RankRows
from .shard import Slices, build_rank_model, rank_slices


@dataclass
class ReadStats:
    """What a rank read: bytes of tensor data, and the number of slice reads."""

    bytes_read: int = 0
    reads: int = 0


def _region(p: _Piece, full_shape: tuple[int, ...]) -> list[tuple[int, int, int | None]]:
    """Per target dim: (start, stop, src dim or None when the piece's index fixes that dim to one value)."""
    out, src_dim = [], 0
    for d, n in enumerate(full_shape):
        ix = p.index[d] if d < len(p.index) else slice(None)
        if isinstance(ix, int):
            out.append((ix, ix + 1, None))
            continue
        start, stop, _ = ix.indices(n)
        out.append((start, stop, src_dim))
        src_dim += 1
    return out


def _copy_sliced(f, p: _Piece, region, sl: Slices, dst: Tensor, stats: ReadStats) -> None:
    """Copy the overlap of piece `p` with the rank's ranges of `sl` into the rank tensor `dst`."""
    a, b, src_d = region[sl.dim]
    offset = 0
    for s, e in sl.ranges:
        lo, hi = max(s, a), min(e, b)
        if lo < hi:
            src_ix = [slice(None)] * len(p.src_shape)
            dst_ix: list = []
            for d, (start, stop, sd) in enumerate(region):
                if d == sl.dim:
                    dst_ix.append(slice(offset + lo - s, offset + hi - s))
                    if sd is not None:
                        src_ix[sd] = slice(lo - a, hi - a)
                else:
                    dst_ix.append(start if sd is None else slice(start, stop))
            part = f.get_slice(p.src)[tuple(src_ix)]
            dst[tuple(dst_ix)].copy_(part)
            stats.bytes_read += part.numel() * part.element_size()
            stats.reads += 1
        offset += e - s


def load_rank_checkpoint(model: FlashNextModel, path: str | Path, rank: int, tp: int,
                         skip_prefixes: tuple[str, ...] = (), device: str | torch.device = "cpu") -> ReadStats:
    """Materialise the `build_rank_model` model `model` on `device` and fill it from the checkpoint at `path`,
    reading rank `rank`'s slices only (each slice goes from the memory map straight to the device). Returns what
    was read."""
    cfg = model.cfg
    with torch.device("meta"):  # the full shapes the checkpoint is planned against
        full = FlashNextModel(cfg, with_mtp=model.mtp is not None, with_vision=model.model.visual is not None)
    packed = {}
    if cfg.quantization is not None and cfg.quantization.packed:
        from ..layers.quantize import quantize_modules

        quantize_modules(full, cfg.quantization)
        packed = packed_tensors(full)
    shapes = {n: tuple(t.shape) for n, t in _targets(full).items()}
    dtypes = {n: t.dtype for n, t in _targets(full).items()}
    files = checkpoint_files(path)
    headers = _read_headers(files)
    packed_experts = {n: m for n, m in full.named_modules() if callable(getattr(m, "disk_piece", None))}
    pieces, errors = _plan(files, headers, shapes, dtypes, skip_prefixes, {}, packed_experts)
    first: dict[int, str] = {}
    aliases = {n: first.setdefault(id(t), n) for n, t in _targets(full).items()}
    optional = {n for n in shapes if any(r.search(n) for r in _OPTIONAL_ON_DISK)}  # init_buffers derives them
    errors += _coverage_errors(pieces, shapes, aliases, skip_prefixes, optional)
    errors += [f"{p.src}: block-FP8 checkpoints are not split yet; load with tensor_parallel_size=1"
               for p in pieces if p.dequant]
    disk_dtypes, dtype_errors = _disk_dtypes(pieces, _disk_dtype_names(full))
    errors += dtype_errors
    if errors:
        raise CheckpointError(f"checkpoint {path} does not match the model:\n" + "\n".join(errors))
    slices = {p.target: rank_slices(p.target, cfg.text, rank, tp, packed) for p in pieces}  # refuses cut groups

    materialize(model, device, None, disk_dtypes)  # packed tensors in the checkpoint's dtypes, as at TP1
    own = _targets(model)
    stats = ReadStats()
    by_file: dict[Path, list[_Piece]] = defaultdict(list)
    for p in pieces:
        by_file[p.file].append(p)
    with torch.no_grad():
        for file in sorted(by_file):
            with safe_open(file, framework="pt", device="cpu") as f:
                for p in by_file[file]:
                    dst = own[p.target]
                    sl = slices[p.target]
                    if sl is None:
                        part = f.get_slice(p.src)[:] if p.src_shape else f.get_tensor(p.src)
                        (dst[p.index] if p.index else dst).copy_(part)
                        stats.bytes_read += part.numel() * part.element_size()
                        stats.reads += 1
                    else:
                        if sl.size > sum(e - s for s, e in sl.ranges):  # vocabulary padding rows stay zero
                            dst.narrow(sl.dim, sum(e - s for s, e in sl.ranges),
                                       sl.size - sum(e - s for s, e in sl.ranges)).zero_()
                        _copy_sliced(f, p, _region(p, shapes[p.target]), sl, dst, stats)
    if packed:
        localise_weight_shapes(model, full)
    model.init_buffers().eval()
    return stats


def load_rank_model(cfg: ModelConfig, path: str | Path, ctx: ParallelContext, *, with_mtp: bool,
                    dtype: torch.dtype = torch.float32, dcp: int = 1, ple_placement: str = "device",
                    with_vision: bool = False, device: str | torch.device = "cpu") -> FlashNextModel:
    """This rank's model built and filled from the checkpoint, in `dtype`: what each rank of an engine at tp > 1
    runs (with_vision: the vision tower too, replicated, when the checkpoint has one: rank 0's). The MTP layer is loaded only `with_mtp`. dcp > 1: every rank calls this at the
    same point (its DCP group is created collectively). ple_placement "host": the rank holds its row range of the
    PLE table in host memory; "disk": its PLE worker reads that range from the files; "device": that range on the
    rank's device (parallel/ple.py: each row has one owner, a lookup is a masked gather and one all-reduce).
    device: this rank's (parallel/devices.py `rank_placement`; on CUDA the caller has made it the current device)."""
    tp = ctx.size
    model = build_rank_model(cfg, ParallelConfig(tp, dcp), ctx, with_mtp=with_mtp, with_vision=with_vision)
    skip = (() if model.model.visual is not None else ("model.visual.",)) + (() if model.mtp is not None else ("mtp.",))
    # checks the placement and the table before any weight is read; every placement splits the rows by rank
    tables = PLELoader(model, path, ple_placement, split_rows=True)
    skip += tables.skip_prefixes
    load_rank_checkpoint(model, path, ctx.rank, tp, skip_prefixes=skip, device=device)
    tables.load(device, RankRows(ctx))  # device rows, host rows (pinned when the lookups run on a GPU) or the disk worker
    model.to_dtype(dtype)  # as load_model casts (GDN decay parameters stay fp32)
    model.kv_scales = read_kv_scales(path)  # fp8 KV calibration (cache metadata), as load_model sets it
    model.logit_mask = read_vocab_mask(path, cfg.text.vocab_size, device)  # the gathered logits: full vocabulary
    model.checkpoint_dir = Path(path)
    return model.merge_projections().eval()  # after to_dtype: the rank's local shards, merged in their dtype

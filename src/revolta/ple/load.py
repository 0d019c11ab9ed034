"""Checking and loading the PLE n-gram table for a placement (spec/engine.md §6, issue 22).

`PLELoader(model, path, placement)` runs before the other weights load: it reads the table's shard
headers, checks them against the model (every shard_0..shard_{N-1} present, each [rows_s, head_dim],
one dtype, the rows adding up, FP8 with its global `ngram_embedding.weight_scale`) and raises one
CheckpointError naming every problem before a byte of data is read. A 16-bit table on the device
then loads like any other weight; otherwise the weight is removed from the model (nothing is
materialised for it) and `load` reads the shards straight into the table's own memory:
- "host": page-aligned anonymous memory, pinned in place on a GPU run (ordinary memory on a CPU run);
- "device": an FP8 table stays FP8 on the device (a pinned 64 MiB staging buffer on the way);
- "disk": nothing is read; the PLE worker maps the files when the engine starts.
Each chunk is read from the file directly into its place and its page-cache pages are dropped right
after (posix_fadvise DONTNEED), so loading never holds two copies of the table.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ..layers.ngram import NGramEmbedding, PLELayer
from ..units import human_bytes
from ..weights import CheckpointError, checkpoint_files
from .placement import PLEOptions, check_placement
from .shards import ITEMSIZE, TableLayout, TableShard, read_header
from .table import STORAGE_DTYPES, PLETable, StagedRows, TableRows

logger = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20
SCALE = "weight_scale"


@dataclass(frozen=True)
class TablePlan:
    """One PLE layer's table: where its bytes are and where its scale is (FP8 only)."""

    layer_idx: int
    module: NGramEmbedding
    layout: TableLayout
    scale: tuple[str, Path] | None


def ple_embeddings(model: nn.Module) -> list[tuple[str, int, NGramEmbedding]]:
    """(module name, decoder layer index, NGramEmbedding) of every PLE layer."""
    return [(f"{name}.ple_embedding", m.layer_idx, m.ple_embedding)
            for name, m in model.named_modules() if isinstance(m, PLELayer)]


def plan_tables(model: nn.Module, path: str | Path) -> list[TablePlan]:
    """Check every PLE table of `model` against the checkpoint's headers; one CheckpointError lists all problems."""
    files = checkpoint_files(path)
    headers: dict[Path, dict] = {}

    def header(name: str):
        f = files[name]
        if f not in headers:
            headers[f] = read_header(f)
        return headers[f][name]

    plans, errors = [], []
    for prefix, layer_idx, emb in ple_embeddings(model):
        base = f"{prefix}.ngram_embedding"
        pattern = re.compile(re.escape(base) + r"\.shard_(\d+)\.weight")
        shards = {int(m[1]): n for n in files if (m := pattern.fullmatch(n))}
        if f"{base}.weight" in files:
            if shards:
                errors.append(f"{base}: both the whole table ({base}.weight) and shards ({base}.shard_*.weight)")
                continue
            shards = {0: f"{base}.weight"}
        if not shards:
            errors.append(f"{base}: no table in the checkpoint (expected {base}.shard_0.weight ... or {base}.weight)")
            continue
        ids = sorted(shards)
        missing = sorted(set(range(ids[-1] + 1)) - set(ids))
        if missing:
            errors.append(f"{base}: shard_{missing} missing (the checkpoint has shards {ids}; shards concatenate in "
                          f"index order, so every shard_0..shard_{ids[-1]} must be present)")
            continue
        parts, row, dtypes = [], 0, set()
        for s in ids:
            t = header(shards[s])
            if len(t.shape) != 2 or t.shape[1] != emb.head_dim:
                errors.append(f"{shards[s]}: shape {list(t.shape)}, expected [rows, {emb.head_dim}] "
                              f"(head_dim = ple_embed_dim / n-gram heads)")
            elif t.dtype not in ITEMSIZE:
                errors.append(f"{shards[s]}: dtype {t.dtype}; a PLE table is one of {', '.join(ITEMSIZE)}")
            else:
                parts.append(TableShard(str(files[shards[s]]), shards[s], row, t.shape[0], t.offset))
                row += t.shape[0]
                dtypes.add(t.dtype)
        if len(parts) != len(ids):
            continue
        if len(dtypes) > 1:
            errors.append(f"{base}: shards of different dtypes {sorted(dtypes)}")
            continue
        if row != emb.num_rows:
            errors.append(f"{base}: the {len(ids)} shards hold {row:,} rows, the model's table has {emb.num_rows:,} "
                          "(check split_ngram_parts and the n-gram vocab config)")
            continue
        dtype = dtypes.pop()
        scale = f"{base}.{SCALE}"
        if dtype == "F8_E4M3" and scale not in files:
            errors.append(f"{base}: an FP8 table without its global scale {scale}")
            continue
        if dtype != "F8_E4M3" and scale in files:
            errors.append(f"{scale}: a scale for a {dtype} table (only FP8 tables carry one)")
            continue
        if scale in files and math.prod(header(scale).shape) != 1:
            errors.append(f"{scale}: shape {list(header(scale).shape)}; the FP8 table has one global scale")
            continue
        layout = TableLayout(base, dtype, row, emb.head_dim, tuple(parts))
        plans.append(TablePlan(layer_idx, emb, layout, (scale, files[scale]) if scale in files else None))
    if errors:
        raise CheckpointError(f"checkpoint {path}: the PLE n-gram table does not match the model:\n  "
                              + "\n  ".join(errors))
    return plans


def _read_exact(fd: int, offset: int, dst: memoryview) -> None:
    done = 0
    while done < len(dst):
        n = os.preadv(fd, [dst[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(f"unexpected end of file at byte {offset + done} while reading the PLE table")
        done += n


def read_table(layout: TableLayout, dst: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
    """All shards' bytes (or only rows [r0, r1) of the table) into `dst` (uint8 [rows * row_bytes], CPU or
    device), chunk by chunk, each chunk's page-cache pages dropped once it is in place."""
    rb = layout.row_bytes
    r0, r1 = (0, layout.rows) if rows is None else rows
    staging = torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) if dst.is_cuda else None
    for shard in layout.shards:
        lo, hi = max(r0, shard.row_start), min(r1, shard.row_start + shard.rows)
        if lo >= hi:
            continue
        start, n, src = (lo - r0) * rb, (hi - lo) * rb, shard.offset + (lo - shard.row_start) * rb
        fd = os.open(shard.file, os.O_RDONLY)
        try:
            for a in range(0, n, CHUNK_BYTES):
                b = min(n, a + CHUNK_BYTES)
                if staging is None:
                    _read_exact(fd, src + a, memoryview(dst[start + a:start + b].numpy()))
                else:
                    _read_exact(fd, src + a, memoryview(staging[:b - a].numpy()))
                    dst[start + a:start + b].copy_(staging[:b - a])
                os.posix_fadvise(fd, src + a, b - a, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def host_tensor(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] on page-aligned anonymous memory (pinnable in place, no allocator rounding)."""
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)[:nbytes]


def read_scale(scale: tuple[str, Path], device: torch.device) -> torch.Tensor:
    with safe_open(str(scale[1]), framework="pt") as f:
        return f.get_tensor(scale[0]).float().reshape(()).to(device)


class PLELoader:
    """Checks the PLE tables for `placement` at construction; `skip_prefixes` is what the weight loader must
    leave alone; `load(device)` brings the tables in afterwards (see the module docstring)."""

    def __init__(self, model: nn.Module, path: str | Path, placement: str, options: PLEOptions | None = None,
                 split_rows: bool = False):
        self.placement, self.options = check_placement(placement), options or PLEOptions.from_env()
        self.plans = plan_tables(model, path) if ple_embeddings(model) else []
        fp8 = any(p.layout.dtype == "F8_E4M3" for p in self.plans)
        # a 16-bit device table is an ordinary weight, unless each tensor-parallel rank keeps only its rows
        # (split_rows: `load` with parallel/ple.RankRows reads them)
        self.as_weight = placement == "device" and not fp8 and not split_rows
        if not self.as_weight:
            for p in self.plans:
                p.module.attach_table(None)  # no weight to materialise: the table comes in `load`

    @property
    def skip_prefixes(self) -> tuple[str, ...]:
        return () if self.as_weight else tuple(f"{p.layout.name}." for p in self.plans)

    def load(self, device: str | torch.device, rows: TableRows | None = None) -> None:
        """Bring every planned table in (module docstring). rows: which rows to read and the tables that hold them
        (default: whole tables; parallel/ple.RankRows: a tensor-parallel rank's row range, read alone)."""
        device, rows = torch.device(device), rows or TableRows()
        for p in self.plans if not self.as_weight else ():
            start = time.perf_counter()
            scale = None if p.scale is None else read_scale(p.scale, device)
            lay = p.layout
            lo, hi = rows.range(lay.rows)
            if self.placement == "disk":
                p.module.attach_table(rows.staged(lay, scale, p.module.num_heads, device, (lo, hi)))
            else:
                nbytes = (hi - lo) * lay.row_bytes
                raw = host_tensor(nbytes) if self.placement == "host" else \
                    torch.empty(nbytes, dtype=torch.uint8, device=device)
                read_table(lay, raw, (lo, hi))
                weight = raw.view(STORAGE_DTYPES[lay.dtype]).view(hi - lo, lay.width)
                p.module.attach_table(rows.table(weight, scale, self.placement, device, self.options.staged_min_tokens,
                                                 (lo, hi)))
            logger.info("PLE table of layer %d: %s (%.1f s)", p.layer_idx, describe_table(p.module.table, lay),
                        time.perf_counter() - start)
        if self.plans and self.placement == "host":
            logger.info("host memory in use after loading the PLE table: %s resident", human_bytes(process_rss()))


def describe_table(table: PLETable | StagedRows, layout: TableLayout) -> str:
    lo, hi = table.row_range
    rows = f"{layout.rows:,} rows" if (lo, hi) == (0, layout.rows) else f"rows [{lo:,}, {hi:,}) of {layout.rows:,}"
    what = f"{rows} x {layout.width} {layout.dtype}{' + global scale' if layout.dtype == 'F8_E4M3' else ''}"
    if isinstance(table, StagedRows):
        return (f"disk placement, {human_bytes((hi - lo) * layout.row_bytes)} ({what}) left in {len(layout.shards)} "
                "checkpoint shards, read through memory maps by the PLE worker")
    where = "pinned host memory" if table.placement == "host" and table.device.type == "cuda" else \
        "host memory" if table.placement == "host" else f"{table.device}"
    return f"{table.placement} placement, {human_bytes(table.nbytes)} ({what}) in {where}"


def process_rss() -> int:
    """Resident bytes of this process (0 where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return kb * 1024
    except (OSError, StopIteration):
        return 0


@dataclass(frozen=True)
class PLEMemory:
    """Where a model's PLE tables are and what they occupy (the startup summary and the memory budget).

    unlisted_device_bytes: table bytes on the compute device that are not model parameters (an FP8 table
    kept FP8 there), which the engine adds to the weights; a 16-bit device table is a parameter already.
    share: (lo, hi, rows) when this process holds or reads only rows [lo, hi) of each table's `rows` (a
    tensor-parallel rank's, parallel/ple.py; the byte counts are then the rank's), else None.
    """

    placement: str
    table_bytes: int
    unlisted_device_bytes: int
    host_bytes: int
    pinned: bool
    share: tuple[int, int, int] | None = None

    def describe(self) -> str:
        size = human_bytes(self.table_bytes)
        if self.share is not None:
            lo, hi, rows = self.share
            size += f", this rank's rows [{lo:,}, {hi:,}) of {rows:,}"
        if self.placement == "none":
            return "none (the model has no PLE layer)"
        if self.placement == "device":
            return f"device ({size} on the device)"
        if self.placement == "host":
            where = "pinned host memory" if self.pinned else "host memory"
            return f"host ({size} in {where}, none on the device: the KV pool gets that memory)"
        worker = "the PLE worker process" if self.share is None else "each rank's own PLE worker process"
        return f"disk ({size} left in the checkpoint files, read by {worker}; none on the device)"


def ple_memory(model: nn.Module) -> PLEMemory:
    tables = [emb for _, _, emb in ple_embeddings(model)]
    if not tables:
        return PLEMemory("none", 0, 0, 0, False)
    placement, total, device, host, pinned, share = "device", 0, 0, 0, False, None
    for emb in tables:
        t = emb.table
        if t is None:
            w = emb.ngram_embedding.weight
            total += w.numel() * w.element_size()
            continue
        if t.row_range != (0, emb.num_rows):
            share = (*t.row_range, emb.num_rows)
        if isinstance(t, StagedRows):
            lo, hi = t.row_range
            placement, total = "disk", total + (hi - lo) * t.layout.row_bytes
        else:
            placement, total = t.placement, total + t.nbytes
            if t.placement == "host":
                host, pinned = host + t.nbytes, t.weight.is_pinned() if torch.cuda.is_available() else False
            else:
                device += t.nbytes
    return PLEMemory(placement, total, device, host, pinned, share)

"""PLE table lookups per placement (issue 22, spec/engine.md §6): decode (C1, C8) and a 30K-token prefill.

The table has the real row width (16 heads x 160 FP8 values + one global scale, hashed as the real
config hashes) and a large row count (default 16 x 2M rows = 5.1 GB; the real table is 16 x 20M rows,
51.2 GB: --rows-per-head 20000000 with --skip-disk, as the disk run writes the table to disk), built on
the host. Per placement, the time to turn a step's n-gram contexts into its [T, 2560] fp16 rows, as the
PLE layer does it (NGramEmbedding.start_lookup with the Triton kernels):
- device: the FP8 table on the GPU;
- host (mapped): the table in pinned host memory, read by the GPU through the mapped view; decode
  replays a CUDA graph of the lookup, like the engine's decode graphs;
- host (staged): gathered on the host into pinned memory, one copy (the prefill alternative);
- disk: the PLE worker process gathers from memory-mapped shard files (DiskRowFeeder.stage: ids to the host,
  the worker's gather, the rows' copy to the device), three ways:
  hot   the same step's rows again: their pages in the page cache and in the worker's page tables;
  warm  rows the worker has not read yet, every page in the page cache (what a new prompt's rows cost while
        the table fits in RAM): each new page is a minor fault in the worker;
  warm, prefault  new rows again, by a worker started with prefault (REVOLTA_PLE_DISK_PREFAULT: every page mapped
        at start, timed once the worker's mapped file pages hold the table);
  cold  rows the worker has not read, their pages dropped from the page cache before each step (outside the
        timing; posix_fadvise DONTNEED), by a second worker with page release on (release_pages), since the
        kernel does not drop a page some process still maps: each new page is read from the disk.
Plus the overlap the layer gets: the 30K-token mapped lookup on its side stream next to a GEMM of the
size of the layer before it ([T, 2560] x [2560, 10240]), against the two alone. Every placement's
rows are checked bitwise against the device lookup.

    PYTHONPATH=src python benchmarks/bench_ple.py [--rows-per-head N] [--tokens 30720] [--skip-disk]
    PYTHONPATH=src python benchmarks/bench_ple.py --smoke        (a CPU run of the whole script, tiny table)

Prints a table and writes $OUT/bench_ple.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file
from torch import nn

from revolta.config import ModelConfig
from revolta.layers.ngram import PLELayer, ngram_contexts
from revolta.ple.disk import DiskRowFeeder
from revolta.ple.load import host_tensor
from revolta.ple.placement import PLEOptions
from revolta.ple.shards import TableLayout, TableShard, read_header
from revolta.ple.table import PLETable, StagedRows

REAL = Path(__file__).parents[1] / "tests" / "data" / "qwen3_8_flash_next_config.json"
FP16 = torch.float16


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Holder(nn.Module):
    """What DiskRowFeeder reads from a model: its PLE layer (built on meta: no weights) and cfg.text.eos."""

    def __init__(self, cfg: ModelConfig, device: torch.device):
        super().__init__()
        self.cfg = cfg
        with torch.device("meta"):
            self.ple = PLELayer(cfg.text, 1, 0)
        self.ple.ple_embedding.attach_table(None)
        self.ple.ple_embedding.to_empty(device=device)  # the hash buffers: a graph cannot copy them in
        self.ple.ple_embedding.init_buffers()


def random_fp8_rows(rows: int, width: int, dst: torch.Tensor, device: torch.device, chunk: int = 1 << 28) -> None:
    """dst uint8 [rows * width] <- random E4M3 codes without the NaN codes, drawn on `device` chunk by chunk."""
    gen = torch.Generator(device).manual_seed(0)
    for a in range(0, rows * width, chunk):
        b = min(rows * width, a + chunk)
        codes = torch.randint(0, 256, (b - a,), dtype=torch.uint8, device=device, generator=gen)
        codes[(codes & 0x7F) == 0x7F] = 0x38  # 1.0 instead of NaN
        dst[a:b].copy_(codes)


def write_shards(table: torch.Tensor, name: str, parts: int, directory: Path) -> TableLayout:
    """The table as `parts` safetensors files of one shard each (the checkpoint's layout)."""
    rows, width = table.shape
    shards, per = [], rows // parts
    for s in range(parts):
        path = directory / f"ple-{s:05d}.safetensors"
        save_file({f"{name}.shard_{s}.weight": table[s * per:(s + 1) * per]}, path)
        t = read_header(path)[f"{name}.shard_{s}.weight"]
        shards.append(TableShard(str(path), f"{name}.shard_{s}.weight", s * per, per, t.offset))
    return TableLayout(name, "F8_E4M3", rows, width, tuple(shards))


def read_into_page_cache(layout: TableLayout, chunk: int = 1 << 26) -> None:
    """Read every shard file once, so its pages are in the page cache (the warm rows' premise)."""
    for s in layout.shards:
        with open(s.file, "rb", buffering=0) as f:
            while f.read(chunk):
                pass


def mapped_bytes(pid: int, files: set[str]) -> int:
    """Bytes of `files` (real paths) present in process `pid`'s page tables: the Rss of its mappings of them
    (/proc/PID/smaps; the status file's RssFile would count its shared libraries too)."""
    total, counting = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if fields and not fields[0].endswith(":"):  # a mapping's header: address perms offset dev inode [path]
                counting = " ".join(fields[5:]) in files
            elif counting and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def wait_mapped(pid: int, layout: TableLayout, timeout_s: float = 120.0) -> float | None:
    """Seconds until process `pid` has the table's bytes of its shard files mapped (the prefault worker's populate
    thread done), or None after `timeout_s`."""
    files = {os.path.realpath(s.file) for s in layout.shards}
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if mapped_bytes(pid, files) >= layout.nbytes:
            return time.perf_counter() - t0
        time.sleep(0.01)
    return None


def drop_page_cache(layout: TableLayout) -> None:
    for s in layout.shards:
        fd = os.open(s.file, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def step_contexts(emb, batch: int, tokens: int, vocab: int, eos: int, seed: int, device):
    """A step of `batch` sequences of `tokens` each (histories random ids) -> the layer's inputs and contexts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch * tokens,), generator=g).to(device)
    history = torch.randint(0, vocab, (batch, emb.order - 1), generator=g).to(device)
    seq = torch.arange(batch, device=device).repeat_interleave(tokens)
    local = torch.arange(tokens, device=device).repeat(batch)
    cu = torch.arange(0, batch * tokens + 1, tokens, device=device, dtype=torch.int32)
    return SimpleNamespace(ids=ids, history=history, cu=cu, contexts=ngram_contexts(ids, history, seq, local, eos))


def timed(fn, device, reps: int, before=None) -> float:
    """Median seconds of fn(i) over reps (device-synchronised); before(i), if given, runs untimed first."""
    out = []
    for i in range(reps):
        if before is not None:
            before(i)
        sync(device)
        t = time.perf_counter()
        fn(i)
        sync(device)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def graph_time(lookup, steps, device, reps: int) -> tuple[float, torch.Tensor]:
    """Decode: the lookup captured in a CUDA graph, replayed with a new step's contexts each time."""
    static = steps[0].contexts.clone()
    if device.type != "cuda":
        return timed(lambda i: lookup(steps[i % len(steps)].contexts), device, reps), lookup(static)
    out = lookup(static)  # compile and warm up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lookup(static)

    def replay(i):
        static.copy_(steps[i % len(steps)].contexts)
        graph.replay()
    t = timed(replay, device, reps)
    static.copy_(steps[0].contexts)
    graph.replay()
    return t, out.clone()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows-per-head", type=int, default=2_000_000, help="n-gram vocab base (real: 20,000,000)")
    p.add_argument("--tokens", type=int, default=30_720, help="prefill tokens")
    p.add_argument("--reps", type=int, default=50, help="decode replays per point")
    p.add_argument("--skip-disk", action="store_true", help="no disk placement (no table written to disk)")
    p.add_argument("--dir", default=None, help="where the disk run writes its shard files (default: a temp dir)")
    p.add_argument("--smoke", action="store_true", help="a tiny table on the CPU (checks the script)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        args.rows_per_head, args.tokens, args.reps = 1000, 300, 3
    base = ModelConfig.from_pretrained(REAL)
    text = dataclasses.replace(base.text, ngram_vocab_size_base=args.rows_per_head)
    cfg = dataclasses.replace(base, text=text)
    holder = Holder(cfg, device)
    backend = "triton" if device.type == "cuda" else "torch"  # the smoke run: the torch references
    emb = holder.ple.ple_embedding
    rows, width, heads = emb.num_rows, emb.head_dim, emb.num_heads
    print(f"table: {rows:,} rows x {width} FP8 = {rows * width / 2**30:.2f} GiB; {heads} heads; device {device}")

    t0 = time.perf_counter()
    raw = host_tensor(rows * width)  # page-aligned host memory, pinned in place by PLETable
    random_fp8_rows(rows, width, raw, device)
    host_table = raw.view(torch.float8_e4m3fn).view(rows, width)
    scale = torch.tensor(0.0125, device=device)
    tables = {"device": PLETable(host_table.to(device), scale, "device", device),
              "host (mapped)": PLETable(host_table, scale, "host", device),
              "host (staged)": PLETable(host_table, scale, "host", device, staged_min_tokens=1)}
    print(f"built and pinned in {time.perf_counter() - t0:.1f} s")

    feeder, layout, tmp = None, None, None
    if not args.skip_disk:
        t0 = time.perf_counter()
        tmp = Path(args.dir or tempfile.mkdtemp(prefix="bench-ple-"))
        tmp.mkdir(parents=True, exist_ok=True)
        layout = write_shards(host_table, "model.language_model.layers.1.ple.ple_embedding.ngram_embedding",
                              text.split_ngram_parts, tmp)
        emb.attach_table(StagedRows(layout, scale, heads, device))
        storage = SimpleNamespace(ple={1: SimpleNamespace(context_ids=torch.zeros(16, emb.order - 1,
                                                                                  dtype=torch.long, device=device))})

        def start_worker(**options) -> DiskRowFeeder:
            """A PLE worker over the shards, the environment's options with `options` changed."""
            return DiskRowFeeder(holder, storage, max(args.tokens, 8),
                                 dataclasses.replace(PLEOptions.from_env(), **options))
        feeder = start_worker()
        print(f"disk: {len(layout.shards)} shard files written, worker pid {feeder.pid} "
              f"({time.perf_counter() - t0:.1f} s)")

    vocab, eos = text.vocab_size, text.eos_token_id
    results, mismatches = [], []

    def lookup_with(table):
        def lookup(contexts):
            emb.table = table
            return emb.start_lookup(contexts, FP16, backend)()
        return lookup

    def disk_lookup(feeder, step):
        emb.table = emb_disk
        slots = torch.arange(1, step.history.shape[0] + 1, device=device, dtype=torch.int32)
        storage.ple[1].context_ids[slots.long()] = step.history
        feeder.stage(step.ids, step.cu, slots, torch.ones_like(slots, dtype=torch.bool))
        return emb.start_lookup(step.contexts, FP16, backend)()

    emb_disk = emb.table if feeder is not None else None
    kinds = ((1, 1, "decode C1"), (8, 1, "decode C8"), (1, args.tokens, f"prefill {args.tokens:,}"))
    for batch, tokens, what in kinds:
        steps = [step_contexts(emb, batch, tokens, vocab, eos, seed, device) for seed in range(8)]
        ref = lookup_with(tables["device"])(steps[0].contexts)
        for name, table in tables.items():
            if name == "host (staged)" and tokens == 1:
                continue  # decode stays on the mapped path (a graph cannot hold the staged copy)
            lookup = lookup_with(table)
            if tokens == 1:
                t, out = graph_time(lookup, steps, device, args.reps)
            else:
                lookup(steps[0].contexts)
                t = timed(lambda i: lookup(steps[i % len(steps)].contexts), device, 5)
                out = lookup(steps[0].contexts)
            results.append({"step": what, "placement": name, "ms": t * 1e3})
            if not torch.equal(out.view(torch.int16), ref.view(torch.int16)):
                mismatches.append(f"{what} {name}")

    if feeder is not None:  # after the loop above, so the cold runs' dropped pages cost no other row
        read_into_page_cache(layout)  # written moments ago, but the page cache may have let some go since
        fresh = iter(range(1000, 10**9))  # seeds of steps no worker has read before

        def new_steps(batch, tokens, n):
            return [step_contexts(emb, batch, tokens, vocab, eos, next(fresh), device) for _ in range(n)]

        for batch, tokens, what in kinds:
            n = args.reps if tokens == 1 else 3
            step = new_steps(batch, tokens, 1)[0]
            ref = lookup_with(tables["device"])(step.contexts)
            if not torch.equal(disk_lookup(feeder, step).view(torch.int16), ref.view(torch.int16)):
                mismatches.append(f"{what} disk")
            hot = timed(lambda i: disk_lookup(feeder, step), device, n)
            warm = new_steps(batch, tokens, n)
            results += [{"step": what, "placement": "disk (hot: the same rows again)", "ms": hot * 1e3},
                        {"step": what, "placement": "disk (warm: new rows, page cache)",
                         "ms": timed(lambda i: disk_lookup(feeder, warm[i]), device, n) * 1e3}]
        feeder.close()
        feeder = start_worker(prefault=True, release_pages=False)
        mapped_s = wait_mapped(feeder.pid, layout)
        # counted from the worker's start-up handshake: its populate thread may be done by then (0.00 s)
        print("disk, prefault: every table page mapped "
              + (f"{mapped_s:.2f} s after the worker started" if mapped_s is not None
                 else "not within the wait's 120 s (timed anyway)"))
        for batch, tokens, what in kinds:
            n = args.reps if tokens == 1 else 3
            warm = new_steps(batch, tokens, n)
            results.append({"step": what, "placement": "disk (warm, prefault: pages mapped at start)",
                            "ms": timed(lambda i: disk_lookup(feeder, warm[i]), device, n) * 1e3})
        feeder.close()
        feeder = start_worker(release_pages=True)
        for batch, tokens, what in kinds:
            n = 5 if tokens == 1 else 2
            cold = new_steps(batch, tokens, n)
            results.append({"step": what, "placement": "disk (cold: new rows, from the disk)",
                            "ms": timed(lambda i: disk_lookup(feeder, cold[i]), device, n,
                                        before=lambda i: drop_page_cache(layout)) * 1e3})

    if device.type == "cuda":  # the side stream: the mapped prefill lookup next to the layer before it
        step = step_contexts(emb, 1, args.tokens, vocab, eos, 99, device)
        x = torch.randn(args.tokens, 2560, dtype=FP16, device=device)
        w = torch.randn(2560, 10240, dtype=FP16, device=device)
        emb.table = tables["host (mapped)"]
        gemm = timed(lambda i: x @ w, device, 5)
        alone = timed(lambda i: emb.start_lookup(step.contexts, FP16, "triton")(), device, 5)

        def both(i):
            finish = emb.start_lookup(step.contexts, FP16, "triton")
            x @ w
            finish()
        together = timed(both, device, 5)
        results.append({"step": f"prefill {args.tokens:,}", "placement": "overlap: GEMM alone / lookup alone / both",
                        "ms": [gemm * 1e3, alone * 1e3, together * 1e3]})

    print(f"\n{'step':<16} {'placement':<44} ms")
    for r in results:
        ms = r["ms"] if isinstance(r["ms"], list) else [r["ms"]]
        print(f"{r['step']:<16} {r['placement']:<44} {' / '.join(f'{v:.3f}' for v in ms)}")
    print("rows bitwise equal to the device lookup:", "yes" if not mismatches else f"NO: {mismatches}")
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    info = {"rows": rows, "width": width, "heads": heads, "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "disk_threads": PLEOptions.from_env().disk_threads, "results": results, "mismatches": mismatches}
    (out / "bench_ple.json").write_text(json.dumps(info, indent=1))
    if feeder is not None:
        feeder.close()
    if tmp is not None and args.dir is None:
        shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(1 if mismatches else 0)


if __name__ == "__main__":
    main()

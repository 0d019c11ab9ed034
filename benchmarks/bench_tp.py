"""Tensor-parallel decode on the stand-in (issue 24 item 2): decode step time at C1 and C8 at TP1 / TP2 / TP4 and
the share of rank 0's step in NCCL collectives.

    python benchmarks/bench_tp.py --tp 1 2 4 --ckpt /tmp/standin   # 4 GPUs; the checkpoint is written once, reused
    python benchmarks/bench_tp.py --tp 1 2 --layers 12              # 2 GPUs, a shallower stand-in
    python benchmarks/bench_tp.py --device cpu --widths tiny --layers 4 --tp 1 2 --steps 4   # smoke: gloo, torch path

The stand-in is benchmarks/standin.py's (real widths, --layers layers, --experts experts, fp16 random weights), saved
as a checkpoint that every rank reads its slices of (TPGroup, as `LLM(tensor_parallel_size=N)` does). Rows:
TP1 with CUDA graphs (the single-GPU engine as shipped), TP1 eager and TP N eager (tp > 1 runs eager: each collective's
wait is bounded, docs/parallel.md), so the eager rows compare like with like. Per row and concurrency C: the median
wall time of a pure decode step (`Engine.step`, synced), tokens/s, the speedup over TP1 eager and the scaling
efficiency (speedup / N); for TP N on CUDA also the NCCL kernels' GPU time per step (torch profiler on rank 0, a
few decode steps) over that step's wall time. An NCCL kernel's time includes waiting for the slowest rank to reach
it. The last lines printed are a markdown table; $OUT/bench_tp.json holds the rows.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from engine_timing import Req, random_prompts, step_once  # noqa: E402
from standin import build_model, standin_config  # noqa: E402

from revolta.engine import Engine, EngineConfig  # noqa: E402
from revolta.engine.tp_executor import TPGroup  # noqa: E402
from revolta.weights import save_checkpoint  # noqa: E402

CONCURRENCY = (1, 8)


def engine_config(args, tp: int, eager: bool) -> EngineConfig:
    return EngineConfig(max_model_len=args.prompt_len + args.steps + 8, max_num_seqs=max(CONCURRENCY),
                        max_num_batched_tokens=max(CONCURRENCY) * args.prompt_len, kv_cache_gib=args.kv_cache_gib,
                        kernels="triton" if args.device == "cuda" else "torch", enable_prefix_caching=False,
                        enforce_eager=eager, speculative_config={"method": None}, tensor_parallel_size=tp)


def nccl_ms_per_step(engine: Engine, reqs: list, steps: int) -> float:
    """NCCL kernels' GPU milliseconds per decode step on rank 0 (profiler over `steps` steps)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step_once(engine, reqs)
    us = sum(getattr(e, "device_time_total", 0.0) for e in prof.key_averages() if "nccl" in e.key.lower())
    return us / 1e3 / steps


def measure(engine: Engine, args, vocab: int, tp: int) -> dict:
    """Decode step times at each concurrency (prefill steps excluded), and the collective share at tp > 1."""
    out = {}
    for c in CONCURRENCY:
        reqs = [Req(f"c{c}-{i}", p, args.steps + 1) for i, p in enumerate(random_prompts(c, args.prompt_len, vocab, 7))]
        for r in reqs:
            engine.add_request(r)
        records = []
        while engine.has_unfinished():
            rec = step_once(engine, reqs)
            records.append(rec)
            if rec.decoding and rec.active == c and len(records) == args.steps // 2 and tp > 1 and args.device == "cuda":
                out[f"C{c}_nccl_ms"] = nccl_ms_per_step(engine, reqs, min(4, args.steps // 4 or 1))
        decode = [r.wall_s * 1e3 for r in records if r.decoding and r.active == c][2:]  # warm-up steps dropped
        step_ms = statistics.median(decode) if decode else float("nan")
        out[f"C{c}_step_ms"], out[f"C{c}_tok_s"] = step_ms, c * 1e3 / step_ms
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--widths", default="real", choices=["real", "tiny"])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per request")
    ap.add_argument("--kv-cache-gib", type=float, default=4.0)
    ap.add_argument("--ckpt", default=None, help="checkpoint directory: written when it has no weights, else reused")
    args = ap.parse_args()
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    cfg = standin_config(args.layers, args.experts, widths=args.widths)
    ckpt = Path(args.ckpt or tempfile.mkdtemp(prefix="bench-tp-"))
    try:
        run(args, cfg, ckpt, dtype)
    finally:
        if args.ckpt is None:
            shutil.rmtree(ckpt, ignore_errors=True)


def run(args, cfg, ckpt: Path, dtype: torch.dtype) -> None:
    model = None
    if not list(ckpt.glob("*.safetensors")):
        model = build_model(cfg, args.device, dtype, seed=0)
        save_checkpoint(model, ckpt, progress=False)
        print(f"wrote the stand-in ({args.layers} layers, {args.experts} experts) to {ckpt}", flush=True)
    vocab = cfg.text.vocab_size
    rows = []
    if 1 in args.tp:
        model = model if model is not None else build_model(cfg, args.device, dtype, seed=0)
        for eager in ((False, True) if args.device == "cuda" else (True,)):
            rows.append(dict(tp=1, graphs=not eager, **measure(Engine(model, engine_config(args, 1, eager)), args,
                                                                   vocab, 1)))
            print(json.dumps(rows[-1]), flush=True)
    del model
    gc.collect()  # the TP1 engines' model and cache, before the ranks load theirs
    if args.device == "cuda":
        torch.cuda.empty_cache()
    for tp in sorted(t for t in args.tp if t > 1):
        group = TPGroup.start(cfg, ckpt, tp, with_mtp=False, dtype=dtype, device=args.device)
        try:
            rows.append(dict(tp=tp, graphs=False, **measure(Engine(group.model, engine_config(args, tp, True),
                                                                   tp_group=group), args, vocab, tp)))
        finally:
            group.close()
        print(json.dumps(rows[-1]), flush=True)
    base = next((r for r in rows if r["tp"] == 1 and not r["graphs"]), None)
    print("\n| TP | graphs | " + " | ".join(f"C{c} ms / step | C{c} tok/s | C{c} speedup (eff.) | C{c} NCCL share"
                                            for c in CONCURRENCY) + " |")
    print("| --- | --- |" + " --- | --- | --- | --- |" * len(CONCURRENCY))
    for r in rows:
        cells = []
        for c in CONCURRENCY:
            ms = r[f"C{c}_step_ms"]
            speedup = base[f"C{c}_step_ms"] / ms if base else float("nan")
            nccl = r.get(f"C{c}_nccl_ms")
            cells += [f"{ms:.2f}", f"{r[f'C{c}_tok_s']:.1f}", f"{speedup:.2f}x ({speedup / r['tp']:.0%})",
                      f"{nccl / ms:.0%} ({nccl:.2f} ms)" if nccl is not None else "-"]
        print(f"| {r['tp']} | {'on' if r['graphs'] else 'off'} | " + " | ".join(cells) + " |")
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_tp.json").write_text(json.dumps(dict(vars(args), rows=rows), indent=1))


if __name__ == "__main__":
    main()

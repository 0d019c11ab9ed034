"""Locate the CUDA illegal memory access of MTP4 at C8 on the full-size model (benchmarks/RESULTS.md F3): one mode
per process (a context that hit an illegal access is dead); benchmarks/locate_crash.sh runs the modes in turn.

    CUDA_LAUNCH_BLOCKING=1 python benchmarks/locate_crash.py --mode static    # one mode; the script sets the flag

What it builds: the F3 configuration at `--layers` layers (default 4: GDN GDN GDN QSA, the PLE layer at 2, plus the
MTP layer): real widths, 512 experts top-10, random AWQ int4 weights (group 32) on the GPU, the real-size n-gram table
(47.7 GiB of FP8) in pinned host memory read through the mapped view, fp16, a 16 GiB KV cache. Then what F3 ran: a
plain stage at C1 and C8 (the forced drafts' reference tokens), and MTP4 rounds (forced drafts at --rate, the first
round after each prefill drafting eagerly) at C1, then C8.

Modes (how the speculative rounds run):
  static  the round graphs' code (spec/graphs.py: static buffers, the 40-row verify, 8-row draft steps) run eagerly
          (`SpecGraphs.capture(graphs=False)`): under CUDA_LAUNCH_BLOCKING=1 the failing launch raises where it is
          called, so the traceback names the kernel and the layer;
  graphs  CUDA graphs as F3 (decode and round graphs): reproduces F3; the failing replay (draft / verify / commit,
          batch size) is named, not the kernel inside it;
  eager   no graphs and no SpecGraphs: rounds through runner.verify / MTPDrafter's eager path.
--sync-each synchronises after every Triton launch outside a capture (the last traced launch is then the failing
one even without launch blocking). The last --trace Triton launches (kernel, tensor shapes) are printed on failure.
Exit status 3 on a CUDA error, 0 when every stage ran; one JSON line per stage in $OUT/locate_crash_<mode>.json.

Without a GPU, the same stages at tiny widths under the Triton interpreter, every load and store checked against the
launch's tensors (exit status 4 and the first violations when one is out of bounds; ~15 min on 2 cores):

    TRITON_INTERPRET=1 python benchmarks/locate_crash.py --device cpu --bounds-check --sm90-paths \
        --prompt-len 8 --steps 6 --kv-cache-gib 0.05
"""

from __future__ import annotations

import os

os.environ.setdefault("CUDA_LAUNCH_BLOCKING", "1")  # before torch initialises CUDA

import argparse
import collections
import contextlib
import gc
import json
import random
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch
import triton.runtime.jit as triton_jit

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from bench_fulldepth import eager_round_graphs
from engine_timing import Req, random_prompts, step_once
from forced_drafts import force_drafts
from standin import standin_config

from revolta.engine import Engine, EngineConfig

MTP_DRAFTS = 4


class Trace:
    """The last Triton launches (kernel name, tensor argument shapes) and the last engine events."""

    def __init__(self, size: int, sync_each: bool):
        self.launches = collections.deque(maxlen=size)
        self.events = collections.deque(maxlen=size)
        self.sync_each = sync_each
        self.stage = "start"  # the stage running (set by run_stages)
        run = triton_jit.JITFunction.run
        trace = self

        def traced(fn_self, *args, grid, warmup, **kwargs):
            if not warmup:
                shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)][:6]
                trace.launches.append(f"{fn_self.fn.__name__} {shapes}")
            out = run(fn_self, *args, grid=grid, warmup=warmup, **kwargs)
            if trace.sync_each and not warmup and torch.cuda.is_available() and \
                    not torch.cuda.is_current_stream_capturing():
                torch.cuda.synchronize()
            return out

        triton_jit.JITFunction.run = traced

    def event(self, msg: str) -> None:
        self.events.append(msg)

    def dump(self) -> str:
        return ("last engine events:\n  " + "\n  ".join(self.events) + "\nlast Triton launches (oldest first):\n  "
                + "\n  ".join(self.launches))


def wrap_round_graphs(engine, trace: Trace) -> None:
    """Name each draft / verify / commit replay in the trace before it runs."""
    sg = engine.spec_graphs
    for B, rnd in sg.graphs.items():
        def named(fn, what, B=B):
            def call():
                trace.event(f"{what} round graph, batch size {B}")
                fn()
                if trace.sync_each and torch.cuda.is_available():
                    torch.cuda.synchronize()
            return call
        sg.graphs[B] = replace(rnd, **{n: named(getattr(rnd, n), n) for n in ("draft", "verify", "commit")
                                       if getattr(rnd, n) is not None})


def config(args, spec: dict) -> EngineConfig:
    C = max(args.spec_concurrency)
    return EngineConfig(max_model_len=args.max_model_len, max_num_seqs=C,
                        max_num_batched_tokens=max(2048, C * args.prompt_len), kv_cache_gib=args.kv_cache_gib,
                        kernels="triton", enable_prefix_caching=False, speculative_config=spec,
                        cudagraph_capture_sizes=tuple(args.spec_concurrency), enforce_eager=args.mode != "graphs")


def drive(engine, reqs, trace: Trace, what: str) -> None:
    for r in reqs:
        engine.add_request(r)
    n = 0
    while engine.has_unfinished():
        decoding = all(r.token_ids for r in reqs)
        trace.event(f"{what}: step {n} ({'decode / round' if decoding else 'prefill'})")
        step_once(engine, reqs)  # synchronises: an error surfaces in this step
        n += 1


def release() -> None:
    """Free the last engine (cache, graphs: reference cycles) before the next one."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("static", "graphs", "eager"), default="static")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=512)
    ap.add_argument("--weights", choices=("awq", "16bit"), default="awq")
    ap.add_argument("--ple", choices=("host", "device", "weight"), default="host",
                    help="host / device: a random FP8 table there; weight: the stand-in's 16-bit table weight")
    ap.add_argument("--standin-ngram-table", action="store_true", help="the stand-in's small table, not 47.7 GiB")
    ap.add_argument("--spec-concurrency", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8, help="tokens per request after the prefill")
    ap.add_argument("--rate", type=float, default=0.7, help="forced drafts: probability a draft is the reference")
    ap.add_argument("--kv-cache-gib", type=float, default=16.0)
    ap.add_argument("--sync-each", action="store_true")
    ap.add_argument("--trace", type=int, default=24)
    ap.add_argument("--device", default="cuda", help="cpu: tiny widths under the Triton interpreter")
    ap.add_argument("--bounds-check", action="store_true",
                    help="cpu: each load and store checked against its launch's tensors (interpreter_bounds.py)")
    ap.add_argument("--sm90-paths", action="store_true",
                    help="cpu: take the paths an H200 takes and the interpreter's defaults skip (nibble GEMV, HC dot)")
    args = ap.parse_args(argv)
    if (args.bounds_check or args.sm90_paths) and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--bounds-check and --sm90-paths are for the interpreter: run with TRITON_INTERPRET=1 --device cpu")
    args.spec_concurrency = [int(c) for c in args.spec_concurrency.split(",")]
    if args.ple == "weight":
        args.standin_ngram_table = True  # a 16-bit weight of the real table would be 95 GiB
    args.max_model_len = -(-(args.prompt_len + args.steps + 64) // 256) * 256
    out_path = Path(os.environ.get("OUT", ".")) / f"locate_crash_{args.mode}.json"
    rows = []
    t0 = time.perf_counter()

    def log(stage: str, **kw) -> None:
        rows.append(dict(stage=stage, s=round(time.perf_counter() - t0, 1), **kw))
        print(json.dumps(rows[-1]), flush=True)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")

    trace = Trace(args.trace, args.sync_each)
    if args.sm90_paths:
        from revolta.kernels import hc
        from revolta.kernels.quant import gemv_nibble

        sm90_rule = gemv_nibble.use_nibble  # the H200's choice whatever the device and activation dtype
        gemv_nibble.use_nibble = lambda arch, dtype, layout, nibble=None, M=1, N=None: sm90_rule(
            90, torch.float16, layout, nibble, M, N)
        dot_default = hc.hc_dot_default
        hc.hc_dot_default = lambda arch=None: dict(dot_default(arch), ENABLED=True)
    checked = contextlib.nullcontext([])
    if args.bounds_check:
        from interpreter_bounds import bounds_checked

        checked = bounds_checked(raise_at_exit=False)

    def summary(what: str, where: str = "") -> None:  # the row benchmarks/locate_crash.sh prints
        print(f"SUMMARY | {what} | {where}", flush=True)

    log("start", mode=args.mode, launch_blocking=os.environ.get("CUDA_LAUNCH_BLOCKING"), layers=args.layers,
        experts=args.experts, weights=args.weights, ple=args.ple,
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        torch=torch.__version__)
    cuda = args.device == "cuda"
    cfg = standin_config(args.layers, args.experts, with_mtp=True, widths="real" if cuda else "tiny",
                         real_ngram_table=cuda and not args.standin_ngram_table)
    dtype = torch.float16 if cuda else torch.float32
    table = None if args.ple == "weight" else args.ple
    if args.weights == "awq":
        from revolta.quantized import random_quantized_model

        model = random_quantized_model(cfg, args.device, dtype, seed=0, with_mtp=True, ple_table=table)
    else:  # as random_quantized_model builds: the n-gram weight leaves before anything is materialised
        from revolta.model import FlashNextModel, init_random_weights
        from revolta.weights import materialize

        with torch.device("meta"):
            model = FlashNextModel(cfg, with_mtp=True, with_vision=False)
        if table is not None:
            from revolta.ple.random_table import attach_random_tables

            attach_random_tables(model, table, args.device, seed=0)
        materialize(model, args.device, dtype)
        init_random_weights(model, seed=0, device=args.device)
        model.eval()
    log("model built", device_gib=round(torch.cuda.memory_allocated() / 2**30, 1) if cuda else 0)
    prompts = random_prompts(max(args.spec_concurrency), args.prompt_len, min(248_044, cfg.text.vocab_size - 1), 0)
    try:
        with checked as violations:
            run_stages(args, model, prompts, trace, log)
        if violations:
            log("bounds", ok=False, violations=len(violations), first=violations[:5])
            summary(f"{len(violations)} out-of-bounds accesses", violations[0])
            return 4
    except Exception as e:  # noqa: BLE001 - the point is to report it
        cuda = "CUDA" in str(e) or "illegal" in str(e)
        print(traceback.format_exc(), flush=True)
        print(trace.dump(), flush=True)
        log(trace.stage, ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
            last_event=(list(trace.events) or [""])[-1], last_launch=(list(trace.launches) or [""])[-1],
            launches=list(trace.launches)[-8:])
        summary(f"{trace.stage}: {rows[-1]['error']}", f"{rows[-1]['last_launch']} / {rows[-1]['last_event']}")
        return 3 if cuda else 1
    log("done", ok=True)
    summary("every stage ran")
    return 0


def run_stages(args, model, prompts, trace: Trace, log) -> None:
    """The plain stage (the forced drafts' reference tokens), then MTP4 at each concurrency; trace.stage names the
    one running."""
    trace.stage = "plain"
    engine = Engine(model, config(args, {"method": None}))
    refs = {}
    for C in args.spec_concurrency:
        reqs = [Req(f"c{C}r{i}", p, 1 + args.steps, device=args.device) for i, p in enumerate(prompts[:C])]
        drive(engine, reqs, trace, f"plain C{C}")
        refs.update({r.request_id: (len(r.prompt_token_ids), r.token_ids) for r in reqs})
        log(f"plain C{C}", ok=True)
    engine.close()
    del engine
    release()
    trace.stage = "mtp engine"
    engine = Engine(model, config(args, {"method": "mtp", "num_speculative_tokens": MTP_DRAFTS,
                                         "draft_policy": "always"}))
    if args.mode == "static":
        eager_round_graphs(engine, args.spec_concurrency)
    if engine.spec_graphs is not None:
        wrap_round_graphs(engine, trace)
    rng = random.Random(0)
    vocab = model.cfg.text.vocab_size
    force_drafts(engine, refs, lambda rid, d: [t if rng.random() < args.rate else (t + 1) % vocab for t in d])
    log("mtp engine", round_graphs=engine.spec_graphs is not None)
    for C in args.spec_concurrency:
        trace.stage = f"mtp C{C}"
        reqs = [Req(f"c{C}r{i}", p, 1 + args.steps, device=args.device) for i, p in enumerate(prompts[:C])]
        drive(engine, reqs, trace, trace.stage)
        log(trace.stage, ok=True, drafts=engine.spec_stats.num_draft_tokens,
            accepted=engine.spec_stats.num_accepted_tokens)


if __name__ == "__main__":
    sys.exit(main())

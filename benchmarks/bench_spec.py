"""MTP speculative decoding on the engine (issue 6, spec/performance.md §6.3): time per verify
round and decode speedup over no speculation at C1 and C8, for synthetic acceptance rates
(forced drafts: draft j is the target's own greedy token with probability `rate`, independently,
so a round accepts up to the first wrong one), with per-draft state slots and with replay, for a
greedy and a sampling target (sampling rows: the cost of a round at the acceptance it measures).

    python benchmarks/bench_spec.py [--model small|wide|slice] [--tokens 64]   (JSON in $OUT/bench_spec.json)

`small` is the GPU test model (tests/gpu/test_kernel_path_gpu.py); `wide` keeps the real model's
per-layer widths (hidden 2560, GDN 16/48 heads of 128, QSA 32/2 heads of 256) with 4 layers and
64 experts, so one step is bandwidth-shaped like a slice of the real model; `slice` is the engine
benchmark's real-width slice (bench_e2e.py: real layer shapes, 512 experts, vocab 248,320, --layers
layers) with the real MTP layer, weights drawn on the GPU (`--widths tiny --experts 8`: the same layer pattern at
the embedded default's widths, with a tiny DFlash2 drafter: the CPU smoke run of the slice rows,

    python benchmarks/bench_spec.py --model slice --widths tiny --experts 8 --layers 4 --tokens 6 --prompt 16 \
        --methods mtp,dflash2 --rates 0.0,0.8 --concurrency 1

). Speculative rounds replay the
spec/graphs.py CUDA graphs (captured for the run's concurrency; `--eager`: none); DFlash2 rounds only with
`--dflash2-graph-rounds` (then the verify and commit graphs, the drafter eager unless `--dflash2-draft-graph`),
else eagerly. Times are wall clock
around `engine.step`, with a device sync.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "gpu"))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).parent))

from engine_timing import Req, drive, gpu_ms, random_prompts, time_graphs  # noqa: E402
from forced_drafts import force_drafts  # noqa: E402
from standin import DrafterShape, build_model, standin_config, write_drafter  # noqa: E402

from revolta.config import ModelConfig  # noqa: E402
from revolta.cli import add_dflash2_graph_flags  # noqa: E402
from revolta.engine import Engine, EngineConfig  # noqa: E402
from revolta.model import FlashNextModel, init_random_weights  # noqa: E402


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run of the script with the torch path


def model_config(name: str) -> dict:
    from test_kernel_path_gpu import SMALL

    if name == "small":
        return dict(SMALL, mtp_num_hidden_layers=1)
    L, F = "linear_attention", "full_attention"
    return dict(SMALL, hidden_size=2560, num_hidden_layers=4, layer_types=[L, L, L, F], num_attention_heads=32,
                num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                linear_key_head_dim=128, linear_value_head_dim=128, num_experts=64, num_experts_per_tok=8,
                moe_intermediate_size=512, shared_expert_intermediate_size=512, hc_lowrank=64, ple_embed_dim=1024,
                indexer_n_heads=16, indexer_head_dim=128, vocab_size=32768, eos_token_id=32767,
                mtp_num_hidden_layers=1)


def run(model, concurrency, tokens, spec, temperature, refs=None, rate=0.0, seed=0, prompt=128, eager=False,
        dflash2_graphs=None, dflash2_draft_graph=None):
    engine = Engine(model, EngineConfig(max_model_len=4096, max_num_seqs=max(8, concurrency),
                                        max_num_batched_tokens=4096, kv_cache_gib=4.0 if DEVICE == "cuda" else 0.5,
                                        kernels="triton" if DEVICE == "cuda" else "torch",
                                        enforce_eager=eager, cudagraph_capture_sizes=(concurrency,),
                                        speculative_config=spec, dflash2_graph_rounds=dflash2_graphs,
                                        dflash2_draft_graph=dflash2_draft_graph))
    rng = random.Random(seed)
    if refs is not None:  # the MTP head still runs (its cost is part of the round), its drafts replaced
        vocab = model.cfg.text.vocab_size
        force_drafts(engine, refs, lambda rid, d: [t if rng.random() < rate else (t + 1) % vocab for t in d])
    parts = time_graphs(engine)
    reqs = [Req(f"r{i}", p, tokens, temperature, seed=i, device=DEVICE)
            for i, p in enumerate(random_prompts(concurrency, prompt, 1000, seed=1))]
    steps = [r for r in drive(engine, reqs) if r.decoding]  # every request past its prefill: decode / verify
    times = [r.wall_s for r in steps]
    emitted = [r.emitted for r in steps]
    step = statistics.median(times[2:] or times)
    graphs = engine.spec_graphs
    return reqs, {"step_ms": step * 1e3, "tokens_per_step": sum(emitted) / len(emitted),
                  "tokens_per_s": sum(emitted) / sum(times), "acceptance": engine.spec_stats.acceptance_rate,
                  "graph_rounds": graphs.num_replays if graphs is not None else 0, "decode_steps": len(times),
                  "graph_mib": graphs.used_bytes / 2**20 if graphs is not None else 0.0,
                  **(gpu_ms(parts) if DEVICE == "cuda" else {})}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small", choices=["small", "wide", "slice"])
    ap.add_argument("--layers", type=int, default=4, help="slice depth")
    ap.add_argument("--widths", default="real", choices=["real", "tiny"], help="slice widths (tiny: a CPU smoke run)")
    ap.add_argument("--experts", type=int, default=None, help="experts per slice layer (default: the real 512)")
    ap.add_argument("--concurrency", default="1,8", help="comma-separated concurrencies")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--eager", action="store_true", help="speculative rounds without CUDA graphs (the old rows)")
    ap.add_argument("--methods", default="mtp", help="comma-separated: mtp, dflash2 (a released-shape drafter, "
                    "benchmarks/standin.py; --model slice only)")
    add_dflash2_graph_flags(ap)  # EngineConfig.dflash2_graph_rounds / dflash2_draft_graph
    ap.add_argument("--rates", default="0.0,0.5,0.8", help="synthetic acceptance rates of the greedy rows")
    ap.add_argument("--draft-policy", default="always", choices=("always", "adaptive"),
                    help="the engine's draft policy (always: every decode step drafts, as the rates assume)")
    args = ap.parse_args()
    methods = args.methods.split(",")
    rates = tuple(float(r) for r in args.rates.split(","))
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    if args.model == "slice":
        cfg = standin_config(args.layers, args.experts, with_mtp=True, widths=args.widths)
        model = build_model(cfg, DEVICE, dtype, seed=3, with_mtp=True)
    else:
        model = FlashNextModel(ModelConfig.from_dict(model_config(args.model))).eval()
        init_random_weights(model, seed=3)
        model = model.to(DEVICE, dtype)
    drafter_dir = None
    if "dflash2" in methods:
        if args.model != "slice":
            raise SystemExit("--methods dflash2 needs --model slice (the drafter is shaped for the real width)")
        import tempfile

        shape = DrafterShape.tiny() if args.widths == "tiny" else DrafterShape()
        drafter_dir = write_drafter(model.cfg, Path(tempfile.mkdtemp()) / "drafter", device=DEVICE, dtype=dtype,
                                    shape=shape)
    rows = []
    for c in (int(x) for x in args.concurrency.split(",")):
        for temperature in (0.0, 1.0):
            base_reqs, base = run(model, c, args.tokens, {"method": None}, temperature, prompt=args.prompt)
            refs = {r.request_id: (len(r.prompt_token_ids), r.token_ids) for r in base_reqs}
            rows.append(dict(concurrency=c, temperature=temperature, mode="off", **base))
            for method, replay in ((m, r) for m in methods for r in (False, True)):
                # forced drafts measure a round at a given acceptance: every decode step must draft, so the
                # engine's adaptive policy (which stops drafting where it does not pay, e.g. on a CPU) is off
                spec = {"method": method, "spec_state_replay": replay, "draft_policy": args.draft_policy}
                if method == "dflash2":
                    spec["model"] = drafter_dir
                # a sampling target accepts a forced draft x with probability p(x), so synthetic rates
                # only apply to greedy; sampling rows measure the round's cost at the acceptance it gets
                for rate in (rates if temperature == 0 else (0.0,)):
                    _, m = run(model, c, args.tokens, spec, temperature, refs, rate, prompt=args.prompt,
                               eager=args.eager, dflash2_graphs=args.dflash2_graph_rounds,
                               dflash2_draft_graph=args.dflash2_draft_graph)
                    rows.append(dict(concurrency=c, temperature=temperature, method=method,
                                     mode="replay" if replay else "per-draft",
                                     rate=rate, speedup=m["tokens_per_s"] / base["tokens_per_s"], **m))
                    print(json.dumps(rows[-1]), flush=True)
    print("| C | target | method | state | synthetic rate | measured acceptance | ms / round | tokens / round | "
          "no-spec ms / step | graph rounds / decode steps | speedup |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    base_ms = {}
    for r in rows:
        if r["mode"] == "off":
            base_ms[r["concurrency"], r["temperature"]] = r["step_ms"]
            continue
        print(f"| {r['concurrency']} | {'greedy' if r['temperature'] == 0 else 'sampling'} | {r['method']} | "
              f"{r['mode']} | {r['rate']} | {r['acceptance'] or 0:.2f} | {r['step_ms']:.2f} | {r['tokens_per_step']:.2f} | "
              f"{base_ms[r['concurrency'], r['temperature']]:.2f} | {r['graph_rounds']} / {r['decode_steps']} | "
              f"{r['speedup']:.2f}x |")
    print("\n| C | target | state | synthetic rate | ms / round | draft graph GPU ms | verify graph GPU ms | "
          "commit graph GPU ms | round minus graph GPU ms | no-spec ms / step | no-spec decode graph GPU ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    base_gpu = {(r["concurrency"], r["temperature"]): r.get("decode_gpu_ms", float("nan")) for r in rows
                if r["mode"] == "off"}
    for r in rows:
        if r["mode"] != "off" and "verify_gpu_ms" in r:
            parts = [r.get(f"{p}_gpu_ms", 0.0) for p in ("draft", "verify", "commit")]
            key = (r["concurrency"], r["temperature"])
            print(f"| {r['concurrency']} | {'greedy' if r['temperature'] == 0 else 'sampling'} | {r['mode']} | "
                  f"{r['rate']} | {r['step_ms']:.2f} | {parts[0]:.2f} | {parts[1]:.2f} | {parts[2]:.3f} | "
                  f"{r['step_ms'] - sum(parts):.2f} | {base_ms[key]:.2f} | {base_gpu[key]:.2f} |")
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_spec.json").write_text(json.dumps({"model": args.model, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""End-to-end engine benchmark: prefill tokens/s, time to first token and output tokens/s at several
concurrencies, with the decode memory-bandwidth roofline beside the measured rate.

    python benchmarks/bench_e2e.py                                  # embedded default, CPU or GPU
    python benchmarks/bench_e2e.py --model slice --layers 8         # real-width slice (GPU)
    python benchmarks/bench_e2e.py --model slice --compare-eager    # graphs vs enforce_eager

For each concurrency C, C requests with distinct random prompts of --prompt-len tokens arrive
together and each generates --max-tokens tokens (greedy, EOS ignored: the release note's gate uses
512-token responses). Reported per C:
  * ttft_ms: mean time from arrival to the first token;
  * prefill_tok_s: C * prompt_len over the time until every request has its first token;
  * output_tok_s: C * max_tokens over the whole run, TTFT included (the release note's "aggregate output");
  * decode_tok_s: tokens after the first ones over the pure-decode time (steps where every request decodes);
  * roofline_tok_s / roofline_frac: C tokens per step over the time to read one decode step's bytes
    (weights incl. the distinct experts C tokens touch under uniform routing, each request's GDN state
    read + write, selected QSA K/V and compressed index keys) at --bandwidth GB/s (H200 copy: 4,300).

The slice is the real model's layer shapes (tests/data/qwen3_8_flash_next_config.json) with fewer layers
and no MTP/vision; its n-gram table keeps the real row width and per-token lookups but far fewer rows
(a gather reads the same bytes per token whatever the table size), so it fits one GPU.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from engine_timing import Req  # noqa: E402
from standin import build_model as build_standin, standin_config, step_bytes  # noqa: E402

from revolta.engine import Engine, EngineConfig  # noqa: E402
from revolta.model import FlashNextModel  # noqa: E402


def build_model(args) -> FlashNextModel:
    """The embedded default's config with its weight seed (no tokenizer needed), or the slice with
    weights drawn on the device (benchmarks/standin.py)."""
    dtype = getattr(torch, args.dtype)
    if args.model == "default":
        from revolta.presets.default import DEFAULT_WEIGHT_SEED, default_config

        return build_standin(default_config(), args.device, dtype, DEFAULT_WEIGHT_SEED, draw_on_device=False)
    return build_standin(standin_config(args.layers), args.device, dtype, seed=0)


def run_concurrency(engine: Engine, C: int, prompt_len: int, max_tokens: int, vocab: int, rng: random.Random,
                    tag: str) -> dict:
    reqs = [Req(f"{tag}-{C}-{i}", [rng.randrange(1, vocab) for _ in range(prompt_len)], max_tokens)
            for i in range(C)]  # greedy, end-of-sequence ignored
    first_token_time: dict[str, float] = {}

    sync = torch.cuda.synchronize if engine.model.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for r in reqs:
        engine.add_request(r)
    decode_start = None
    while engine.has_unfinished():
        stepped = engine.step()  # sampling ends with the step's one host sync
        now = time.perf_counter()
        for r in stepped:
            first_token_time.setdefault(r.request_id, now)
        if decode_start is None and len(first_token_time) == len(reqs):
            decode_start, decode_tokens0 = time.perf_counter(), sum(len(r.token_ids) for r in reqs)
    sync()
    t_end = time.perf_counter()
    first_all = max(first_token_time.values())
    decode_tokens = sum(len(r.token_ids) for r in reqs) - decode_tokens0
    return {
        "concurrency": C,
        "ttft_ms": 1e3 * sum(first_token_time[r.request_id] - t0 for r in reqs) / C,
        "prefill_tok_s": C * prompt_len / (first_all - t0),
        "output_tok_s": C * max_tokens / (t_end - t0),
        "decode_tok_s": decode_tokens / (t_end - decode_start) if t_end > decode_start and decode_tokens else 0.0,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("default", "slice"), default="default")
    ap.add_argument("--layers", type=int, default=8, help="slice depth (layer pattern of the real model)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: float16 on CUDA (the V100 path), float32 on CPU")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--kv-cache-gib", type=float, default=None, help="default: 0.5 on CPU, the memory budget on CUDA")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--compare-eager", action="store_true", help="also run every concurrency with enforce_eager")
    ap.add_argument("--bandwidth", type=float, default=4300.0, help="GB/s for the roofline (H200 copy: 4,300)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("float16" if args.device.startswith("cuda") else "float32")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    model = build_model(args)
    if args.device.startswith("cuda"):
        print(f"model on GPU: {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated, "
              f"{sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30:.2f} GiB of parameters",
              flush=True)
    kernels = "triton" if args.device.startswith("cuda") else "torch"
    modes = [args.enforce_eager] + ([True] if args.compare_eager and not args.enforce_eager else [])
    rows = []
    for eager in modes:
        ec = EngineConfig(max_model_len=args.max_model_len, max_num_seqs=max(concurrencies), kernels=kernels,
                          enable_prefix_caching=False, enforce_eager=eager, kv_cache_gib=args.kv_cache_gib)
        engine = Engine(model, ec)
        graphs = engine.graphs
        rng = random.Random(0)
        vocab = min(model.cfg.text.vocab_size, 248_044)
        for C in concurrencies:
            # the same prefill shapes once first: Triton compiles/specialises outside the timed run
            run_concurrency(engine, C, args.prompt_len, 4, vocab, rng, "warmup")
            row = run_concurrency(engine, C, args.prompt_len, args.max_tokens, vocab, rng, "run")
            kv_bytes = {"fp8_e4m3": 1, "int8": 1, "fp32": 4}.get(engine.storage.layout.kv_cache_dtype, 2)
            b = step_bytes(model, C, args.prompt_len + args.max_tokens // 2, kv_bytes)
            floor_s = b["total"] / (args.bandwidth * 1e9)
            row.update(model=args.model if args.model == "default" else f"slice{args.layers}", device=str(
                torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"), dtype=args.dtype,
                prompt_len=args.prompt_len, max_tokens=args.max_tokens, cuda_graphs=graphs is not None,
                step_gb=b["total"] / 1e9, distinct_experts=b["distinct_experts_per_layer"],
                roofline_tok_s=C / floor_s, roofline_frac=row["decode_tok_s"] * floor_s / C)
            rows.append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        del engine, graphs  # both hold the cache storage
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    print(f"\n{'model':<9} {'graphs':<6} {'C':>2} {'TTFT ms':>9} {'prefill t/s':>12} {'output t/s':>11} "
          f"{'decode t/s':>11} {'roofline t/s':>13} {'frac':>6}")
    for r in rows:
        print(f"{r['model']:<9} {str(r['cuda_graphs']):<6} {r['concurrency']:>2} {r['ttft_ms']:>9.1f} "
              f"{r['prefill_tok_s']:>12,.0f} {r['output_tok_s']:>11,.1f} {r['decode_tok_s']:>11,.1f} "
              f"{r['roofline_tok_s']:>13,.0f} {r['roofline_frac']:>6.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)

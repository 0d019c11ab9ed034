"""The trained embedded default (issue 25): tokens/s and acceptance with no speculation, MTP4 and DFlash2.

Prompts are held-out Python (presets/trained_eval.py: the first `--prompt-tokens` ids of `--prompts` segments of
stdlib files the model never trained on), decoded greedily, one request at a time (concurrency 1: where speculation
is meant to pay) through `LLM`. Each method gets a fresh LLM and one untimed warm-up request; then every prompt is
timed end to end (`llm.generate`, prefill included). Acceptance comes from the requests' own statistics
(`RequestOutput.metrics.spec_decode`, summed): MTP4 per-position acceptance, and for both methods the mean accepted
drafts per verify round and tokens per round. Greedy outputs of every method must equal no speculation's (checked;
a mismatch is printed). `--draft-policy always` (the default here) drafts every decode step, so acceptance is
measured on every round; `adaptive` is the engine's default, which stops drafting while it does not pay.

    python benchmarks/bench_trained_default.py                      # CPU (about 2 minutes on 2 shared cores)
    python benchmarks/bench_trained_default.py --device cuda        # H200: CUDA graphs, well under 90 s

Prints a table and writes JSON to --json (default $OUT/bench_trained_default.json when $OUT is set).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch

METHODS = {"none": {"method": None}, "mtp4": {"method": "mtp", "num_speculative_tokens": 4},
           "dflash2": {"method": "dflash2"}}


def run_method(name: str, prompts: list[list[int]], args) -> dict:
    from revolta import LLM, SamplingParams
    from revolta.spec import SpecStats

    spec = dict(METHODS[name])
    if spec["method"] is not None:
        spec["draft_policy"] = args.draft_policy
    t0 = time.perf_counter()
    # a fixed 1 GiB KV cache: by default an engine takes 90% of the GPU, and the next method's engine would not fit
    # beside what the previous one's allocator still holds (an H200 run ran out of memory at the second method)
    llm = LLM(model="trained-default", speculative_config=spec, device=args.device, max_model_len=1024,
              max_num_seqs=1, enforce_eager=args.eager, kv_cache_gib=1.0)
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                 use_tqdm=False)  # warm-up: kernels, caches, graphs
    stats, outputs, seconds, tokens = SpecStats(), [], 0.0, 0
    for ids in prompts:
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        seconds += time.perf_counter() - t
        tokens += len(out.outputs[0].token_ids)
        outputs.append(list(out.outputs[0].token_ids))
        if out.metrics is not None and out.metrics.spec_decode is not None:
            stats.merge(out.metrics.spec_decode)
    llm.close()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    print(f"  {name}: {tokens} tokens in {seconds:.1f} s (load {load_s:.1f} s)", flush=True)
    row = {"method": name, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "load_s": load_s,
           "outputs": outputs}
    if stats.num_rounds:
        row.update(rounds=stats.num_rounds, accepted_per_round=stats.num_accepted_tokens / stats.num_rounds,
                   tokens_per_round=stats.acceptance_length, per_position=[round(r, 4) for r in stats.per_position_rates])
    return row


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128, help="generated tokens per prompt")
    p.add_argument("--methods", default="none,mtp4,dflash2")
    p.add_argument("--draft-policy", default="always", choices=("always", "adaptive"))
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (always eager on CPU)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.eager = args.eager or args.device == "cpu"
    from revolta.presets.trained_eval import prompts as eval_prompts

    prompts = eval_prompts(args.prompt_tokens, args.prompts)
    start = time.perf_counter()
    rows = [run_method(m, prompts, args) for m in args.methods.split(",")]
    base = next((r for r in rows if r["method"] == "none"), None)
    print(f"trained default, {len(prompts)} held-out prompts x {args.tokens} tokens, greedy, C1, {args.device}, "
          f"draft policy {args.draft_policy}, load average {os.getloadavg()[0]:.2f}")
    print(f"{'method':8s} {'tok/s':>8s} {'speedup':>8s} {'acc/round':>9s} {'tok/round':>9s} {'same':>5s}  per-position")
    for r in rows:
        same = "-" if base is None or r is base else ("yes" if r["outputs"] == base["outputs"] else "NO")
        speed = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        acc = f"{r['accepted_per_round']:9.2f} {r['tokens_per_round']:9.2f}" if "rounds" in r else f"{'-':>9s} {'-':>9s}"
        pos = " / ".join(f"{x:.2f}" for x in r.get("per_position", []))
        print(f"{r['method']:8s} {r['tokens_per_s']:8.1f} {speed:7.2f}x {acc} {same:>5s}  {pos}")
    print(f"total {time.perf_counter() - start:.0f} s (loads: " + ", ".join(f"{r['method']} {r['load_s']:.1f} s"
                                                                        for r in rows) + ")")
    result = {"device": args.device, "tokens": args.tokens, "prompts": len(prompts),
              "draft_policy": args.draft_policy, "loadavg": os.getloadavg()[0],
              "rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows],
              "greedy_equal": {r["method"]: base is not None and r["outputs"] == base["outputs"] for r in rows}}
    path = args.json or (str(Path(os.environ["OUT"]) / "bench_trained_default.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()

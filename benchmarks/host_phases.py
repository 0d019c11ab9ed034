"""Host time of a decode step outside the model's forward, per engine phase (issue 19: the part of a GPU step the
GPU waits for). CPU, torch path, the tiny stand-in (benchmarks/standin.py): each phase timed by wrapping the engine's
own method with the wall clock, mean and median per step. Run it on two trees to compare (benchmarks/RESULTS.md H1).

    PYTHONPATH=src python benchmarks/host_phases.py [--concurrency 8] [--context 16] [--steps 40]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from engine_timing import Req, random_prompts  # noqa: E402
from standin import build_model, standin_config  # noqa: E402

from revolta.engine import Engine, EngineConfig  # noqa: E402


def wrap(obj, name: str, times: list[float]) -> None:
    """Replace obj.name by a wrapper that appends each call's seconds to `times`."""
    fn = getattr(obj, name)

    def timed(*a, **k):
        t0 = time.perf_counter()
        out = fn(*a, **k)
        times.append(time.perf_counter() - t0)
        return out
    setattr(obj, name, timed)


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--context", type=int, default=16, help="prompt tokens of each request")
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = standin_config(4, 8, with_mtp=True, widths="tiny", real_ngram_table=False)
    model = build_model(cfg, "cpu", torch.float32, seed=0, with_mtp=True)
    C = args.concurrency
    engine = Engine(model, EngineConfig(max_model_len=args.context + args.steps + 256, max_num_seqs=C,
                                        max_num_batched_tokens=8192, kv_cache_gib=1.0, kernels="torch",
                                        enable_prefix_caching=False, speculative_config={"method": None}))
    reqs = [Req(f"r{i}", p, args.steps + 8, device=model.device)
            for i, p in enumerate(random_prompts(C, args.context, min(cfg.text.vocab_size, 248_044), 0))]
    for r in reqs:
        engine.add_request(r)
    while not all(len(r.token_ids) >= 4 for r in reqs):  # prefill and a few decode steps, untimed
        engine.step()
    times: dict[str, list[float]] = defaultdict(list)
    for obj, name, label in ((model, "forward", "model.forward"), (engine.runner, "pack_step", "pack_step"),
                             (engine.scheduler, "schedule", "scheduler.schedule"),
                             (engine.scheduler, "update", "scheduler.update"), (engine.sampler, "sample", "sampling")):
        wrap(obj, name, times[label])
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        times["step"].append(time.perf_counter() - t0)
    times["outside the forward"] = [a - b for a, b in zip(times["step"], times["model.forward"])]
    out = {k: (statistics.mean(v) * 1e3, statistics.median(v) * 1e3) for k, v in times.items() if v}
    print(f"C{C}, context {args.context}, {args.steps} decode steps (ms per step: mean / median)")
    for k, (mean, med) in out.items():
        print(f"  {k:22s} {mean:8.3f} / {med:8.3f}")
    return out


if __name__ == "__main__":
    main()

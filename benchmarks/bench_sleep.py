"""Sleep levels on a GPU: device memory freed, sleep and wake_up times, greedy output unchanged.

    python benchmarks/bench_sleep.py                      # the embedded default on cuda
    python benchmarks/bench_sleep.py --model DIR --levels 0 1 2 [--enforce-eager]

For each level it generates greedily, sleeps, reads the device memory (torch.cuda.mem_get_info: what another
process could take), wakes, generates again and prints one row: memory in use awake / asleep / after wake,
sleep and wake_up seconds, and whether the tokens are identical to the first run. Unless --enforce-eager, the
wake_up time includes capturing the CUDA graphs again (sleep drops them with their memory pools).
"""

from __future__ import annotations

import argparse
import time

import torch

from revolta import LLM, SamplingParams


def used_gib(device: torch.device) -> float:
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / 2**30


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded default)")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    llm = LLM(args.model, enforce_eager=args.enforce_eager, max_model_len=4096)
    device = llm.model.device
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = ["The quick brown fox", "def fibonacci(n):", "In 1905, Einstein"]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    rows = []
    print(f"{'level':>5} {'awake GiB':>10} {'asleep GiB':>11} {'woken GiB':>10} {'sleep s':>8} {'wake s':>7}  "
          "same tokens")
    for level in args.levels:
        awake = used_gib(device)
        t0 = time.perf_counter()
        llm.sleep(level=level)
        torch.cuda.synchronize(device)
        t1 = time.perf_counter()
        asleep = used_gib(device)
        llm.wake_up()
        torch.cuda.synchronize(device)
        t2 = time.perf_counter()
        woken = used_gib(device)
        same = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == first
        rows.append(dict(level=level, awake=awake, asleep=asleep, woken=woken, sleep_s=t1 - t0, wake_s=t2 - t1,
                         same=same))
        print(f"{level:>5} {awake:>10.2f} {asleep:>11.2f} {woken:>10.2f} {t1 - t0:>8.2f} {t2 - t1:>7.2f}  {same}")
    return rows


if __name__ == "__main__":
    main()

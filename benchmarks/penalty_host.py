"""Host time a step of the penalties' output ids (RESULTS.md H1): as Python lists against StepSampler's device ids.

8 penalised requests with --output ids each, one new token a step. "lists": the index tensors apply_penalties makes
from output lists (a row index and a token index a Python int each, then copied); "device ids": StepSampler's
PenaltyIds brought up to date (one copy of the step's new tokens) and the same index tensors made from them. On a GPU
the second's tensor work is asynchronous, so its host time is the Python part. Medians of 15 steps, ms.

    python benchmarks/penalty_host.py [--output 8192] [--rows 8] [--device cpu]
"""

from __future__ import annotations

import argparse
import time

import torch

from revolta.engine.request import Request
from revolta.engine.sample_step import StepSampler
from revolta.engine.sampling import SamplingParams, device_tensor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", type=int, default=8192, help="output ids a request has")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    vocab, device = 248_320, torch.device(args.device)
    if device.type == "cpu":  # one intra-op thread: a thread pool waking on a busy machine timed 7 ms for 0.1 ms of work
        torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    reqs = [Request(str(i), [1, 2], SamplingParams(repetition_penalty=1.1, max_tokens=args.output + 100))
            for i in range(args.rows)]
    for r in reqs:
        r.token_ids.extend(torch.randint(0, vocab, (args.output,), generator=gen).tolist())
    sampler = StepSampler(frozenset(), vocab)
    sampler._penalty_ids(reqs, device)

    def lists():
        rows = [row for row, r in enumerate(reqs) for _ in r.token_ids]
        return (device_tensor(rows, torch.long, device),
                device_tensor([t for r in reqs for t in r.token_ids], torch.long, device))

    def device_ids():
        outs = [ids.output for ids in sampler._penalty_ids(reqs, device)]
        total = sum(len(o) for o in outs)
        rows = torch.repeat_interleave(device_tensor(list(range(len(outs))), torch.long, device),
                                       device_tensor([len(o) for o in outs], torch.long, device), output_size=total)
        return rows, torch.cat(outs)

    for name, make in (("lists", lists), ("device ids", device_ids)):
        times = []
        for step in range(15):
            for r in reqs:
                r.token_ids.append(step)
            t0 = time.perf_counter()
            make()
            times.append(time.perf_counter() - t0)
        print(f"{name:10s} {sorted(times)[7] * 1e3:7.2f} ms a step ({args.rows} rows x {args.output} output ids)")


if __name__ == "__main__":
    main()

"""Which Triton kernels would compile again in later speculative rounds: specialization keys per launch, on CPU.

Triton compiles a kernel once per specialization: the constexpr values, each tensor's dtype and whether its address
is 16-byte aligned, each specialised integer's being 1 or a multiple of 16 (arguments named in do_not_specialize
excepted), and the launch options (num_warps, num_stages). A key first seen in a steady-state round is a compile
inside that round on a GPU: tens to hundreds of ms each (benchmarks/RESULTS.md F1 run H saw ~0.3-1.6 compiles a round
in eager rounds; run I an eager DFlash2 round at 3.4 s). This script runs the engine's Triton kernels under the
interpreter (TRITON_INTERPRET=1, tiny widths, the paths a GPU takes where they differ: --sm90-paths as
locate_crash.py), records each launch's key, and lists the keys that first appear after the warm-up rounds, with the
arguments whose property changed from the kernel's earlier keys.

    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/specialization_churn.py --method dflash2 --concurrency 1
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/specialization_churn.py --method mtp --concurrency 1,8

The addresses are CPU allocations, not the GPU caching allocator's (whose blocks are 512-byte aligned), so an
alignment flip of a whole tensor may differ on a GPU; views into a buffer flip alike on both.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import os
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from engine_timing import Req, random_prompts, step_once  # noqa: E402
from forced_drafts import force_drafts  # noqa: E402
from standin import DrafterShape, build_model, standin_config, write_drafter  # noqa: E402

from revolta.engine import Engine, EngineConfig  # noqa: E402


def arg_key(value) -> str:
    """One argument's part of the compile key, as Triton specialises it."""
    if isinstance(value, torch.Tensor):
        return f"{value.dtype}{'/a16' if value.data_ptr() % 16 == 0 else '/a?'}"
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return repr(value)
    if isinstance(value, int):
        width = "i64" if not -2**31 <= value < 2**31 else "i32"
        return f"{width}={value}" if value == 1 else f"{width}/d16" if value % 16 == 0 else width
    if isinstance(value, float):
        return "fp32"
    return type(value).__name__


class KeyRecorder:
    """Wraps the interpreter's launch to record (kernel, key) with the phase that first saw it."""

    def __init__(self):
        from triton.runtime.interpreter import InterpretedFunction

        self.first_seen: dict[tuple[str, tuple], str] = {}
        self.by_kernel: dict[str, list[tuple]] = collections.defaultdict(list)
        self.phase = "start"
        run = InterpretedFunction.run
        recorder = self

        def recorded(fn_self, *args, grid, warmup, **kwargs):
            recorder.record(fn_self, args, kwargs)
            return run(fn_self, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = recorded

    def record(self, fn, args, kwargs) -> None:
        params = inspect.signature(fn.fn).parameters
        names = list(params)
        skip = set(fn.kwargs.get("do_not_specialize", ()) or ())
        bound = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in params}
        key = []
        for name in names:
            if name not in bound or name in skip:
                continue
            is_constexpr = "constexpr" in str(params[name].annotation)
            key.append((name, repr(bound[name]) if is_constexpr else arg_key(bound[name])))
        key += sorted((k, repr(v)) for k, v in kwargs.items() if k not in params)  # num_warps, num_stages
        key = tuple(key)
        kernel = fn.fn.__name__
        if (kernel, key) not in self.first_seen:
            self.first_seen[kernel, key] = self.phase
            self.by_kernel[kernel].append(key)

    def new_since(self, phases: set[str]) -> list[tuple[str, str, list[str]]]:
        """(kernel, phase, the arguments that differ from the kernel's first key) for keys first seen in `phases`."""
        out = []
        for (kernel, key), phase in self.first_seen.items():
            if phase in phases:
                first = dict(self.by_kernel[kernel][0])
                diff = [f"{n}: {first.get(n)} -> {v}" for n, v in key if first.get(n) != v]
                out.append((kernel, phase, diff))
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", choices=("mtp", "dflash2"), default="dflash2")
    ap.add_argument("--concurrency", default="1")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=40, help="tokens per request")
    ap.add_argument("--warmup", type=int, default=3, help="rounds per concurrency before keys count as new")
    ap.add_argument("--rate", type=float, default=0.7, help="forced drafts: probability a draft is the reference")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("run under the Triton interpreter: TRITON_INTERPRET=1")
    from revolta.kernels import hc
    from revolta.kernels.quant import gemv_nibble

    sm90_rule = gemv_nibble.use_nibble  # the H200's choices where the interpreter's defaults differ
    gemv_nibble.use_nibble = lambda arch, dtype, layout, nibble=None, M=1, N=None: sm90_rule(
        90, torch.float16, layout, nibble, M, N)
    dot_default = hc.hc_dot_default
    hc.hc_dot_default = lambda arch=None: dict(dot_default(arch), ENABLED=True)

    concurrency = [int(c) for c in args.concurrency.split(",")]
    cfg = standin_config(args.layers, args.experts, with_mtp=True, widths="tiny")
    model = build_model(cfg, "cpu", torch.float32, seed=0, with_mtp=True)
    prompts = random_prompts(max(concurrency), args.prompt_len, cfg.text.vocab_size - 1, 0)
    max_len = -(-(args.prompt_len + args.tokens + 64) // 256) * 256

    def config(spec):
        return EngineConfig(max_model_len=max_len, max_num_seqs=max(concurrency), kv_cache_gib=0.05,
                            max_num_batched_tokens=max(512, max(concurrency) * args.prompt_len), kernels="triton",
                            enable_prefix_caching=False, speculative_config=spec)

    recorder = KeyRecorder()
    plain, refs = Engine(model, config({"method": None})), {}
    for C in concurrency:
        reqs = [Req(f"c{C}r{i}", p, args.tokens, device="cpu") for i, p in enumerate(prompts[:C])]
        for r in reqs:
            plain.add_request(r)
        while plain.has_unfinished():
            plain.step()
        refs.update({r.request_id: (len(r.prompt_token_ids), r.token_ids) for r in reqs})
    plain.close()
    spec = {"method": args.method, "draft_policy": "always"}
    with tempfile.TemporaryDirectory() as tmp:
        if args.method == "dflash2":
            spec["model"] = str(write_drafter(cfg, Path(tmp) / "drafter", device="cpu", dtype=torch.float32,
                                              shape=DrafterShape.tiny()))
        else:
            spec["num_speculative_tokens"] = 4
        engine = Engine(model, config(spec))
    rng = random.Random(0)
    force_drafts(engine, refs, lambda rid, d: [t if rng.random() < args.rate else (t + 1) % cfg.text.vocab_size
                                               for t in d])
    steady = set()
    for C in concurrency:
        reqs = [Req(f"c{C}r{i}", p, args.tokens, device="cpu") for i, p in enumerate(prompts[:C])]
        for r in reqs:
            engine.add_request(r)
        n = 0
        while engine.has_unfinished():
            decoding = all(r.token_ids for r in reqs)
            recorder.phase = f"C{C} round {n}" if decoding else f"C{C} prefill"
            if decoding and n >= args.warmup:
                steady.add(recorder.phase)
            step_once(engine, reqs)
            n += decoding
        print(f"C{C}: {n} rounds, {engine.spec_stats.num_draft_tokens} drafts, "
              f"{engine.spec_stats.num_accepted_tokens} accepted so far")
    new = recorder.new_since(steady)
    kernels = collections.Counter(k for k, _, _ in new)
    print(f"\n{len(recorder.first_seen)} keys over {len(recorder.by_kernel)} kernels; {len(new)} first seen after "
          f"the {args.warmup} warm-up rounds (a compile each on a GPU), in {len(kernels)} kernels:")
    for kernel, phase, diff in sorted(new, key=lambda x: (x[0], x[1])):
        print(f"  {kernel:40s} {phase:14s} {'; '.join(diff)[:200]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

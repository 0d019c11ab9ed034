"""Launch-config sweep of the nibble GEMV (kernels/quant/gemv_nibble.py) at the real projection shapes (issue 21).

Times a grid of nibble GEMV configs (BLOCK_N, SPLIT_K, num_warps, num_stages; BLOCK_M 16) beside the default that
`nibble_gemv_config` picks, on AWQ g32 weights, each checked against the fp32 reference; timed as bench_quant.py
times (CUDA graph replays of back-to-back calls over rotating weight copies, L2 flushed). Prints, per (projection,
M): the default's time, the best config found, and both as % of the copy bandwidth measured in the same run
(bandwidth on the packed bytes over a 1 GiB device copy's, read + write counted: bench_quant.py's "% copy"), and
"read us": one kernel that only reads the same bytes, timed the same way (read_ceiling.py), with the default's time
over it ("%read"): how far the GEMV is from reading its bytes at that size.

    PYTHONPATH=src python benchmarks/sweep_nibble_gemv.py [--ms 1,8] [--dtype fp16] [--json F]
        [--quick | --wordcol | --half2] [--fixup | --fixup-only | --pdl]

--fixup adds, beside every split word-column or nibble config, the same config with the split-K reduce inside the GEMV (FIXUP:
the last K slice of each tile adds the partials; counters owned by the caller, as a layer owns them, "/fx"), and the
default's with counters zeroed by a memset each call ("/fxm"). --pdl: the default config only, with and without the GEMV
and its reduce launched by programmatic dependent launch ("/pdl", sm_90's default: back-to-back calls chain too).
    PYTHONPATH=src python benchmarks/sweep_nibble_gemv.py --small    # CPU interpreter: two configs, correctness
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

SHAPES = (("qsa q_proj", 12288, 2560), ("gdn out_proj", 2560, 6144), ("expert gate_up", 1280, 2560),
          ("expert down", 2560, 640), ("gdn in_proj_qkv", 10240, 2560), ("gdn in_proj_z", 6144, 2560),
          ("qsa k_proj", 512, 2560),
          # the merged packed input projections a layer runs at decode (layers/merged_linear.merge_quant_linears):
          # GDN in_proj_qkv + in_proj_z, QSA q + k + v + indexer q/k
          ("gdn in_proj merged", 16384, 2560), ("qsa in_proj merged", 13952, 2560))
FIRST_SHAPES = 4  # the default sweep's; --wordcol and --shapes reach the rest
GRID = dict(BLOCK_N=(64, 128, 256), SPLIT_K=(1, 2, 4, 8, 16, 32), num_warps=(4, 8), num_stages=(3, 4))
QUICK = dict(BLOCK_N=(64, 128, 256), SPLIT_K=(4, 8, 16), num_warps=(4,), num_stages=(3,))  # --quick: 9 configs
# at M = 1 (--wordcol, --small) the word-column GEMV (gemv_wordcol.py) too (SPLIT_K None: wordcol_config's split)
# 512 features: two words a thread, twice a program's loads in flight per step; 128 slices lost everywhere (K6c)
WORDCOL = dict(BLOCK_N=(256, 512), num_warps=(1,), SPLIT_K=(None, 32, 64), rows=(32, 16, 8), prefetch=(False, True))
# --half2: the fp16-pair walk (gemv_wordcol.wordcol_slice_half2; fp16 only) beside the default and the fp32 walk's
# (512 / 1024 features, 2 / 4 words a thread with one 8- / 16-byte load a row, lost: RESULTS.md K6i)
HALF2 = dict(BLOCK_N=(256,), num_warps=(1,), SPLIT_K=(None, 32), rows=(32, 16, 8))


def with_fixup(cfgs):
    """cfgs and, after them, each split word-column config with FIXUP ("/fx"), and the first such with counters
    zeroed by a memset each call ("/fxm": COUNTERS "memset", read by main)."""
    fx = [c | dict(FIXUP=True) for c in cfgs if (c.get("WORDCOL") or c.get("NIBBLE_DOT")) and c["SPLIT_K"] > 1]
    return cfgs + fx + [fx[0] | dict(COUNTERS="memset")] if fx else cfgs


def configs(M, N, K, group, device, small, grid, half2=False, dtype=torch.float16):
    """The sweep's configs for one shape (the model's default first: gemv_nibble.gemv_config_for), each a full GEMV
    config; grid None: the default, the nibble path's and the word-column configs only; half2: the default, the
    nibble path's, the fp32 walk's default config and HALF2's."""
    from revolta.kernels.quant.common import device_facts
    from revolta.kernels.quant.gemv_nibble import gemv_config_for, nibble_gemv_config
    from revolta.kernels.quant.nibble import split_len

    default = gemv_config_for(torch.empty(M, K, dtype=dtype, device=device), N, K, group, "awq")
    base = nibble_gemv_config(M, N, K, group, "awq", *device_facts(device))
    out = [default] + ([base] if base != default else [])
    out.append(base | dict(SCALE_AHEAD=False))  # the nibble path with the scales loaded in their own K step
    wordcol_only = grid is None
    if small:
        grid = dict(BLOCK_N=(32,), SPLIT_K=(1, 2), num_warps=(4,), num_stages=(2,))
    if wordcol_only:
        out, grid = out[:-1], {}
    for bn, sk, w, s in itertools.product(*grid.values()) if grid else ():
        if bn > N or K // base["BLOCK_K"] < 2 * sk:
            continue
        c = base | dict(BLOCK_N=bn, SPLIT_K=sk, num_warps=w, num_stages=s,
                        k_per_split=split_len(K, sk, base["BLOCK_K"]))
        if c != base:
            out.append(c)
    from revolta.kernels.quant.gemv_wordcol import wordcol_config

    sms = device_facts(device)[0]
    if half2 and M <= 8:  # several rows: a program row each (gemv_wordcol: asked for only)
        fp32_walk = wordcol_config(N, K, group, sms)
        out += [fp32_walk] if fp32_walk not in out else []
        for bn, w, sk, rows in itertools.product(*HALF2.values()):
            c = wordcol_config(N, K, group, sms, bn, w, sk, rows, half2=True) if K // rows >= 2 * (sk or 1) else None
            out += [c] if c is not None and c not in out else []  # the default split may be 32 (timed once)
        return out
    if M == 1 and (small or wordcol_only):  # the word-column GEMV (gemv_wordcol.py): one row only
        for bn, w, sk, rows, pf in itertools.product(*WORDCOL.values()):
            if bn <= max(256, N) and K // rows >= 2 * (sk or 1) and (rows == 8 or not pf):
                c = wordcol_config(N, K, group, sms, bn, w, sk, rows, pf)
                out += [c] if c not in out else []
    return out


def name(c):
    if c.get("WORDCOL"):
        return (f"wc{c['BLOCK_N']}/sk{c['SPLIT_K']}/w{c['num_warps']}/r{c['BLOCK_K']}"
                + ("/pf" if c["PREFETCH"] else "") + ("/h2" if c.get("HALF2") else "")
                + ("/fxm" if c.get("COUNTERS") == "memset" else "/fx" if c.get("FIXUP") else "")
                + ("/pdl" if c.get("PDL") else ""))
    if not c.get("NIBBLE_DOT"):  # the tile path (common.gemv_config: the default off sm80+ and in the interpreter)
        return f"tile{c['BLOCK_M']}x{c['BLOCK_N']}/sk{c['SPLIT_K']}"
    ahead = "" if c["SCALE_AHEAD"] else "/now"  # "now": scales loaded in their own K step
    fx = "/fxm" if c.get("COUNTERS") == "memset" else "/fx" if c.get("FIXUP") else ""
    pdl = "/pdl" if c.get("PDL") else ""
    return f"n{c['BLOCK_N']}/sk{c['SPLIT_K']}/w{c['num_warps']}/s{c['num_stages']}{ahead}{fx}{pdl}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1,8")
    ap.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--quick", action="store_true", help="9 configs a shape (QUICK) instead of 72 (GRID)")
    ap.add_argument("--wordcol", action="store_true", help="the default and the word-column configs only (M = 1)")
    ap.add_argument("--half2", action="store_true", help="the default, the fp32 walk and the fp16-pair walk (M = 1; "
                    "bf16 x scaled into fp16 a step at a time)")
    ap.add_argument("--fixup", action="store_true", help="also each split word-column config with the split-K "
                    "reduce inside the GEMV (FIXUP), and the default's with per-call zeroed counters")
    ap.add_argument("--fixup-only", action="store_true", help="the default config only, beside it with the reduce "
                    "inside (FIXUP) over the caller's counters and over per-call zeros")
    ap.add_argument("--pdl", action="store_true", help="the default config only, with and without its launches chained "
                    "by programmatic dependent launch (PDL)")
    ap.add_argument("--shapes", default=None, help="comma-separated projection names of SHAPES (default: all)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.small:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from bench_quant import bench, copy_gbs, packed_awq, packed_nbytes, rel_err, rotating

    from read_ceiling import read_us

    from revolta.kernels.quant.awq import awq_gemv

    device = torch.device("cpu" if args.small else "cuda")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = (("small", 128, 256),) if args.small else SHAPES if args.wordcol or args.half2 else SHAPES[:FIRST_SHAPES]
    if args.shapes:
        shapes = tuple(sh for sh in SHAPES if sh[0] in args.shapes.split(","))
    grid = None if args.wordcol or args.half2 else QUICK if args.quick else GRID  # None: no nibble variants
    rows, t0 = [], time.time()
    gbs = copy_gbs(args.small)
    print(f"device {torch.cuda.get_device_name() if not args.small else 'cpu'}, {args.dtype}, AWQ g{args.group}, "
          f"copy bandwidth {gbs:,.0f} GB/s")
    print(f"{'projection':16s} {'M':>3s} {'floor us':>8s} {'default':>22s} {'us':>8s} {'%copy':>6s} "
          f"{'best':>22s} {'us':>8s} {'%copy':>6s} {'read us':>8s} {'%read':>6s} {'configs':>7s} {'worst err':>9s}")
    for label, N, K in shapes:
        fmt, t = packed_awq(N, K, args.group, device, gen)
        floor_us = packed_nbytes(t) / gbs / 1e3  # the packed bytes at the copy bandwidth
        w_ref = fmt.dequantize(t, torch.float32)
        copies = rotating(t, args.small)
        r_us = read_us(copies, bench, args.small)  # one kernel reading the same bytes over the same copies
        for M in (int(m) for m in args.ms.split(",")):
            x = torch.randn(M, K, generator=gen, device=device).to(dtype)
            want = x.float() @ w_ref.t()
            timed, worst = [], 0.0
            cfgs = configs(M, N, K, args.group, device, args.small, grid, args.half2, dtype)
            counters = torch.zeros(N, dtype=torch.int32, device=device)  # a layer's own (the "/fx" rows)
            if args.pdl:
                cfgs = [cfgs[0] | dict(PDL=False), cfgs[0] | dict(PDL=True)]  # the default chains on sm_90
            elif args.fixup_only:
                cfgs = with_fixup(cfgs[:1])
            elif args.fixup:
                cfgs = with_fixup(cfgs)
            for c in cfgs:
                def call(c=c, w=t):
                    return awq_gemv(x, w["qweight"], w["qzeros"], w["scales"], args.group, config=c,
                                    counters=None if c.get("COUNTERS") == "memset" else counters)
                err = rel_err(call(), want)
                worst = max(worst, err)
                if err > 2e-2:
                    print(f"  WRONG {label} M={M} {name(c)}: rel err {err:.2e}")
                    continue
                timed.append((bench(lambda c=c: [call(c, w) for w in copies], args.small, True, len(copies)) * 1e3, c))
            d_us, d_cfg = timed[0]
            b_us, b_cfg = min(timed, key=lambda r: r[0])
            rows.append(dict(proj=label, N=N, K=K, M=M, floor_us=floor_us, copy_GBps=gbs, default=name(d_cfg),
                             default_us=d_us, best=name(b_cfg), best_us=b_us, read_us=r_us, worst_err=worst,
                             all={name(c): us for us, c in timed}))
            print(f"{label:16s} {M:>3d} {floor_us:8.2f} {name(d_cfg):>22s} {d_us:8.2f} {floor_us / d_us:6.1%} "
                  f"{name(b_cfg):>22s} {b_us:8.2f} {floor_us / b_us:6.1%} {r_us:8.2f} {r_us / d_us:6.1%} "
                  f"{len(timed):>7d} {worst:9.2e}", flush=True)
    print(f"{time.time() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The HyperConnection write fused into the next read's down pass (`hc_combine_read`, the sm90 default at 4-16 rows:
kernels/hc_dot.py with COMBINE) against the two launches it replaced (`hc_combine` then `hc_read`), and down-pass
variants that do not spill (issue 19; not yet timed on a GPU).

Why: the sm_90 build of the dot down pass with the write inside holds 255 registers and spills (744 B at its default
BLOCK_K 256 / 4 warps with the local Triton; BLOCK_K 128 / 8 warps and 64 / 8 warps build without spills:
tests/kernels/test_moe_aot.py builds it), so the fused launch may cost more than the launch it saves. One H200,
bf16, d 2560, h 4, r 320; each case a CUDA graph of calls over 8 modules' weights (105 MB, beyond L2); correctness
of every variant against `hc_combine_read_ref` (y bitwise-close, the read within bf16 rounding).

    python benchmarks/bench_hc_combine.py [--ms 4,5,8,16]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
D, NH, R = 2560, 4, 320
VARIANTS = {"bk128-w8": dict(BLOCK_K=128, WARPS_DOWN=8), "bk64-w8": dict(BLOCK_K=64, WARPS_DOWN=8),
            "bk256-w8": dict(BLOCK_K=256, WARPS_DOWN=8)}


def _wall_us(fns) -> float:
    t0 = time.perf_counter()
    for f in fns:
        f()
    return (time.perf_counter() - t0) * 1e6 / len(fns)


def main() -> int:
    from revolta.kernels import hc as HC

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ms", default="4,5,8,16")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1")
    args = ap.parse_args()
    import bench_moe_hc as b  # its timers and rel_err (HERE is on sys.path)

    dev = args.device
    if dev == "cpu":  # a smoke run of this script under the interpreter: fp16 (its bf16 dots are wrong), sm90 configs
        dt, arch, timer = torch.float16, 90, _wall_us
    else:
        dt, arch, timer = torch.bfloat16, HC._arch(torch.empty(1, device=dev)), b.graph_time_us
    gen = torch.Generator(device=dev).manual_seed(0)
    mods = [[torch.randn(NH * D, device=dev, generator=gen).to(dt) * 0.1,  # norm_w [h·d]
             (torch.randn(R, NH * D, device=dev, generator=gen) * (NH * D) ** -0.5).to(dt),  # w_down [r, h·d]
             (torch.randn(NH * D, R, device=dev, generator=gen) * R ** -0.5).to(dt),  # w_up [h·d, r]
             (torch.randn(NH, NH * D, device=dev, generator=gen) * (NH * D) ** -0.5).to(dt)]  # w_inject [h, h·d]
            for _ in range(8 if dev != "cpu" else 1)]
    name = torch.cuda.get_device_name() if dev != "cpu" else "CPU (interpreter, timings meaningless)"
    print(f"{name}, {str(dt)[6:]}, HC d {D} h {NH} r {R}; us per read (CUDA graph of {len(mods)} calls)")
    print(f"{'M':>3} {'combine + read':>14} {'fused (default)':>15} " + " ".join(f"{n:>9}" for n in VARIANTS)
          + f" {'worst rel err':>13}")
    bad = 0
    for M in (int(m) for m in args.ms.split(",")):
        xs = [torch.randn(M, NH * D, device=dev, generator=gen).to(dt) for _ in mods]
        inj = [(torch.rand(M, NH, device=dev, generator=gen) * 2).to(dt) for _ in mods]
        us = [torch.randn(M, D, device=dev, generator=gen).to(dt) for _ in mods]
        base = HC.hc_config(M, D, R, NH, arch=arch)
        configs = {"default": None} | {n: dict(base, **v) for n, v in VARIANTS.items()}
        ref = HC.hc_combine_read_ref(xs[0], inj[0], us[0], mods[0][0], mods[0][1], mods[0][2], mods[0][3], NH, 1e-6)
        worst = 0.0
        for cfg in configs.values():
            got = HC.hc_combine_read(xs[0], inj[0], us[0], *mods[0], NH, 1e-6, config=cfg)
            worst = max(worst, *(b.rel_err(g, r) for g, r in zip(got, ref)))
        bad += worst > 2e-2

        def two(i):
            y = HC.hc_combine(xs[i], inj[i], us[i])
            return HC.hc_read(y, *mods[i], NH, 1e-6)

        t_two = timer([lambda i=i: two(i) for i in range(len(mods))])
        times = {n: timer([lambda i=i, c=c: HC.hc_combine_read(xs[i], inj[i], us[i], *mods[i], NH, 1e-6,
                                                                         config=c) for i in range(len(mods))])
                 for n, c in configs.items()}
        print(f"{M:>3} {t_two:>14.2f} {times['default']:>15.2f} " + " ".join(f"{times[n]:>9.2f}" for n in VARIANTS)
              + f" {worst:>13.2e}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the packed int4 kernels' time goes, from the hardware counters (issue 21: the AWQ MoE at 15-22% of the copy
bandwidth and the dense GEMV at 8-21%, RESULTS.md K5c / K6, while their sm_90 inner loops are 6-8 SASS instructions
per weight: something other than decode instructions bounds them).

Launches each kernel once between cudaProfilerStart / Stop after a warm-up (compiles, workspaces), so Nsight
Compute profiles exactly those launches; `--report CSV` turns its raw CSV into one table row per kernel: duration,
DRAM throughput, achieved occupancy and what limits it, registers, shared memory, grid, and the top warp stall
reasons (cycles per issued instruction by reason).

    ncu --clock-control none --profile-from-start off --csv --page raw \\
        --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\\
sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,\\
launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,launch__occupancy_limit_warps,\\
launch__shared_mem_per_block_dynamic,smsp__average_warp_latency_per_inst_issued.ratio,\\
regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio \\
        python benchmarks/ncu_quant.py > ncu.csv
    python benchmarks/ncu_quant.py --report ncu.csv

Cases (bf16, the real shapes, AWQ group 32): the expert-grouped MoE (512 experts + the shared one, top-10, hidden
2560, ffn 640) at M = 1, 8, 40 on its default path, the 16-bit grouped MoE at M = 8 beside it (95% of copy: the
reference for a kernel that streams well), and the dense GEMV of GDN's in_proj_qkv at M = 1 and 8 on both paths.
`--device cpu` runs the same launches small under the interpreter (a smoke test of this script, no counters).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def cases(device: str):
    """[(label, fn)]: each fn launches one case's kernels once."""
    import bench_moe_hc as hc  # the benchmarks' own setups (HERE is on sys.path)
    import bench_quant as bq
    import bench_quant_moe as qm

    from revolta.kernels import moe as MOE
    from revolta.kernels.quant import moe as QMOE
    small = device == "cpu"
    h, i, e, k = (64, 32, 16, 4) if small else (qm.H, qm.I, qm.E, qm.TOPK)
    dt = torch.float16 if small else torch.bfloat16  # the interpreter's bf16 dots are wrong
    gen = torch.Generator(device=device).manual_seed(0)
    (gate_up, down), shared = qm.awq_bank(e, h, i, device, gen)
    w1, w2, shared16 = hc._moe_bank(e, dt, gen, device, h, i)
    out = []
    for M in (1, 8, 40):
        x = torch.randn(M, h, device=device, dtype=dt, generator=gen)
        route = MOE.moe_route(hc.routing(M, "uniform", gen, 1, e, device)[0], k,
                              shared_logits=torch.randn(M, device=device, generator=gen))
        out.append((f"awq moe M={M}", lambda x=x, r=route: QMOE.quant_fused_moe(x, gate_up, down, *r,
                                                                               shared_expert=shared)))
        if M == 8:
            out.append((f"16-bit moe M={M}", lambda x=x, r=route: MOE.fused_moe(x, w1[:e], w2[:e], *r,
                                                                               shared_expert=shared16)))
    n, kk = (256, 128) if small else (8192, 2560)  # GDN in_proj_qkv at the real widths (conv dim x hidden)
    fmt, t = bq.packed_awq(n, kk, qm.GROUP, device, gen)
    for M in (1, 8):
        x = torch.randn(M, kk, device=device, dtype=dt, generator=gen)
        for path, nibble in (("tile", False), ("nibble", True)):
            out.append((f"awq gemv {n}x{kk} M={M} {path}", lambda x=x, nb=nibble: fmt.gemv(x, t, None, nibble=nb)))
    return out


def run(device: str) -> None:
    todo = cases(device)
    for _, fn in todo:  # warm-up: compile every kernel, allocate workspaces
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    for label, fn in todo:
        if device == "cuda":
            torch.cuda.nvtx.range_push(label)
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
    if device == "cuda":
        torch.cuda.profiler.stop()
    print("# cases, in launch order: " + "; ".join(label for label, _ in todo), file=sys.stderr)


STALL = "smsp__average_warps_issue_stalled_"


def report(path: str) -> None:
    """ncu --csv --page raw output -> one markdown row per kernel launch."""
    with open(path) as f:
        lines = [ln for ln in f if ln.startswith('"')]  # drop the program's own output and ncu's "==PROF==" lines
    rows = list(csv.DictReader(lines))
    rows = [r for r in rows if r.get("Kernel Name") and r.get("ID", "").isdigit()]  # skip the units row
    print("| # | kernel | grid | regs | smem KB | us | DRAM % peak | warps active % | occupancy limits (reg / smem / "
          "warps) | cycles / issue | top stalls (cycles per issue) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        def g(key, scale=1.0):
            try:
                return float(r[key].replace(",", "")) * scale
            except (KeyError, ValueError):
                return float("nan")
        stalls = sorted(((g(key), key[len(STALL):].replace("_per_issue_active.ratio", ""))
                         for key in r if key.startswith(STALL) and not key.endswith("not_issued_per_issue_active.ratio")),
                        reverse=True)[:4]
        top = ", ".join(f"{name} {v:.1f}" for v, name in stalls if v == v)
        print(f"| {r['ID']} | {r['Kernel Name'][:40]} | {r.get('launch__grid_size', '')} | "
              f"{r.get('launch__registers_per_thread', '')} | {g('launch__shared_mem_per_block_dynamic') / 1024:.1f} | "
              f"{g('gpu__time_duration.sum', 1e-3):.2f} | {g('dram__throughput.avg.pct_of_peak_sustained_elapsed'):.1f} | "
              f"{g('sm__warps_active.avg.pct_of_peak_sustained_active'):.1f} | "
              f"{r.get('launch__occupancy_limit_registers', '')} / {r.get('launch__occupancy_limit_shared_mem', '')} / "
              f"{r.get('launch__occupancy_limit_warps', '')} | "
              f"{g('smsp__average_warp_latency_per_inst_issued.ratio'):.1f} | {top} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--report", default=None, help="summarise an ncu --csv --page raw file instead of running")
    args = ap.parse_args()
    if args.report:
        report(args.report)
    else:
        run(args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())

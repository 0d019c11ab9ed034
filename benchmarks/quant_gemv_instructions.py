"""SASS instructions per weight in the inner K loop of the dense packed GEMV: the tile path (common.py's kernels in
awq.py / ct_int4.py / nvfp4.py) against the nibble path (gemv_nibble.py), built ahead of time (no GPU needed).

Builds are test_quant_aot.py's (the GDN in_proj_qkv shape, each path's launch config for the arch at M = 1, 8, 40),
with the arguments the launcher specialises as multiples of 16 marked so (test_quant_aot._aligned). RESULTS.md's
counts before K6b were of builds without, whose loads did not vectorise (the nibble M = 1 loop at 128 features: 7.7
per weight there, 6.3 with).
Counting as quant_moe_instructions.py: the inner loop is the shortest backward branch holding an MMA or FFMA
(aot.inner_loop_sass); per weight = loop instructions / weights a thread decodes per iteration (BLOCK_N x BLOCK_K /
threads). sm_70 SASS is not disassembled by CUDA 13's tools: PTX only there.

    PYTHONPATH=src python benchmarks/quant_gemv_instructions.py [--archs 90,70]
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", default="90")
    args = ap.parse_args()
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "kernels"))
    sys.path.insert(0, HERE)
    import test_quant_aot as T
    from quant_moe_instructions import GROUPS, families

    from revolta.kernels import aot

    print(f"{'arch':>5} {'build':24s} {'BM':>3} {'BN':>4} {'BK':>3} {'split':>5} {'w/thr':>6} {'SASS':>5} {'per w':>6} "
          f"{'PTX':>5} {'per w':>6} " + " ".join(f"{f:>5}" for f in (*GROUPS, "other")))
    for arch in (int(a) for a in args.archs.split(",")):
        for name, (kernel, names, types, c, warps, stages) in T._builds(arch).items():
            if "_gemv_M" not in name:
                continue
            built = aot.build(kernel, T._sig(names, types, T.ACT[arch]), c, arch, warps, stages,
                              T._aligned(names, types))
            sass = aot.inner_loop_sass(built.asm["cubin"]) if arch >= 75 else []
            ptx = aot.inner_loop_ptx(built.asm["ptx"])
            per = c["BLOCK_N"] * c["BLOCK_K"] / (32 * warps)
            fam = " ".join(f"{v:>5}" for v in families(sass).values()) if sass else ""
            counts = " ".join(f"{len(ops):>5} {len(ops) / per:>6.2f}" if ops else f"{'-':>5} {'-':>6}"
                              for ops in (sass, ptx))
            print(f"sm_{arch} {name:24s} {c['BLOCK_M']:>3} {c['BLOCK_N']:>4} {c['BLOCK_K']:>3} {c['SPLIT_K']:>5} "
                  f"{per:>6.0f} {counts} {fam:>35}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""SASS instructions per weight in the inner K loop of the packed-expert MoE kernels (kernels/quant/moe.py: the tile
path; kernels/quant/moe_decode.py: the nibble path), built ahead of time for sm_90 and sm_70 (no GPU needed).

Builds are test_quant_moe_aot.py's (real shapes, the run-time alignment specialisation, each path's config from
`quant_grouped_config`). The inner loop is the shortest backward branch of the cubin (aot.inner_loop_sass): the
software-pipelined K step; for sm_70, whose SASS CUDA 13's tools no longer disassemble, only the PTX loop
(aot.inner_loop_ptx) is counted. Per weight = loop instructions / weights a thread handles per iteration
(rows x K step x (2 for gate_up) / threads). The opcode columns (SASS) show where the instructions go.

    PYTHONPATH=src python benchmarks/quant_moe_instructions.py [--archs 90,70] [--fmts awq,ct_int4] [--ms 1,8]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GROUPS = {  # opcode family -> opcodes (prefix before the first dot)
    "int": ("IMAD", "LOP3", "SHF", "IADD3", "LEA", "PRMT", "IMNMX", "SEL", "MOV", "I2F", "F2I", "I2FP", "F2FP"),
    "fp": ("FADD", "FMUL", "FFMA", "HADD2", "HMUL2", "HFMA2", "FSEL", "MUFU"),
    "mma": ("HMMA", "HGMMA", "IMMA"),
    "mem": ("LDG", "LDGSTS", "LDS", "LDSM", "STS", "SHFL", "BAR", "LDGDEPBAR", "DEPBAR", "STG"),
}


def families(ops: list[str]) -> dict[str, int]:
    count = collections.Counter(op.split(".")[0] for op in ops)
    out = {f: sum(count[o] for o in names) for f, names in GROUPS.items()}
    out["other"] = len(ops) - sum(out.values())
    return out


def weights_per_thread(name: str, consts: dict, warps: int) -> float:
    return (2 if "gate_up" in name else 1) * consts["BLOCK_N"] * consts["BLOCK_K"] / (32 * warps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", default="90,70")
    ap.add_argument("--fmts", default="awq,ct_int4")
    ap.add_argument("--ms", default="1,8")
    args = ap.parse_args()
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "kernels"))
    import test_quant_moe_aot as T
    from test_moe_aot import _compile

    from revolta.kernels import aot
    from revolta.kernels.quant import moe

    print(f"{'arch':>5} {'build':34s} {'BN':>4} {'BK':>4} {'w/thr':>6} {'SASS':>5} {'per w':>6} {'PTX':>5} {'per w':>6} "
          + " ".join(f"{f:>5}" for f in (*GROUPS, "other")) + f" {'regs':>5} {'spill':>5}")
    for arch in (int(a) for a in args.archs.split(",")):
        for fmt in args.fmts.split(","):
            wt, consts = T.FORMATS[fmt]
            for M in (int(m) for m in args.ms.split(",")):
                builds = {}
                cfg = moe.quant_grouped_config(M, T.TOP_K, T.EXPERTS + 1, arch, nibble=False)
                flags = dict(consts, BLOCK_M=cfg["BLOCK_M"], USE_DOT=cfg["USE_DOT"], HAS_SHARED=True, SORTED=M > 1)
                for what, kernel, names, types, n, k in (
                        ("gate_up", moe._quant_gate_up_kernel, T.GATE_UP, "a" + wt * 3 + "aiiiiinnnnnnnn" + "c" * 11,
                         "BLOCK_N_UP", "BLOCK_K_UP"),
                        ("down", moe._quant_down_kernel, T.DOWN, "a" + wt * 2 + "ffiiiiinnnnnnnn" + "c" * 10,
                         "BLOCK_N_DOWN", "BLOCK_K_DOWN")):
                    c = dict(flags, BLOCK_N=cfg[n], BLOCK_K=moe.fit_block_k(cfg[k], consts["G"]))
                    if what == "gate_up":
                        c["TOP_K"] = T.TOP_K
                    builds[f"{fmt}_tile_M{M}_{what}"] = (kernel, names, types, c, cfg["num_warps"], cfg["num_stages"],
                                                         fmt)
                builds.update({n: b for n, b in T.nibble_builds(fmt, M, arch).items() if "split_act" not in n})
                for name, (kernel, names, types, c, warps, stages, f) in builds.items():
                    sig = T._sig(names, types, T.ACT[arch])
                    built = aot.build(kernel, sig, c, arch, warps, stages, T._aligned(names, types, f))
                    sass = aot.inner_loop_sass(built.asm["cubin"]) if arch >= 75 else []  # CUDA 13: no sm_70 SASS
                    ptx = aot.inner_loop_ptx(built.asm["ptx"])
                    rep = _compile(kernel, sig, c, arch, warps, stages, T._aligned(names, types, f))
                    per = weights_per_thread(name, c, warps)
                    fam = " ".join(f"{v:>5}" for v in families(sass).values()) if sass else ""
                    counts = " ".join(f"{len(ops):>5} {len(ops) / per:>6.2f}" if ops else f"{'-':>5} {'-':>6}"
                                      for ops in (sass, ptx))  # "-": no loop found (none disassembled)
                    print(f"sm_{arch} {name:34s} {c['BLOCK_N']:>4} {c['BLOCK_K']:>4} {per:>6.0f} {counts} {fam:>35} "
                          f"{rep.registers:>5} {rep.spill_store_bytes:>5}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

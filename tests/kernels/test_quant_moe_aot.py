"""Ahead-of-time builds (no GPU) of the packed-expert MoE kernels (kernels/quant/moe.py) for sm_70 (V100, fp16
activations) and sm_90 (H200, bf16) at the real shapes (hidden 2560, ffn 640, 512 experts + the shared one, top-10
+ 1), in the launch configs `quant_grouped_config` picks at M = 1, 8, 40: the tile path (nibble=False) for AWQ group 32
at every M, compressed-tensors int4 (asymmetric) and NVFP4 at M = 8; the group-factored path (moe_decode.py, the
sm80+ default; on sm_70 in its narrow tiles) for AWQ at M = 1, 8, 40, compressed-tensors int4 at M = 1, 8 and NVFP4
at M = 8, with no spills on either arch. sm_70 budgets: no spills, <= 96 KiB shared memory, no Ampere/Hopper
instructions. Built with the run-time alignment specialisation (pointers, sizes and strides multiples of 16).

Builds run in spawned processes with TRITON_INTERPRET=0, with test_moe_aot.py's `_compile`.
Print the table: `python tests/kernels/test_quant_moe_aot.py`.
"""

import dataclasses
import os
import sys

import pytest

ACT = {70: "*fp16", 90: "*bf16"}
HIDDEN, FFN, EXPERTS, TOP_K = 2560, 640, 512, 11
FORMATS = {  # name -> (weight tensor types: h fp16, w bf16, i int32, b uint8, f fp32; constexprs)
    "awq": ("iih", dict(FMT=0, G=32, HAS_ZP=True, INVERTED=False)),
    "ct_int4": ("iwi", dict(FMT=1, G=32, HAS_ZP=True, INVERTED=False)),
    "nvfp4": ("bbf", dict(FMT=2, G=16, HAS_ZP=False, INVERTED=False)),
}
GATE_UP = ("x w0 w1 w2 sg0 sg1 sg2 su0 su1 su2 act topk_ids order slot_expert slot_start slot_end num_routed H I "
           "stride_xm stride_e0 stride_e1 stride_e2 stride_am FMT G HAS_ZP INVERTED TOP_K BLOCK_M BLOCK_N BLOCK_K "
           "USE_DOT HAS_SHARED SORTED")
DOWN = ("act w0 w1 w2 sd0 sd1 sd2 topk_weights y topk_ids order slot_expert slot_start slot_end num_routed H I "
        "stride_am stride_e0 stride_e1 stride_e2 stride_ym FMT G HAS_ZP INVERTED BLOCK_M BLOCK_N BLOCK_K USE_DOT "
        "HAS_SHARED SORTED")

NIBBLE_GATE_UP = ("x w0 w1 w2 sg0 sg1 sg2 su0 su1 su2 act ws topk_ids order slot_expert slot_start slot_end num_routed H "
                  "I T stride_xm stride_e0 stride_e1 stride_e2 stride_am k_split FMT G HAS_ZP INVERTED TOP_K BLOCK_M "
                  "BLOCK_N BLOCK_K HAS_SHARED SORTED SPLIT SCALE_AHEAD")
NIBBLE_DOWN = ("act w0 w1 w2 sd0 sd1 sd2 topk_weights y topk_ids order slot_expert slot_start slot_end num_routed H I "
               "stride_am stride_e0 stride_e1 stride_e2 stride_ym k_split FMT G HAS_ZP INVERTED BLOCK_M BLOCK_N BLOCK_K "
               "HAS_SHARED SORTED SPLIT SCALE_AHEAD")

NIBBLE_BUILDS = (("awq", 1), ("awq", 8), ("awq", 40), ("ct_int4", 1), ("ct_int4", 8), ("nvfp4", 8))


def _sig(names, types, act):
    table = {"a": act, "h": "*fp16", "w": "*bf16", "f": "*fp32", "i": "*i32", "b": "*u8", "n": "i32", "c": "constexpr"}
    names = names.split()
    assert len(names) == len(types), (names, types)
    return {n: table[t] for n, t in zip(names, types)}


def _aligned(names, types, fmt):
    """Pointers, sizes and strides that are multiples of 16 at the real shapes (not NVFP4's per-expert global
    scales: 2 or 1 per expert)."""
    from test_moe_aot import aligned_args

    return aligned_args(names, types, "ahwfib", ("H", "I", "num_routed", "k_split"),
                        skip=("stride_e2",) if fmt == "nvfp4" else ())


def _builds(arch):
    from revolta.kernels.quant import moe

    b = {}
    for fmt, Ms in (("awq", (1, 8, 40)), ("ct_int4", (8,)), ("nvfp4", (8,))):
        wt, consts = FORMATS[fmt]
        for M in Ms:
            cfg = moe.quant_grouped_config(M, TOP_K, EXPERTS + 1, arch, nibble=False)
            launch = (cfg["num_warps"], cfg["num_stages"])
            flags = dict(consts, BLOCK_M=cfg["BLOCK_M"], USE_DOT=cfg["USE_DOT"], HAS_SHARED=True, SORTED=M > 1)
            up = dict(flags, TOP_K=TOP_K, BLOCK_N=cfg["BLOCK_N_UP"], BLOCK_K=moe.fit_block_k(cfg["BLOCK_K_UP"], consts["G"]))
            down = dict(flags, BLOCK_N=cfg["BLOCK_N_DOWN"], BLOCK_K=moe.fit_block_k(cfg["BLOCK_K_DOWN"], consts["G"]))
            b[f"{fmt}_gate_up_M{M}"] = (moe._quant_gate_up_kernel, GATE_UP, "a" + wt * 3 + "aiiiiinnnnnnnn" + "c" * 11,
                                        up, *launch, fmt)
            b[f"{fmt}_down_M{M}"] = (moe._quant_down_kernel, DOWN, "a" + wt * 2 + "ffiiiiinnnnnnnn" + "c" * 10, down,
                                     *launch, fmt)
    for fmt, M in NIBBLE_BUILDS:
        b.update(nibble_builds(fmt, M, arch))
    b.update(wordcol_builds())
    return b


WORDCOL_GATE_UP = ("x w0 w1 w2 sg0 sg1 sg2 su0 su1 su2 act ws topk_ids num_routed H I T stride_xm stride_e0 stride_e1 "
                   "stride_e2 stride_am k_split TOP_K G BLOCK_N HAS_SHARED SPLIT EVEN ROWS PREFETCH HALF2 ASM")
WORDCOL_DOWN = ("act w0 w1 w2 sd0 sd1 sd2 topk_weights y topk_ids num_routed H I stride_am stride_e0 stride_e1 "
                "stride_e2 stride_ym k_split G BLOCK_N HAS_SHARED SPLIT EVEN ROWS PREFETCH HALF2 ASM")

def wordcol_builds():
    """The word-column MoE (moe_wordcol.py, AWQ) in the configs AWQ tokens take on sm80+ (moe_wordcol_config): one bf16
    token (MOE_WORDCOL: 64 / 16 K splits of 8-row steps), one fp16 token on fp16 pairs (MOE_WORDCOL_HALF2: its
    fma.rn.f16x2 as inline PTX, built for every arch), several tokens a program row per pair (MOE_WORDCOL_PAIRS and
    its fp16-pair twin); gate_up masked (I = 640 is 2.5 programs of 256 features)."""
    from revolta.kernels.quant import moe_wordcol
    from revolta.kernels.quant.moe import (MOE_WORDCOL, MOE_WORDCOL_BF16_PAIRS, MOE_WORDCOL_BF16_PAIRS_ROWS,
                                          MOE_WORDCOL_HALF2, MOE_WORDCOL_PAIRS, MOE_WORDCOL_PAIRS_HALF2)

    out = {}
    for tag, c in (("_M1", MOE_WORDCOL), ("_half2_M1", MOE_WORDCOL_HALF2), ("_pairs", MOE_WORDCOL_PAIRS),
                   ("_half2_pairs", MOE_WORDCOL_PAIRS_HALF2), ("_bf16_half2_pairs", MOE_WORDCOL_PAIRS_HALF2),
                   ("_bf16_half2_M1", MOE_WORDCOL_BF16_PAIRS), ("_bf16_half2_rows32", MOE_WORDCOL_BF16_PAIRS_ROWS)):
        act = "h" if c["HALF2"] and "bf16" not in tag else "a"  # bf16 on fp16 pairs: "a" is bf16 on sm_90
        flags = dict(G=32, HAS_SHARED=True, ROWS=c["ROWS"], PREFETCH=c["PREFETCH"], HALF2=c["HALF2"], ASM=True)
        joint = dict(JOINT=True) if c.get("JOINT") else {}  # gate and up in one walk (PDL is sm_90 only: not here)
        out[f"awq_wordcol{tag}_gate_up"] = (moe_wordcol._wordcol_gate_up_kernel, WORDCOL_GATE_UP + " JOINT" * bool(joint),
                                            act + "iih" * 3 + act + "fi" + "n" * 10 + "c" * (10 + bool(joint)),
                                            dict(flags, BLOCK_N=c["BLOCK_N_UP"], SPLIT=c["SPLIT_UP"], EVEN=False,
                                                 TOP_K=TOP_K, **joint),
                                            c["num_warps"], 1, "awq")
        out[f"awq_wordcol{tag}_down"] = (moe_wordcol._wordcol_down_kernel, WORDCOL_DOWN,
                                         act + "iih" * 2 + "ffi" + "n" * 9 + "c" * 9,
                                         dict(flags, BLOCK_N=c["BLOCK_N_DOWN"], SPLIT=c["SPLIT_DOWN"], EVEN=True),
                                         c["num_warps"], 1, "awq")
        # the reduces inside the kernels (FIXUP: each tile's last program adds the partials, counted in int32)
        out[f"awq_wordcol{tag}_gate_up_fx"] = (moe_wordcol._wordcol_gate_up_kernel,
                                               WORDCOL_GATE_UP + " JOINT" * bool(joint) + " counters FIXUP",
                                               act + "iih" * 3 + act + "fi" + "n" * 10 + "c" * (10 + bool(joint)) + "ic",
                                               dict(flags, BLOCK_N=c["BLOCK_N_UP"], SPLIT=c["SPLIT_UP"], EVEN=False,
                                                    TOP_K=TOP_K, FIXUP=True, **joint),
                                               c["num_warps"], 1, "awq")
        out[f"awq_wordcol{tag}_down_fx"] = (moe_wordcol._wordcol_down_kernel,
                                            WORDCOL_DOWN + " out counters TOP_K FIXUP",
                                            act + "iih" * 2 + "ffi" + "n" * 9 + "c" * 9 + act + "icc",
                                            dict(flags, BLOCK_N=c["BLOCK_N_DOWN"], SPLIT=c["SPLIT_DOWN"], EVEN=True,
                                                 TOP_K=TOP_K, FIXUP=True),
                                            c["num_warps"], 1, "awq")
    # gate and up in one walk (JOINT: both weights' words of a step in flight together), one token and several
    for tag in ("_half2_M1", "_half2_pairs"):
        kernel, names, types, consts, warps, stages, layout = out[f"awq_wordcol{tag}_gate_up"]
        out[f"awq_wordcol{tag}_gate_up_joint"] = (kernel, names + " JOINT", types + "c", dict(consts, JOINT=True),
                                                  warps, stages, layout)
    # program rows in expert order (EXPERT_ORDER: each row's pair read from moe_group's order)
    for part in ("gate_up", "down"):
        kernel, names, types, consts, warps, stages, layout = out[f"awq_wordcol_half2_pairs_{part}"]
        out[f"awq_wordcol_half2_pairs_{part}_eo"] = (kernel, names + " order EXPERT_ORDER", types + "ic",
                                                     dict(consts, EXPERT_ORDER=True), warps, stages, layout)
    return out


def nibble_builds(fmt, M, arch, overrides=None):
    """The nibble path's gate_up and down builds in `quant_grouped_config(..., nibble=True)`'s config (| overrides)."""
    from revolta.kernels.quant import common, moe, moe_decode, nibble

    wt, consts = FORMATS[fmt]
    cfg = moe.quant_grouped_config(M, TOP_K, EXPERTS + 1, arch, nibble=True) | (overrides or {})
    launch = (cfg["num_warps"], cfg["num_stages"])
    layout = moe.LAYOUTS[consts["FMT"]]
    flags = dict(consts, BLOCK_M=cfg["BLOCK_M"], HAS_SHARED=True, SORTED=M > 1, SCALE_AHEAD=cfg["SCALE_AHEAD"])
    up = dict(flags, TOP_K=TOP_K, BLOCK_N=cfg["BLOCK_N_UP"], SPLIT=cfg["SPLIT_UP"],
              BLOCK_K=nibble.nibble_block_k(cfg["BLOCK_K_UP"], consts["G"], layout))
    down = dict(flags, BLOCK_N=cfg["BLOCK_N_DOWN"], SPLIT=cfg["SPLIT_DOWN"],
                BLOCK_K=nibble.nibble_block_k(cfg["BLOCK_K_DOWN"], consts["G"], layout))
    tag = f"{fmt}_nibble_M{M}"
    extra = {}
    if cfg["SPLIT_UP"] > 1:
        extra["nibble_split_act"] = (moe_decode._split_act_kernel, "ws act T I stride_am SPLIT BLOCK", "fannncc",
                                     dict(SPLIT=cfg["SPLIT_UP"], BLOCK=common.REDUCE_BLOCK), 2, 2, fmt)
    return extra | {f"{tag}_gate_up": (moe_decode._nibble_gate_up_kernel, NIBBLE_GATE_UP,
                               "a" + wt * 3 + "af" + "i" * 5 + "n" * 10 + "c" * 12, up, *launch, fmt),
            f"{tag}_down": (moe_decode._nibble_down_kernel, NIBBLE_DOWN, "a" + wt * 2 + "ff" + "i" * 5 + "n" * 9 + "c" * 11,
                            down, *launch, fmt)}


def build_all(arch):
    """{name: CompileReport as a dict}; call with TRITON_INTERPRET unset or 0."""
    from test_moe_aot import _compile

    out = {}
    for name, (kernel, names, types, consts, warps, stages, fmt) in _builds(arch).items():
        out[name] = dataclasses.asdict(_compile(kernel, _sig(names, types, ACT[arch]), consts, arch, warps, stages,
                                                _aligned(names, types, fmt)))
    return out


@pytest.fixture(scope="module")
def reports():
    sys.path.insert(0, os.path.dirname(__file__))
    from test_moe_aot import build_in_spawned_children

    return build_in_spawned_children("test_quant_moe_aot")


@pytest.mark.parametrize("arch", [70, 90])
def test_aot_real_shapes(arch, reports):
    from test_moe_aot import check_reports

    check_reports(reports[arch], arch)
    spills = {n: r["spill_store_bytes"] for n, r in reports[arch].items()
              if ("nibble" in n or "wordcol" in n) and r["spill_store_bytes"]}
    assert not spills, f"sm_{arch} nibble / word-column builds spill (budget 0 on every arch): {spills}"
    assert sum("wordcol" in n for n in reports[arch]) == 32
    assert sum("nibble" in n for n in reports[arch]) == 2 * len(NIBBLE_BUILDS) + 1  # + the split-K act kernel


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"
    sys.path.insert(0, os.path.dirname(__file__))
    for arch in (70, 90):
        for name, r in build_all(arch).items():
            print(f"sm_{arch} {name:18s} shared {r['shared_bytes']:6d} B  regs {r['registers']:3d}  "
                  f"spill st/ld {r['spill_store_bytes']}/{r['spill_load_bytes']} B  forbidden {r['forbidden']}")

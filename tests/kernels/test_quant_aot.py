"""Ahead-of-time builds (no GPU) of the packed-weight kernels (kernels/quant) for sm_70 (V100, fp16
activations) and sm_90 (H200, bf16), at the real model's projection shapes in the launch configurations
the wrappers pick: the GEMV at M = 1, 8 (CUDA-core tile product) and 40 (tl.dot tiles), the nibble-path GEMV
(gemv_nibble.py: AWQ at M = 1, 8, 40, compressed-tensors int4 with zero points and NVFP4 at M = 1, in
`nibble_gemv_config`'s tiles for each arch), the one-row word-column GEMV (gemv_wordcol.py; its fp32 and fp16-pair
walks), the split-K reduce, and the dequantize kernels of the large-M path. sm_70 budgets: no spills, <= 96 KiB
shared memory, no Ampere/Hopper instructions (E4M3 scales and E2M1 codes are loaded as bytes and decoded with
integer ops).

Builds run in spawned processes with TRITON_INTERPRET=0 (the interpreter cannot compile), with
test_moe_aot.py's `_compile` (its sm_90 ptxas handling). Print the table: `python tests/kernels/test_quant_aot.py`.
"""

import dataclasses
import os
import sys

import pytest
import torch

ACT = {70: "*fp16", 90: "*bf16"}
SHAPE = (2560, 10240)  # (N, K): the GDN in_proj_qkv; the configs depend on N and K only through SPLIT_K
GEMV_ARGS = "x {w} ws out bias M N K stride_xm stride_om k_per_split"
TAIL = " BLOCK_M BLOCK_N BLOCK_K SPLIT_K USE_DOT HAS_BIAS"


def _sig(names, types, act):
    """a activation, h fp16, w bf16 (compressed-tensors scales), f fp32, i int32, b uint8 ptr; n int32; c constexpr."""
    table = {"a": act, "h": "*fp16", "w": "*bf16", "f": "*fp32", "i": "*i32", "b": "*u8", "n": "i32", "c": "constexpr"}
    names = names.split()
    assert len(names) == len(types), (names, types)
    return {n: table[t] for n, t in zip(names, types)}


def _aligned(names, types):
    """The arguments the launcher specialises as multiples of 16 at the real shapes (pointers, N, K, strides, the K
    slice): built with them, loads vectorise and pipeline as they do on the GPU (without, x loads were 2-byte LDGs
    outside cp.async in the nibble GEMV's sm_90 loop)."""
    from test_moe_aot import aligned_args

    return aligned_args(names, types, "ahwfib", ("N", "K", "k_per_split"))


def _builds(arch):
    from revolta.kernels.quant import awq, common, ct_int4, nvfp4

    N, K = SHAPE
    b = {}
    for M in (1, 8, 40):
        for fmt, kernel, w, wt, consts, k_align, n_align in (
                ("awq", awq._awq_gemv_kernel, "qw qz sc", "iih", dict(G=32), 32, 8),
                ("ct_int4", ct_int4._ct_gemv_kernel, "wp sc zp", "iwi", dict(G=32, HAS_ZP=True), 32, 1),
                ("nvfp4", nvfp4._nvfp4_gemv_kernel, "wt sc gs rows_per_shard", "bbfn", dict(INVERTED=False), 16, 1)):
            cfg = common.gemv_config(M, N, K, k_align, 132 if arch == 90 else 80, n_align, arch)
            names = GEMV_ARGS.format(w=w) + " " + " ".join(consts) + TAIL
            types = "a" + wt + "faannnnnn" + "c" * len(consts) + "c" * 6
            b[f"{fmt}_gemv_M{M}"] = (kernel, names, types,
                                     dict(consts, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                                          SPLIT_K=cfg["SPLIT_K"], USE_DOT=cfg["USE_DOT"], HAS_BIAS=False),
                                     cfg["num_warps"], cfg["num_stages"])
    b.update(_nibble_builds(arch))
    from revolta.kernels.quant import gemv_wordcol

    wc = gemv_wordcol.wordcol_config(N, K, 32, 132 if arch == 90 else 80)
    b["awq_wordcol_gemv_M1"] = (gemv_wordcol._awq_wordcol_kernel,
                                GEMV_ARGS.format(w="qw qz sc") + " G" + TAIL + " EVEN ROWS PREFETCH HALF2 ASM N_FIXED",
                                "aiihfaannnnnn" + "c" * 13,
                                dict(G=32, BLOCK_M=1, BLOCK_N=wc["BLOCK_N"], BLOCK_K=wc["BLOCK_K"],
                                     SPLIT_K=wc["SPLIT_K"], USE_DOT=False, HAS_BIAS=False, EVEN=True,
                                     ROWS=wc["BLOCK_K"], PREFETCH=wc["PREFETCH"], HALF2=False, ASM=True, N_FIXED=0),
                                wc["num_warps"], wc["num_stages"])
    # the fp16-pair walk in the config one fp16 row takes (HALF2 on every arch; its fma.rn.f16x2 as inline PTX)
    h2 = gemv_wordcol.default_wordcol_config(N, K, 32, 132 if arch == 90 else 80, torch.float16)
    assert h2["HALF2"] and h2["BLOCK_K"] == gemv_wordcol.HALF2_ROWS
    b["awq_wordcol_half2_gemv_M1"] = (gemv_wordcol._awq_wordcol_kernel,
                                      GEMV_ARGS.format(w="qw qz sc") + " G" + TAIL
                                      + " EVEN ROWS PREFETCH HALF2 ASM N_FIXED", "hiihfhhnnnnnn" + "c" * 13,
                                      dict(G=32, BLOCK_M=1, BLOCK_N=h2["BLOCK_N"], BLOCK_K=h2["BLOCK_K"],
                                           SPLIT_K=h2["SPLIT_K"], USE_DOT=False, HAS_BIAS=False, EVEN=True,
                                           ROWS=h2["BLOCK_K"], PREFETCH=False, HALF2=True, ASM=True, N_FIXED=N),
                                      h2["num_warps"], h2["num_stages"])
    # the split-K reduce inside the GEMV (FIXUP: each tile's last K slice adds the partials, counted in int32)
    b["awq_wordcol_half2_gemv_M1_fx"] = (gemv_wordcol._awq_wordcol_kernel,
                                         b["awq_wordcol_half2_gemv_M1"][1] + " counters FIXUP",
                                         b["awq_wordcol_half2_gemv_M1"][2] + "ic",
                                         b["awq_wordcol_half2_gemv_M1"][3] | dict(FIXUP=True), h2["num_warps"],
                                         h2["num_stages"])
    # bf16 rows on the fp16-pair walk (each step scaled into fp16; "a" is bf16 on sm_90)
    b["awq_wordcol_bf16_half2_gemv_M1"] = (gemv_wordcol._awq_wordcol_kernel, b["awq_wordcol_half2_gemv_M1"][1],
                                           "a" + b["awq_wordcol_half2_gemv_M1"][2][1:5] + "aa"
                                           + b["awq_wordcol_half2_gemv_M1"][2][7:],
                                           b["awq_wordcol_half2_gemv_M1"][3], h2["num_warps"], h2["num_stages"])
    b["awq_wordcol_gemv_M1_fx"] = (gemv_wordcol._awq_wordcol_kernel, b["awq_wordcol_gemv_M1"][1] + " counters FIXUP",
                                   b["awq_wordcol_gemv_M1"][2] + "ic", b["awq_wordcol_gemv_M1"][3] | dict(FIXUP=True),
                                   wc["num_warps"], wc["num_stages"])
    b["splitk_reduce"] = (common._splitk_reduce_kernel, "ws bias out M N stride_om SPLIT_K HAS_BIAS BLOCK", "faannnccc",
                          dict(SPLIT_K=16, HAS_BIAS=True, BLOCK=common.REDUCE_BLOCK), 2, 2)
    if h2.get("PDL") and arch >= 90:  # sm_90's default chain: the GEMV and its reduce by PDL (gdc_wait: sm_90 only)
        b["awq_wordcol_half2_gemv_M1_pdl"] = (gemv_wordcol._awq_wordcol_kernel,
                                              b["awq_wordcol_half2_gemv_M1"][1] + " counters FIXUP PDL",
                                              b["awq_wordcol_half2_gemv_M1"][2] + "icc",
                                              b["awq_wordcol_half2_gemv_M1"][3] | dict(FIXUP=False, PDL=True),
                                              h2["num_warps"], h2["num_stages"])
        b["splitk_reduce_pdl"] = (common._splitk_reduce_kernel, b["splitk_reduce"][1] + " PDL", "faannncccc",
                                  b["splitk_reduce"][3] | dict(PDL=True), 2, 2)
    b["awq_dequant"] = (awq._awq_dequant_kernel, "qw qz sc w N K n0 n_rows G BLOCK_K BLOCK_N", "iihannnnccc",
                        dict(G=32, BLOCK_K=32, BLOCK_N=64), 4, 2)
    b["ct_int4_dequant"] = (ct_int4._ct_dequant_kernel, "wp sc zp w N K n0 n_rows G HAS_ZP BLOCK_N BLOCK_K",
                            "iwiannnncccc", dict(G=32, HAS_ZP=True, BLOCK_N=32, BLOCK_K=32), 4, 2)
    b["nvfp4_dequant"] = (nvfp4._nvfp4_dequant_kernel, "wt sc gs w N K n0 n_rows rows_per_shard INVERTED BLOCK_N "
                          "BLOCK_K", "bbfannnnnccc", dict(INVERTED=True, BLOCK_N=32, BLOCK_K=64), 4, 2)
    return b


def _nibble_builds(arch):
    from revolta.kernels.quant import gemv_nibble

    N, K = SHAPE
    b = {}
    for fmt, M, wt, consts in (("awq", 1, "iih", dict(FMT=0, G=32, HAS_ZP=True)),
                               ("awq", 8, "iih", dict(FMT=0, G=32, HAS_ZP=True)),
                               ("awq", 40, "iih", dict(FMT=0, G=32, HAS_ZP=True)),
                               ("ct_int4", 1, "iwi", dict(FMT=1, G=32, HAS_ZP=True)),
                               ("nvfp4", 1, "bbf", dict(FMT=2, G=16, HAS_ZP=False))):
        cfg = gemv_nibble.nibble_gemv_config(M, N, K, consts["G"], fmt, 132 if arch == 90 else 80, arch)
        names = GEMV_ARGS.format(w="w0 w1 w2 rows_per_shard") + " FMT G HAS_ZP INVERTED" + TAIL + " SCALE_AHEAD"
        b[f"{fmt}_nibble_gemv_M{M}"] = (gemv_nibble._nibble_gemv_kernel, names, "a" + wt + "nfaannnnnn" + "c" * 11,
                                        dict(consts, INVERTED=False, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                                             BLOCK_K=cfg["BLOCK_K"], SPLIT_K=cfg["SPLIT_K"], USE_DOT=True,
                                             HAS_BIAS=False, SCALE_AHEAD=cfg["SCALE_AHEAD"]), cfg["num_warps"],
                                        cfg["num_stages"])
    return b


def build_all(arch):
    """{name: CompileReport as a dict + fp8 instructions found}; call with TRITON_INTERPRET unset or 0."""
    from test_moe_aot import _compile

    out = {}
    for name, (kernel, names, types, consts, warps, stages) in _builds(arch).items():
        out[name] = dataclasses.asdict(_compile(kernel, _sig(names, types, ACT[arch]), consts, arch, warps, stages,
                                                _aligned(names, types)))
    return out


@pytest.fixture(scope="module")
def reports():
    sys.path.insert(0, os.path.dirname(__file__))
    from test_moe_aot import build_in_spawned_children

    return build_in_spawned_children("test_quant_aot")


@pytest.mark.parametrize("arch", [70, 90])
def test_aot_real_shapes(arch, reports):
    from test_moe_aot import check_reports

    check_reports(reports[arch], arch)
    assert sum("nibble" in n for n in reports[arch]) == 5
    spills = {n: r["spill_store_bytes"] for n, r in reports[arch].items()
              if ("nibble" in n or "wordcol" in n) and r["spill_store_bytes"]}
    assert not spills, f"sm_{arch} nibble / word-column GEMV builds spill (budget 0 on every arch): {spills}"
    assert "awq_wordcol_gemv_M1" in reports[arch] and "awq_wordcol_half2_gemv_M1" in reports[arch]
    assert ("awq_wordcol_half2_gemv_M1_pdl" in reports[arch]) == (arch >= 90)  # the sm_90 default chain is built


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"
    sys.path.insert(0, os.path.dirname(__file__))
    for arch in (70, 90):
        for name, r in build_all(arch).items():
            print(f"sm_{arch} {name:18s} shared {r['shared_bytes']:6d} B  regs {r['registers']:3d}  "
                  f"spill st/ld {r['spill_store_bytes']}/{r['spill_load_bytes']} B  forbidden {r['forbidden']}")

"""Ahead-of-time builds (no GPU) of the MoE, norm, HyperConnection, RoPE, GDN gate, PLE row-id and sampling kernels for sm_70
(V100, fp16 activations) and sm_90 (H200, bf16) at the real model's shapes, in the launch
configurations the wrappers pick.

Real shapes: hidden 2560, ffn 640, 512 routed experts + the shared one as expert 512, top-10 (+1),
HC d = 2560, h = 4, r = 320, QSA head dim 256 / indexer 128 with R = 64, vocab 248320.

Spill budget on sm_70: 0 bytes for every build listed here (SM70_SPILL_BUDGET).

The builds run in a child process with TRITON_INTERPRET=0: under the interpreter (which conftest
turns on without a GPU) triton.language's own @jit helpers (tl.sum, tl.max, tl.sigmoid, ...) are
interpreter objects and cannot be compiled. For sm_90 under Triton >= 3.9 the resource read-out
uses the Hopper ptxas that Triton itself uses (`ptxas-blackwell`, target sm_90a): aot.py's
`ptxas -v --gpu-name=sm_90` rejects Triton 3.9's PTX 9.4 (the default ptxas is CUDA 12.9).
Print the table: `python tests/kernels/test_moe_aot.py`.
"""

import dataclasses
import json
import os
import subprocess
import sys
from unittest import mock

import pytest

SM70_SPILL_BUDGET = 0
GEMM_BUILDS = ("moe_grouped_", "moe_gate_up_", "moe_down_", "hc_down_dot", "hc_up_dot")  # built with the run-time
# alignment specialisation
ACT = {70: "*fp16", 90: "*bf16"}


def _sig(names, types, act):
    """One letter per arg: a = activation pointer, f = fp32 ptr, i = int32 ptr, l = int64 ptr, b = bool ptr,
    n = int32 scalar, s = fp32 scalar, c = constexpr."""
    table = {"a": act, "f": "*fp32", "i": "*i32", "l": "*i64", "b": "*i1", "n": "i32", "s": "fp32", "c": "constexpr"}
    names = names.split()
    assert len(names) == len(types), (names, types)
    return {n: table[t] for n, t in zip(names, types)}



def _hc_dot_builds(hc, cfg, d, r, h, arch):
    """The tl.dot down and up passes (kernels/hc_dot.py) in the config `cfg` picks for them."""
    from revolta.kernels import hc_dot

    pdl, ksplit = arch >= 90, d // cfg["SPLITS_PER_BRANCH"]
    k1, k2 = hc_dot.dot_k_pieces(r, cfg["UP_BLOCK_K"])
    down_sig = ("x norm_w w_down w_inject partial sumsq M R RH stride_x stride_wd stride_wi stride_p comb_inj comb_u "
                "comb_y D stride_ci stride_cu stride_cy KSPLIT BLOCK_M BLOCK_R BLOCK_K DOT_F32 PDL COMBINE",
                "aaaaffnnnnnnnaaannnnccccccc")
    down = dict(KSPLIT=ksplit, BLOCK_M=hc_dot.DOT_M, BLOCK_R=cfg["BLOCK_R"], BLOCK_K=hc_dot.down_dot_block_k(cfg, ksplit),
                DOT_F32=False, PDL=pdl)
    return {
        "hc_down_dot": (hc_dot._hc_down_dot_kernel, *down_sig, dict(down, COMBINE=False), cfg["WARPS_DOWN"], 2),
        # the previous block's write inside the down pass (hc_combine_read at 4-16 rows on sm90)
        "hc_combine_down_dot": (hc_dot._hc_down_dot_kernel, *down_sig, dict(down, COMBINE=True), cfg["WARPS_DOWN"], 2),
        "hc_up_dot": (hc_dot._hc_up_dot_kernel, "x norm_w w_up mix rstd out M R D stride_x stride_wu stride_o NH "
                      "BLOCK_M BLOCK_C BLOCK_K1 BLOCK_K2 BLOCK_KC DOT_F32 PDL", "aaaafannnnnncccccccc",
                      dict(NH=h, BLOCK_M=hc_dot.DOT_M, BLOCK_C=cfg["BLOCK_C"], BLOCK_K1=k1, BLOCK_K2=k2,
                           BLOCK_KC=cfg["UP_BLOCK_K"], DOT_F32=False, PDL=pdl), cfg["WARPS_UP"], 2)}


def _hc_builds(hc, M, cfg, d, r, h, arch):
    """The HyperConnection read's launches for M rows: the rows kernels (with programmatic dependent launch
    on sm_90; their DOWN / UP "dot" passes from kernels/hc_dot.py) or the tiled down / up kernels."""
    if cfg["KIND"] == "rows":
        pdl = arch >= 90
        S = h * cfg["SPLITS_PER_BRANCH"]
        ksplit, bs = d // cfg["SPLITS_PER_BRANCH"], 1 << (S - 1).bit_length()
        k1, k2 = hc.up_k_pieces(r)
        dots = _hc_dot_builds(hc, cfg, d, r, h, arch)
        down = dict(KSPLIT=ksplit, BLOCK_M=cfg["BLOCK_M"], BLOCK_R=cfg["BLOCK_R"],
                    BLOCK_K=min(cfg["BLOCK_K"], 1 << (ksplit - 1).bit_length()), PDL=pdl)
        down_sig = ("x norm_w w_down w_inject partial sumsq M R RH stride_x stride_wd stride_wi stride_p comb_inj comb_u "
                    "comb_y D stride_ci stride_cu stride_cy KSPLIT BLOCK_M BLOCK_R BLOCK_K PDL COMBINE",
                    "aaaaffnnnnnnnaaannnncccccc")
        b = {
            f"hc_down_rows_M{M}": (hc._hc_down_rows_kernel, *down_sig, dict(down, COMBINE=False), cfg["WARPS_DOWN"], 2),
            # the previous block's write inside the down pass (hc_combine_read: decode, 16-bit)
            f"hc_combine_down_rows_M{M}": (hc._hc_down_rows_kernel, *down_sig, dict(down, COMBINE=True),
                                           cfg["WARPS_DOWN"], 2),
            f"hc_up_rows_M{M}": (
                hc._hc_up_rows_kernel, "x norm_w w_up partial sumsq mix rstd out inject M R RH D eps stride_x "
                "stride_wu stride_p stride_o NH S BLOCK_M BLOCK_C BLOCK_K1 BLOCK_K2 BLOCK_S FUSED_MIX HAS_INJECT PDL",
                "aaaffafaannnnsnnnncccccccccc",
                dict(NH=h, S=S, BLOCK_M=cfg["BLOCK_M"], BLOCK_C=cfg["BLOCK_C"], BLOCK_K1=k1, BLOCK_K2=k2, BLOCK_S=bs,
                     FUSED_MIX=cfg["FUSED_MIX"], HAS_INJECT=True, PDL=pdl), cfg["WARPS_UP"], 2)}
        if not cfg["FUSED_MIX"]:
            b["hc_mix_rows"] = (hc._hc_mix_rows_kernel, "partial sumsq mix rstd inject M R RH D eps stride_p NH S "
                                "BLOCK_K BLOCK_S HAS_INJECT PDL", "ffafannnnsncccccc",
                                dict(NH=h, S=S, BLOCK_K=128, BLOCK_S=bs, HAS_INJECT=True, PDL=pdl), 4, 2)
        for what in ("down", "up"):
            if cfg[what.upper()] == "dot":
                del b[f"hc_{what}_rows_M{M}"]
                b[f"hc_{what}_dot"] = dots[f"hc_{what}_dot"]
        if cfg["DOWN"] == "dot":
            del b[f"hc_combine_down_rows_M{M}"]
            b["hc_combine_down_dot"] = dots["hc_combine_down_dot"]
        return b
    w = cfg["num_warps"]
    return {
        f"hc_down_M{M}": (hc._hc_down_kernel, "x norm_w w_down w_inject partial sumsq M R RH WIDE KSPLIT stride_x "
                          "stride_wd stride_wi BLOCK_M BLOCK_R BLOCK_K HAS_INJECT USE_DOT", "aaaaffnnnnnnnnccccc",
                          dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_R=cfg["BLOCK_R"], BLOCK_K=cfg["BLOCK_K"], HAS_INJECT=True,
                               USE_DOT=cfg["USE_DOT"]), w, 2),
        f"hc_up_M{M}": (hc._hc_up_kernel, "x norm_w mix w_up rstd out M R D stride_x stride_wu stride_o NH BLOCK_M "
                        "BLOCK_C BLOCK_K USE_DOT", "aaaafannnnnnccccc",
                        dict(NH=h, BLOCK_M=cfg["BLOCK_M"], BLOCK_C=cfg["BLOCK_C"], BLOCK_K=cfg["BLOCK_K_UP"],
                             USE_DOT=cfg["USE_DOT"]), w, 2)}

def _builds(arch):
    """name -> (kernel, arg names, arg types, constexprs, num_warps, num_stages)."""
    from revolta.kernels import hc, moe, moe_grouped, norm, norm_rope, ple_rows, rope, sample
    from revolta.kernels.gdn import gates

    b = {}
    b["moe_route"] = (moe._moe_route_kernel, "logits shared ids_out w_out E stride_l stride_s stride_o TOP_K NUM_OUT "
                      "BLOCK_E BLOCK_K RENORM HAS_SHARED", "aaifnnnncccccc",
                      dict(TOP_K=10, NUM_OUT=11, BLOCK_E=512, BLOCK_K=16, RENORM=True, HAS_SHARED=True), 4, 2)
    b["moe_count"] = (moe._moe_count_kernel, "topk_ids counts ranks T BLOCK", "iiinc", dict(BLOCK=1024), 4, 2)
    b["moe_prefix"] = (moe._moe_prefix_kernel, "counts starts sorted_ids expert_ids num_post_pad T E num_blocks "
                       "BLOCK_E BLOCK_M BLOCK_B BLOCK_P", "iiiiinnncccc",
                       dict(BLOCK_E=1024, BLOCK_M=64, BLOCK_B=16, BLOCK_P=1024), 4, 2)
    b["moe_scatter"] = (moe._moe_scatter_kernel, "topk_ids ranks starts sorted_ids T BLOCK", "iiiinc", dict(BLOCK=1024), 4, 2)
    b["moe_sum"] = (moe._moe_sum_kernel, "y out H stride_ym stride_om TOP_K BLOCK_N", "fannncc",
                    dict(TOP_K=11, BLOCK_N=moe.SUM_BLOCK), 2, 2)
    seen = set()
    # real shapes (512 experts + shared = 513, k = 10 + 1) and the 64-expert stand-in at decode / verify sizes
    for M, E in ((1, 513), (5, 513), (8, 513), (40, 513), (64, 513), (8192, 513), (8, 65), (40, 65)):
        cfg = moe.moe_config(M, 11, E, arch)
        sort = M > 1
        if cfg["GROUPED"] and sort:  # the one-program sort of all pairs, at every register-tile size used
            block_t, gw = moe_grouped.group_launch(M * 11)
            b[f"moe_group_T{block_t}"] = (moe_grouped._moe_group_kernel, "topk_ids order slot_expert slot_start "
                                          "slot_end sorted_expert T S BLOCK_T", "iiiiiinnc", dict(BLOCK_T=block_t), gw, 2)
        key = tuple(sorted(cfg.items())) + (sort,)
        if key in seen:
            continue
        seen.add(key)
        w, s = cfg["num_warps"], cfg["num_stages"]
        flags = dict(BLOCK_M=cfg["BLOCK_M"], USE_DOT=cfg["USE_DOT"], HAS_SHARED=True)
        up = dict(BLOCK_N=cfg["BLOCK_N_UP"], BLOCK_K=cfg["BLOCK_K_UP"], **flags)
        down = dict(BLOCK_N=cfg["BLOCK_N_DOWN"], BLOCK_K=cfg["BLOCK_K_DOWN"], **flags)
        if cfg["GROUPED"]:
            b[f"moe_grouped_gate_up_M{M}_E{E}"] = (
                moe_grouped._grouped_gate_up_kernel, "x w shared_gate shared_up act topk_ids order slot_expert "
                "slot_start slot_end num_routed H I stride_xm stride_we stride_wn stride_am TOP_K BLOCK_M BLOCK_N "
                "BLOCK_K USE_DOT HAS_SHARED SORTED", "aaaaaiiiiinnnnnnnccccccc", dict(TOP_K=11, SORTED=sort, **up), w, s)
            b[f"moe_grouped_down_M{M}_E{E}"] = (
                moe_grouped._grouped_down_kernel, "act w shared_down topk_weights y topk_ids order slot_expert "
                "slot_start slot_end num_routed H I stride_am stride_we stride_wn stride_ym BLOCK_M BLOCK_N BLOCK_K "
                "USE_DOT HAS_SHARED SORTED", "aaaffiiiiinnnnnnncccccc", dict(SORTED=sort, **down), w, s)
        else:
            b[f"moe_gate_up_M{M}_E{E}"] = (
                moe._moe_gate_up_kernel, "x w shared_gate shared_up act sorted_ids expert_ids T num_routed H I "
                "stride_xm stride_we stride_wn stride_am TOP_K BLOCK_M BLOCK_N BLOCK_K USE_DOT HAS_SHARED",
                "aaaaaiinnnnnnnncccccc", dict(TOP_K=11, **up), w, s)
            b[f"moe_down_M{M}_E{E}"] = (
                moe._moe_down_kernel, "act w shared_down topk_weights y sorted_ids expert_ids T num_routed H I "
                "stride_am stride_we stride_wn stride_ym BLOCK_M BLOCK_N BLOCK_K USE_DOT HAS_SHARED",
                "aaaffiinnnnnnnnccccc", down, w, s)
    for G, warps in ((2560, 16), (256, 1), (10240, 16)):
        b[f"zc_rms_norm_G{G}"] = (norm._zc_rms_norm_kernel, "x w y N G stride_x stride_y eps BLOCK", "aaannnnsc",
                                  dict(BLOCK=1 << (G - 1).bit_length()), warps, 2)
    rows = norm.gated_norm_rows(128)
    b["gated_rms_norm"] = (norm._gated_rms_norm_kernel, "o w z y M D HZ stride_o stride_zt stride_zh stride_y eps ROWS "
                           "BLOCK SILU", "aaaannnnnnnsccc", dict(ROWS=rows, BLOCK=128, SILU=False), min(8, max(1, rows * 128 // 256)), 2)
    d, r, h = 2560, 320, 4
    seen = set()
    # the dot passes at M = 5 (on by default on sm90 only: `hc_dot_default()["ENABLED"]`, built either way)
    for M, cfg in [(M, hc.hc_config(M, d, r, h, arch)) for M in (1, 5, 8, 16, 64, 8192)] + [
            (5, hc.hc_config(5, d, r, h, arch, dot=True))]:
        key = tuple(sorted(cfg.items()))
        if key in seen:
            continue
        seen.add(key)
        b.update(_hc_builds(hc, M, cfg, d, r, h, arch))
    b["hc_mix"] = (hc._hc_mix_kernel, "partial sumsq mix rstd inject M R RH D S eps NH BLOCK_R BLOCK_S HAS_INJECT",
                   "ffafannnnnscccc", dict(NH=h, BLOCK_R=512, BLOCK_S=64, HAS_INJECT=True), 4, 2)
    b["hc_combine"] = (hc._hc_combine_kernel, "x inject u y D stride_x stride_i stride_u stride_y NH BLOCK",
                       "aaaannnnncc", dict(NH=h, BLOCK=1024), 4, 2)
    for D, bh in ((256, 16), (128, 4)):
        b[f"rope_D{D}"] = (rope._rope_kernel, "x cos sin y H D R2 stride_xt stride_xh stride_yt stride_yh stride_c "
                           "BLOCK_H BLOCK_R2 BLOCK_REST COPY_REST", "affannnnnnnncccc",
                           dict(BLOCK_H=bh, BLOCK_R2=32, BLOCK_REST=1 << (D - 65).bit_length(), COPY_REST=True), 4, 2)
    b["rope_inplace"] = (rope._rope_kernel, "x cos sin y H D R2 stride_xt stride_xh stride_yt stride_yh stride_c "
                         "BLOCK_H BLOCK_R2 BLOCK_REST COPY_REST", "affannnnnnnncccc",
                         dict(BLOCK_H=16, BLOCK_R2=32, BLOCK_REST=1, COPY_REST=False), 4, 2)
    # QSA's norm + RoPE (q: 24 heads at TP1, k: 2 KV heads, the 4 index heads of 128) and the GDN gates (48 heads)
    for label, H, D in (("q", 24, 256), ("k", 2, 256), ("index_q", 4, 128)):
        bh, bd = norm_rope.norm_rope_block_h(H, D), 1 << (D - 1).bit_length()
        b[f"zc_norm_rope_{label}"] = (
            norm_rope._zc_norm_rope_kernel, "x w cos sin y H D R2 stride_xt stride_xh stride_yt stride_yh stride_c eps "
            "BLOCK_H BLOCK_D BLOCK_R2", "aaffannnnnnnnsccc", dict(BLOCK_H=bh, BLOCK_D=bd, BLOCK_R2=32),
            4 if bh * bd >= 2048 else 1, 2)
    b["gdn_gates"] = (gates._gdn_gates_kernel, "a b A_log dt_bias g beta HV stride_a stride_b BLOCK", "aaffffnnnc",
                      dict(BLOCK=64), 1, 2)
    # the PLE row ids (n-gram order 3, 8 heads per n-gram): decode, an MTP4 verify (5 rows, stores nothing), the widest
    for label, block_t, store in (("decode", 1, True), ("verify5", 8, False), ("T16", 16, True)):
        b[f"ple_rows_{label}"] = (
            ple_rows._ple_rows_kernel, "ids cu_seqlens context_ids slots has_initial_state multipliers sizes offsets rows "
            "history stride_ctx eos ORDER HEADS_PER_NGRAM BLOCK_T BLOCK_K STORE", "liliblllllnnccccc",
            dict(ORDER=3, HEADS_PER_NGRAM=8, BLOCK_T=block_t, BLOCK_K=2, STORE=store), 1, 2)
    b["mrope_cos_sin"] = (rope._mrope_kernel, "positions inv_freq rows cos sin T F stride_p scale BLOCK_T BLOCK_F",
                          "lflffnnnscc", dict(BLOCK_T=16, BLOCK_F=32), 4, 2)
    b["sample"] = (sample._sample_kernel, "logits temperature top_k top_p min_p seeds offsets out V stride_l BLOCK_V",
                   "ffifflllnnc", dict(BLOCK_V=4096), 8, 2)
    return b


def aligned_args(names, types, pointers, sizes, skip=()):
    """The arguments a build marks as the launcher specialises them at run time when they are multiples of 16:
    pointers (`types` codes in `pointers`), the `sizes` and the strides, less `skip`. The quant AOT tests use it too."""
    return tuple(n for n, t in zip(names.split(), types)
                 if (t in pointers or n in sizes or n.startswith("stride_")) and n not in skip)


def _aligned(names, types):
    """The MoE GEMMs' arguments that the launcher specialises as multiples of 16 at the real shapes: every
    pointer, the sizes H / I, the routed-expert count and the strides (T and S, the pair and slot counts, vary)."""
    return aligned_args(names, types, "afil", ("H", "I", "num_routed"))


def _compile(kernel, signature, constexprs, arch, num_warps, num_stages, aligned=()):
    from revolta.kernels import aot

    if arch < 90:
        return aot.compile_report(kernel, signature, constexprs, arch=arch, num_warps=num_warps, num_stages=num_stages,
                                  aligned=aligned)
    real_run = subprocess.run

    def run(cmd, *a, **k):
        hopper = cmd[0] + "-blackwell"
        if "--gpu-name=sm_90" in cmd and os.path.exists(hopper):
            cmd = [hopper] + ["--gpu-name=sm_90a" if c == "--gpu-name=sm_90" else c for c in cmd[1:]]
        return real_run(cmd, *a, **k)

    with mock.patch.object(aot.subprocess, "run", run):
        return aot.compile_report(kernel, signature, constexprs, arch=arch, num_warps=num_warps, num_stages=num_stages,
                                  aligned=aligned)


def build_all(arch):
    """{name: CompileReport as a dict}; call with TRITON_INTERPRET unset or 0."""
    out = {}
    for name, (kernel, names, types, consts, warps, stages) in _builds(arch).items():
        aligned = _aligned(names, types) if name.startswith(GEMM_BUILDS) else ()
        out[name] = dataclasses.asdict(_compile(kernel, _sig(names, types, ACT[arch]), consts, arch, warps, stages,
                                                aligned))
    return out


_CHILDREN = {}


def _build_in_child(arch):
    """Both architectures build in parallel child processes (started on first use)."""
    if not _CHILDREN:
        env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
        for a in (70, 90):
            code = (f"import sys, json; sys.path.insert(0, {os.path.dirname(__file__)!r}); import test_moe_aot as t; "
                    f"print('@@' + json.dumps(t.build_all({a})))")
            _CHILDREN[a] = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, text=True)
    out, err = _CHILDREN[arch].communicate(timeout=600)
    assert _CHILDREN[arch].returncode == 0, err[-4000:]
    line = [ln for ln in out.splitlines() if ln.startswith("@@")][-1]
    return json.loads(line[2:])


def build_in_spawned_children(module_name: str) -> dict:
    """{arch: module.build_all(arch)} for sm_70 and sm_90, built in parallel in fresh (spawned) processes that import
    Triton uninterpreted (the AOT tests of the quantized kernels)."""
    import importlib
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from unittest import mock

    sys.path.insert(0, os.path.dirname(__file__))  # the children import the module and this one by name
    with mock.patch.dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1"), \
            ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        module = importlib.import_module(module_name)
        return dict(zip((70, 90), pool.map(module.build_all, (70, 90))))


def check_reports(reports: dict, arch: int) -> None:
    """No spills on sm_70; on sm_90 at most 1 MiB of spills and the shared memory an SM has."""
    from revolta.kernels.aot import CompileReport

    problems = []
    for name, fields in reports.items():
        report = CompileReport(**{**fields, "forbidden": tuple(fields["forbidden"])})
        limits = dict(max_spill_bytes=0) if arch == 70 else dict(max_spill_bytes=1 << 20, shared_limit=227 * 1024)
        try:
            report.check(**limits)
        except AssertionError as e:
            problems.append(f"{name}: {e}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("arch", [70, 90])
def test_aot_real_shapes(arch):
    from revolta.kernels.aot import CompileReport

    problems = []
    for name, fields in _build_in_child(arch).items():
        fields["forbidden"] = tuple(fields["forbidden"])
        report = CompileReport(**fields)
        print(f"sm_{arch} {name}: regs {report.registers} spill {report.spill_store_bytes} B smem {report.shared_bytes} B")
        try:
            if arch == 70:
                report.check(max_spill_bytes=SM70_SPILL_BUDGET)
            else:
                report.check(max_spill_bytes=1 << 20, shared_limit=227 * 1024)
        except AssertionError as e:
            problems.append(f"{name}: {e}")
    assert not problems, "\n".join(problems)


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"
    for arch in (70, 90):
        for name, r in build_all(arch).items():
            print(f"sm_{arch} {name:22s} shared {r['shared_bytes']:6d} B  regs {r['registers']:3d}  "
                  f"spill st/ld {r['spill_store_bytes']}/{r['spill_load_bytes']} B  warps {r['num_warps']}  "
                  f"forbidden {r['forbidden']}")

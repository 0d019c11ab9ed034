"""Every QSA kernel compiles for sm_70 and sm_90 at the real shapes (no GPU needed).

Real shapes: D = 256, Di = 128, R = 64, Hq = 24 (TP1) / 6 (TP4), KVH = 2 / 1, 4 index heads, c = 4,
budget 512 groups, page 64 tokens; the DCP2 partial-attention variants (dcp.py) at TP4. sm_70 budgets: <= 96 KiB shared memory, no Ampere/Hopper
instructions, no fp8 conversions (E4M3 is decoded with integer ops), register spills <= SPILL_BUDGET.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from revolta.kernels.aot import CompileReport, compile_report
from revolta.kernels.qsa.index_compress import _index_compress_kernel
from revolta.kernels.qsa.select import _index_score_kernel, _topk_kernel
from revolta.kernels.qsa.sparse_attn import _combine_kernel, _qsa_attn_kernel
from revolta.kernels.qsa.store_kv import _store_kv_kernel

SPILL_BUDGET = {"store_kv": 0, "index_compress": 0, "index_score": 0, "topk": 0, "combine": 0, "attn": 256}
FP8_PTX = ("cvt.rn.satfinite.e4m3", "e4m3x2", "e5m2x2", ".f8")


def _sig(names, types, consts):
    sig = {}
    for n in names:
        sig[n] = "constexpr" if n in consts else types.get(n, "i32")
    return sig


def _cases():
    cases = []
    for fmt, kv_t in ((0, "*fp16"), (1, "*u8"), (2, "*i8")):
        names = ["k_ptr", "v_ptr", "kc_ptr", "vc_ptr", "slot_ptr", "ks_ptr", "vs_ptr", "stride_kt", "stride_kh",
                 "stride_vt", "stride_vh", "stride_kcb", "stride_kco", "stride_kch", "stride_vcb", "stride_vco",
                 "stride_vch", "BLOCK_SIZE", "KVH", "BH", "D", "FMT"]
        consts = dict(BLOCK_SIZE=64, KVH=2, BH=2, D=256, FMT=fmt)
        types = dict(k_ptr="*fp16", v_ptr="*fp16", kc_ptr=kv_t, vc_ptr=kv_t, slot_ptr="*i64", ks_ptr="*fp32",
                     vs_ptr="*fp32")
        cases.append((f"store_kv-fmt{fmt}", "store_kv", _store_kv_kernel, _sig(names, types, consts), consts, 4))
    names = ["raw_ptr", "cos_ptr", "sin_ptr", "ring_ptr", "pcos_ptr", "psin_ptr", "w_ptr", "out_ptr", "bt_ptr", "cu_ptr",
             "seq_lens_ptr", "slots_ptr", "eps", "stride_rt", "stride_ct", "stride_st", "stride_gs", "stride_gp",
             "stride_pc", "stride_ps", "stride_ob", "stride_og", "stride_btb", "MAX_BLOCKS", "C", "P", "DI", "R",
             "BLOCK_SIZE", "HAS_SLOTS"]
    consts = dict(C=4, P=8, DI=128, R=64, BLOCK_SIZE=64, HAS_SLOTS=True)
    types = dict(raw_ptr="*fp16", cos_ptr="*fp32", sin_ptr="*fp32", ring_ptr="*fp16", pcos_ptr="*fp32",
                 psin_ptr="*fp32", w_ptr="*fp32", out_ptr="*fp16", bt_ptr="*i32", cu_ptr="*i32", seq_lens_ptr="*i32",
                 slots_ptr="*i32", eps="fp32")
    cases.append(("index_compress", "index_compress", _index_compress_kernel, _sig(names, types, consts), consts, 4))
    names = ["iq_ptr", "icache_ptr", "bt_ptr", "seq_lens_ptr", "row_req_ptr", "row_pos_ptr", "score_ptr", "stride_qr",
             "stride_qh", "stride_cb", "stride_cg", "stride_btb", "stride_sr", "sqrt_di", "budget", "Q", "EXPLICIT",
             "HI", "DI", "C", "BLOCK_SIZE", "BN", "QG"]
    types = dict(iq_ptr="*fp16", icache_ptr="*fp16", bt_ptr="*i32", seq_lens_ptr="*i32", row_req_ptr="*i32",
                 row_pos_ptr="*i32", score_ptr="*fp32", sqrt_di="fp32")
    for label, q in (("", 1), ("-verify5", 5)):  # decode, and MTP4 verify rows sharing one key read
        consts = dict(Q=q, EXPLICIT=False, HI=4, DI=128, C=4, BLOCK_SIZE=64, BN=32, QG=q)
        cases.append((f"index_score{label}", "index_score", _index_score_kernel, _sig(names, types, consts), consts,
                      4))
    names = ["score_ptr", "out_ptr", "seq_lens_ptr", "row_req_ptr", "row_pos_ptr", "stride_sr", "stride_or", "budget",
             "Q", "EXPLICIT", "C", "KPAD", "CHUNK"]
    consts = dict(Q=1, EXPLICIT=False, C=4, KPAD=512, CHUNK=2048)
    types = dict(score_ptr="*fp32", out_ptr="*i32", seq_lens_ptr="*i32", row_req_ptr="*i32", row_pos_ptr="*i32")
    cases.append(("topk", "topk", _topk_kernel, _sig(names, types, consts), consts, 8))
    attn_names = ["q_ptr", "gate_ptr", "out_ptr", "k_ptr", "v_ptr", "ks_ptr", "vs_ptr", "bt_ptr", "seq_lens_ptr",
                  "sel_ptr", "row_req_ptr", "row_pos_ptr", "m_ws", "l_ws", "acc_ws", "lse_ptr", "qk_scale", "budget",
                  "num_splits", "stride_qr", "stride_qh", "stride_gr", "stride_gh", "stride_or", "stride_oh",
                  "stride_kb", "stride_ko", "stride_kh", "stride_vb", "stride_vo", "stride_vh", "stride_btb",
                  "stride_selr", "KVH", "Q", "EXPLICIT", "FMT", "C", "BLOCK_SIZE", "G", "BG", "D", "BN", "SPLIT",
                  "PARTIAL", "DCP", "RANK"]
    # single process (G 12: TP1's 24 heads / 2 KV heads; 6: TP4), and DCP2 partials at TP4 (the group's 2 x 6 heads
    # on one KV head, explicit rows, a 64-token block as 32-token pages; rank 1, the one with a non-zero offset)
    for fmt, kv_t in ((0, "*fp16"), (1, "*u8"), (2, "*i8")):
        for G, split, dcp in ((12, True, 1), (6, False, 1), (12, fmt != 1, 2)):  # DCP: both output paths covered
            consts = dict(Q=1, EXPLICIT=dcp > 1, FMT=fmt, C=4, BLOCK_SIZE=64, G=G, BG=16, D=256, BN=32, SPLIT=split,
                          PARTIAL=dcp > 1, DCP=dcp, RANK=dcp - 1)
            out_t = "*fp32" if dcp > 1 else "*fp16"
            types = dict(q_ptr="*fp16", gate_ptr="*fp16", out_ptr=out_t, k_ptr=kv_t, v_ptr=kv_t, ks_ptr="*fp32",
                         vs_ptr="*fp32", bt_ptr="*i32", seq_lens_ptr="*i32", sel_ptr="*i32", row_req_ptr="*i32",
                         row_pos_ptr="*i32", m_ws="*fp32", l_ws="*fp32", acc_ws="*fp32", lse_ptr="*fp32",
                         qk_scale="fp32")
            label = f"attn-fmt{fmt}-G{G}" + (f"-dcp{dcp}{'-split' if split else ''}" if dcp > 1 else "")
            cases.append((label, "attn", _qsa_attn_kernel, _sig(attn_names, types, consts), consts, 8))
    names = ["gate_ptr", "out_ptr", "m_ws", "l_ws", "acc_ws", "lse_ptr", "num_splits", "stride_gr", "stride_gh",
             "stride_or", "stride_oh", "H", "D", "SP", "PARTIAL"]
    for partial in (False, True):
        consts = dict(D=256, SP=64, PARTIAL=partial)
        types = dict(gate_ptr="*fp16", out_ptr="*fp32" if partial else "*fp16", m_ws="*fp32", l_ws="*fp32",
                     acc_ws="*fp32", lse_ptr="*fp32")
        cases.append(("combine-partial" if partial else "combine", "combine", _combine_kernel,
                      _sig(names, types, consts), consts, 4))
    return cases


def _build(kernel, sig, consts, arch, warps) -> dict:
    """revolta.kernels.aot.compile_report, plus (sm_70) a scan of the PTX for fp8 conversions."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rep = dataclasses.asdict(compile_report(kernel, sig, consts, arch=arch, num_warps=warps))
    rep["ptx_fp8"] = []
    if arch == 70:
        k = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts), target=GPUTarget("cuda", arch, 32),
                           options={"num_warps": warps})
        rep["ptx_fp8"] = [op for op in FP8_PTX if op in k.asm["ptx"]]
    return rep


def _main() -> None:
    """Compile every case for sm_70 and sm_90 and print the reports as JSON (run without TRITON_INTERPRET:
    the interpreter replaces @triton.jit helpers, which then cannot be compiled)."""
    out = {}
    for name, _, kernel, sig, consts, warps in _cases():
        for arch in (70, 90):
            try:
                out[f"{name}@{arch}"] = _build(kernel, sig, consts, arch, warps)
            except Exception as e:  # reported per case by the test
                out[f"{name}@{arch}"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    print("QSA_AOT_JSON " + json.dumps(out))


@pytest.fixture(scope="module")
def reports():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import sys; sys.path.insert(0, %r); import test_qsa_aot; test_qsa_aot._main()" % os.path.dirname(__file__)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    line = [x for x in proc.stdout.splitlines() if x.startswith("QSA_AOT_JSON ")]
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line[0][len("QSA_AOT_JSON "):])


@pytest.mark.parametrize("arch", [70, 90])
@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_qsa_kernels_compile(case, arch, reports):
    name, budget_key = case[0], case[1]
    r = reports[f"{name}@{arch}"]
    assert "error" not in r, r.get("error")
    report = CompileReport(**{k: tuple(v) if k == "forbidden" else v for k, v in r.items() if k != "ptx_fp8"})
    print(f"sm_{arch} {name}: regs {report.registers} spill {report.spill_store_bytes}/{report.spill_load_bytes} B "
          f"shared {report.shared_bytes} B")
    if arch == 70:
        report.check(max_spill_bytes=SPILL_BUDGET[budget_key])
        assert not r["ptx_fp8"], f"fp8 instructions in the sm_70 build: {r['ptx_fp8']}"

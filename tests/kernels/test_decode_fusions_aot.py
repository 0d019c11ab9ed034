"""The decode-path fusion kernels (kernels/norm_rope.py, kernels/gdn/gates.py) compile for sm_70 and sm_90 at
the real shapes without register spills (no GPU needed).

Real shapes: QSA heads of 256 with a 64-wide rotary part, 24 query heads (TP1: 8 heads per program) / 6 (TP4),
2 KV heads, 4 index heads of 128; GDN with 48 value heads. Launch configs as the wrappers choose them.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from revolta.kernels.aot import CompileReport, compile_report


def _cases():
    import triton

    from revolta.kernels.gdn.gates import _gdn_gates_kernel
    from revolta.kernels.norm_rope import _zc_norm_rope_kernel, norm_rope_block_h

    cases = []
    names = ["x", "w", "cos", "sin", "y", "H", "D", "R2", "stride_xt", "stride_xh", "stride_yt", "stride_yh",
             "stride_c", "eps", "BLOCK_H", "BLOCK_D", "BLOCK_R2"]
    for dt in ("fp16", "bf16"):
        for label, H, D in (("q", 24, 256), ("q-tp4", 6, 256), ("k", 2, 256), ("index-q", 4, 128)):
            bh, bd = norm_rope_block_h(H, D), triton.next_power_of_2(D)
            consts = dict(BLOCK_H=bh, BLOCK_D=bd, BLOCK_R2=32)
            types = dict(x=f"*{dt}", w=f"*{dt}", cos="*fp32", sin="*fp32", y=f"*{dt}", eps="fp32")
            sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
            cases.append((f"norm_rope-{label}-{dt}", _zc_norm_rope_kernel, sig, consts, 4 if bh * bd >= 2048 else 1))
        names_g = ["a", "b", "A_log", "dt_bias", "g", "beta", "HV", "stride_a", "stride_b", "BLOCK"]
        types = dict(a=f"*{dt}", b=f"*{dt}", A_log="*fp32", dt_bias="*fp32", g="*fp32", beta="*fp32")
        consts = dict(BLOCK=64)
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names_g}
        cases.append((f"gdn_gates-{dt}", _gdn_gates_kernel, sig, consts, 1))
    return cases


def _main() -> None:
    """Compile every case for sm_70 and sm_90 and print the reports as JSON (without TRITON_INTERPRET: the
    interpreter replaces @triton.jit helpers, which then cannot be compiled)."""
    out = {}
    for name, kernel, sig, consts, warps in _cases():
        for arch in (70, 90):
            try:
                out[f"{name}@{arch}"] = dataclasses.asdict(compile_report(kernel, sig, consts, arch=arch,
                                                                          num_warps=warps))
            except Exception as e:  # reported per case by the test
                out[f"{name}@{arch}"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    print("FUSION_AOT_JSON " + json.dumps(out))


@pytest.fixture(scope="module")
def reports():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import sys; sys.path.insert(0, %r); import test_decode_fusions_aot; test_decode_fusions_aot._main()"
            % os.path.dirname(__file__))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("FUSION_AOT_JSON ")]
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line[0][len("FUSION_AOT_JSON "):])


def test_fusion_kernels_compile_without_spills(reports):
    failed = []
    for key, r in reports.items():
        if "error" in r:
            failed.append(f"{key}: {r['error']}")
            continue
        try:
            CompileReport(**{k: tuple(v) if k == "forbidden" else v for k, v in r.items()}).check(max_spill_bytes=0)
        except AssertionError as e:
            failed.append(f"{key}: {e}")
    assert len(reports) == 2 * 10, sorted(reports)
    assert not failed, "\n".join(failed)

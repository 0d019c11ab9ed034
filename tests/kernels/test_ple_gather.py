"""The PLE row gather (kernels/ple_gather.py) against its torch reference, under the interpreter, and its
sm_70 / sm_90 ahead-of-time builds at the real row width (160 values: ple_embed_dim 2560 / 16 heads).

Bitwise: the kernel decodes FP8 exactly and multiplies by the scale in fp32 like the reference, so
every table dtype (FP8 + scale, fp16, bf16, fp32) gives the reference's bits in fp16 and fp32 outputs.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from revolta.kernels.aot import CompileReport
from revolta.kernels.ple_gather import FP8, dequantize_rows, gather_config, ple_gather, ple_gather_ref


def _table(rows, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d, generator=g) * 3
    x[0, : min(d, 4)] = torch.tensor([0.0, -0.0, 1e-3, -448.0])[: min(d, 4)]  # zeros, a subnormal, the largest
    return x.to(dtype)


@pytest.mark.parametrize("table_dtype", [FP8, torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("T,H,d,R", [(1, 4, 16, 97), (5, 3, 13, 211), (37, 16, 160, 503)])
def test_gather_equals_reference(table_dtype, out_dtype, T, H, d, R, poison):
    table = _table(R, d, table_dtype)
    scale = torch.tensor(0.0625) if table_dtype == FP8 else None
    rows = torch.randint(0, R, (T, H), generator=torch.Generator().manual_seed(T))
    rows[0, 0] = 0  # the row with the special values
    got = ple_gather(table, rows, scale, torch.empty(T, H * d, dtype=out_dtype))
    want = ple_gather_ref(table, rows, scale, torch.empty(T, H * d, dtype=out_dtype))
    assert not got.isnan().any()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # bits, -0.0 included
    # the reference is the plain lookup, dequantised
    looked_up = table.view(torch.uint8).view(R, -1)[rows.reshape(-1)].view(table_dtype).view(T, H, d)
    assert torch.equal(want.view(T, H, d), dequantize_rows(looked_up, scale, out_dtype))


def test_gather_checks_its_arguments():
    table = _table(10, 8, FP8)
    rows = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="needs its scale"):
        ple_gather(table, rows, None, torch.empty(2, 24))
    with pytest.raises(ValueError, match=r"\[2, 24\]"):
        ple_gather(table, rows, torch.tensor(1.0), torch.empty(2, 23))


def _builds():
    from revolta.kernels import ple_gather as pg

    sig = dict(table="*u8", rows="*i64", scale="*fp32", out="*fp16", N="i32", D="constexpr", BLOCK_R="constexpr",
               BLOCK_D="constexpr", IS_FP8="constexpr", HAS_SCALE="constexpr")
    block_r, block_d = gather_config(160)
    out = {}
    for arch, act in ((70, "*fp16"), (90, "*bf16")):
        for name, table_t, fp8 in (("fp8", "*u8", True), ("bf16", "*bf16", False), ("fp16", "*fp16", False)):
            s = dict(sig, table=table_t, out=act)
            out[f"{name}@{arch}"] = (pg._ple_gather_kernel, s, dict(D=160, BLOCK_R=block_r, BLOCK_D=block_d,
                                                                     IS_FP8=fp8, HAS_SCALE=fp8), arch)
    return out


def _reports() -> dict:
    """Compile every case (without TRITON_INTERPRET: the interpreter's @jit helpers cannot be compiled)."""
    import dataclasses

    from revolta.kernels.aot import compile_report

    out = {}
    for key, (kernel, sig, consts, arch) in _builds().items():
        try:
            out[key] = dataclasses.asdict(compile_report(kernel, sig, consts, arch=arch, num_warps=4))
        except Exception as e:  # noqa: BLE001 - reported by the test
            out[key] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    return out


def test_gather_compiles_for_sm70_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    problems = []
    for key, r in json.loads(proc.stdout.splitlines()[-1]).items():
        if "error" in r:
            problems.append(f"{key}: {r['error']}")
            continue
        report = CompileReport(**{k: tuple(v) if k == "forbidden" else v for k, v in r.items()})
        try:
            report.check(max_spill_bytes=0, shared_limit=96 * 1024 if report.arch == 70 else 227 * 1024)
        except AssertionError as e:
            problems.append(f"{key}: {e}")
    assert not problems, "\n".join(problems)


if __name__ == "__main__":
    print(json.dumps(_reports()))

"""Packed int4 / NVFP4 linears on the GPU at the real model's projection shapes, correctness checked in the run.

Rows (one per projection of tests/data/qwen3_8_flash_next_config.json, AWQ g32 unless noted):
  * GEMV at M = 1, 8, 40: time of `awq_gemv` (Triton, packed bytes read once) against a device copy of the
    same packed bytes (qweight + qzeros + scales); "bw" = packed bytes / GEMV time; target M = 1 >= 70% of copy;
  * prefill at 8192 tokens: the large-M path (Triton dequantize of weight slices to fp16 + cuBLAS) against
    cuBLAS on the fp16 weight; target >= 50%;
  * the same GEMV for NVFP4 (ModelOpt layout) at M = 1 on the largest projections.
Each row checks the Triton result against the fp32 torch reference (max |err| / max |ref|).
Timing: triton.testing.do_bench (L2 flushed between runs), median.

    PYTHONPATH=src python benchmarks/bench_quant.py            # H200, ~2 minutes
    PYTHONPATH=src python benchmarks/bench_quant.py --small    # CPU, interpreter: correctness only
    PYTHONPATH=src python benchmarks/bench_quant.py --moe      # AWQ MoE instead (bench_quant_moe.py), H200
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def projections(cfg) -> list[tuple[str, int, int]]:
    """(name, out, in) of the real model's quantized projections."""
    t = cfg.text
    return [("qsa q_proj", t.num_attention_heads * t.head_dim * 2, t.hidden_size),
            ("qsa k_proj", t.num_key_value_heads * t.head_dim, t.hidden_size),
            ("qsa o_proj", t.hidden_size, t.num_attention_heads * t.head_dim),
            ("gdn in_proj_qkv", t.gdn_conv_dim, t.hidden_size),
            ("gdn in_proj_z", t.gdn_value_dim, t.hidden_size),
            ("gdn out_proj", t.hidden_size, t.gdn_value_dim),
            ("shared gate_up", 2 * t.shared_expert_intermediate_size, t.hidden_size),
            ("shared down", t.hidden_size, t.shared_expert_intermediate_size),
            ("expert gate_up", 2 * t.moe_intermediate_size, t.hidden_size),
            ("expert down", t.hidden_size, t.moe_intermediate_size)]


def packed_awq(N, K, G, device, gen):
    from revolta.quant.awq import AWQ
    from revolta.quant.config import WeightScheme

    fmt = AWQ(WeightScheme("awq", 4, G, False))
    t = {n: torch.empty(s.shape, dtype=s.dtype, device=device) for n, s in fmt.specs(N, K).items()}
    fmt.random_(t, K ** -0.5, gen)
    return fmt, t


def packed_nvfp4(N, K, device, gen):
    from revolta.quant.config import WeightScheme
    from revolta.quant.nvfp4 import ModelOptNVFP4

    fmt = ModelOptNVFP4(WeightScheme("modelopt-nvfp4", 4, 16, True))
    t = {n: torch.empty(s.shape, dtype=s.dtype, device=device) for n, s in fmt.specs(N, K).items()}
    fmt.random_(t, K ** -0.5, gen)
    return fmt, t


def rel_err(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-30)).item()


def bench(fn, small):
    if small:
        fn()
        return float("nan")
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")  # ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="CPU / interpreter: tiny shapes, correctness only")
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--moe", action="store_true", help="AWQ MoE at the real shapes beside the 16-bit grouped MoE "
                                                       "(bench_quant_moe.py) instead of the linears")
    args = ap.parse_args()
    if args.small:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.moe:
        from bench_quant_moe import run

        return run(args.small, args.json)
    from revolta.config import ModelConfig
    from revolta.kernels.quant.common import dequant_matmul
    from revolta.layers.linear import quant_linear

    device = torch.device("cpu" if args.small else "cuda")
    dtype = torch.float16
    cfg = ModelConfig.from_pretrained(os.path.join(HERE, "..", "tests", "data", "qwen3_8_flash_next_config.json"))
    shapes = projections(cfg)
    if args.small:
        shapes = [("small a", 128, 256), ("small b", 64, 128)]
    gen = torch.Generator(device=device).manual_seed(0)
    rows, start = [], time.time()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (interpreter)"
    print(f"device {name}, torch {torch.__version__}, activations fp16, AWQ group {args.group}")
    print(f"{'projection':16s} {'N x K':>13s} {'M':>5s} {'kernel us':>10s} {'copy us':>8s} {'bw GB/s':>8s} "
          f"{'of copy':>8s} {'rel err':>9s}")
    for label, N, K in shapes:
        fmt, t = packed_awq(N, K, args.group, device, gen)
        packed_bytes = sum(v.numel() * v.element_size() for v in t.values())
        flat = torch.cat([v.reshape(-1).view(torch.uint8) for v in t.values()])
        dst = torch.empty_like(flat)
        copy_ms = bench(lambda: dst.copy_(flat), args.small)
        w_ref = fmt.dequantize(t, torch.float32)
        for M in (1, 8, 40):
            x = torch.randn(M, K, generator=gen, device=device).to(dtype)
            got = fmt.gemv(x, t, None)
            err = rel_err(got, x.float() @ w_ref.t())
            ms = bench(lambda: fmt.gemv(x, t, None), args.small)
            bw = packed_bytes / ms / 1e6
            rows.append(dict(kind="gemv", fmt="awq", proj=label, N=N, K=K, M=M, us=ms * 1e3, copy_us=copy_ms * 1e3,
                             gbps=bw, of_copy=copy_ms / ms, rel_err=err))
            print(f"{label:16s} {N:>6d}x{K:<6d} {M:>5d} {ms * 1e3:10.2f} {copy_ms * 1e3:8.2f} {bw:8.0f} "
                  f"{copy_ms / ms:8.1%} {err:9.2e}")
    print(f"\nprefill: {args.prefill_tokens} tokens, dequantized fp16 slices + cuBLAS vs cuBLAS on fp16 weights")
    print(f"{'projection':16s} {'N x K':>13s} {'quant ms':>9s} {'fp16 ms':>8s} {'of fp16':>8s} {'TFLOP/s':>8s} "
          f"{'rel err':>9s}")
    T = 64 + 8 if args.small else args.prefill_tokens
    for label, N, K in shapes[:6]:
        fmt, t = packed_awq(N, K, args.group, device, gen)
        x = torch.randn(T, K, generator=gen, device=device).to(dtype)
        w16 = fmt.dequantize(t, dtype)
        got = quant_linear(x, fmt, t, N, kernel="triton")
        err = rel_err(got, torch.nn.functional.linear(x.float(), w16.float()))
        q_ms = bench(lambda: quant_linear(x, fmt, t, N, kernel="triton"), args.small)
        f_ms = bench(lambda: torch.nn.functional.linear(x, w16), args.small)
        tflops = 2 * T * N * K / q_ms / 1e9
        rows.append(dict(kind="prefill", fmt="awq", proj=label, N=N, K=K, M=T, ms=q_ms, fp16_ms=f_ms,
                         of_fp16=f_ms / q_ms, tflops=tflops, rel_err=err))
        print(f"{label:16s} {N:>6d}x{K:<6d} {q_ms:9.3f} {f_ms:8.3f} {f_ms / q_ms:8.1%} {tflops:8.1f} {err:9.2e}")
        del w16
    print("\nNVFP4 (ModelOpt layout) GEMV, M = 1")
    for label, N, K in shapes[:1] + shapes[3:4]:
        fmt, t = packed_nvfp4(N, K, device, gen)
        packed_bytes = sum(v.numel() * v.element_size() for v in t.values())
        flat = torch.cat([v.reshape(-1).view(torch.uint8) for v in t.values()])
        dst = torch.empty_like(flat)
        copy_ms = bench(lambda: dst.copy_(flat), args.small)
        x = torch.randn(1, K, generator=gen, device=device).to(dtype)
        err = rel_err(fmt.gemv(x, t, None), x.float() @ fmt.dequantize(t, torch.float32).t())
        ms = bench(lambda: fmt.gemv(x, t, None), args.small)
        rows.append(dict(kind="gemv", fmt="nvfp4", proj=label, N=N, K=K, M=1, us=ms * 1e3, copy_us=copy_ms * 1e3,
                         gbps=packed_bytes / ms / 1e6, of_copy=copy_ms / ms, rel_err=err))
        print(f"{label:16s} {N:>6d}x{K:<6d} {1:>5d} {ms * 1e3:10.2f} {copy_ms * 1e3:8.2f} "
              f"{packed_bytes / ms / 1e6:8.0f} {copy_ms / ms:8.1%} {err:9.2e}")
    worst = max(r["rel_err"] for r in rows)
    print(f"\nworst relative error {worst:.2e} (fp16 outputs); {time.time() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if worst < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())

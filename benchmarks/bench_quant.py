"""Packed int4 / NVFP4 linears on the GPU at the real model's projection shapes, correctness checked in the run.

Rows (one per projection of tests/data/qwen3_8_flash_next_config.json, AWQ g32 unless noted):
  * GEMV at M = 1, 5, 8, 16, 40, both decode paths side by side in one run: "tile" (common.py's tile kernels in
    awq.py / ct_int4.py / nvfp4.py) and "nibble" (gemv_nibble.py: the group-factored decode); "% copy" = the
    GEMV's bandwidth on its packed bytes (qweight + qzeros + scales, read once) over the copy bandwidth measured in
    the same run (a 1 GiB device copy, read + write counted, as bench_fulldepth and the MoE rows count it); target
    M = 1 >= 70%. "copy us" is a graph-replayed copy of the same packed bytes, for scale only: it moves them twice,
    so copy us / GEMV us is up to 2x the bandwidth fraction (RESULTS.md K6 reported that ratio as "% of copy").
    The header names the path the model takes per format on this GPU (kernels/quant/gemv_nibble.py:
    NIBBLE_GEMV_SM80); "nibble cfg" = BLOCK_M x BLOCK_N / SPLIT_K;
  * the same for compressed-tensors int4 (symmetric) and NVFP4 (ModelOpt layout) on two projections;
  * prefill at 8192 tokens: the large-M path (Triton dequantize of weight slices to fp16 + cuBLAS) against
    cuBLAS on the fp16 weight; target >= 50%. Timed both eagerly (one call at a time: includes the host's launch
    of the dequantize, which a prefill's queued layers hide; K6d's k_proj row) and as a graph replay of one call
    (GPU time only), each path the same way.
Each GEMV row checks both paths against the fp32 torch reference (max |err| / max |ref|).
Timing: triton.testing.do_bench (L2 flushed between runs), median, of a CUDA graph replay of back-to-back calls
over rotating copies of the weights (~256 MB in all, so each call reads its weights from memory), divided by the
calls: how a decode step's graph runs them (a graph of one call adds the graph launch, ~5-8 us, to every call:
K6b's first table); K6 timed the eager calls, which include the Python launch cost (~40 us at the smallest shapes);
--eager times single eager calls.

    PYTHONPATH=src python benchmarks/bench_quant.py                 # H200, fp16, ~3 minutes
    PYTHONPATH=src python benchmarks/bench_quant.py --dtype bf16 --skip-prefill
    PYTHONPATH=src python benchmarks/bench_quant.py --small         # CPU, interpreter: correctness only
    PYTHONPATH=src python benchmarks/bench_quant.py --moe           # AWQ MoE instead (bench_quant_moe.py), H200
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


def packed_ct(N, K, G, device, gen):
    from revolta.quant.config import WeightScheme
    from revolta.quant.ct_int4 import CTInt4

    fmt = CTInt4(WeightScheme("ct-int4", 4, G, True))
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


ROTATE_BYTES = 256 << 20  # weight copies a timed graph cycles through: 5x the H100's / H200's 50 MB of L2
ROTATE_MAX = 64


def packed_nbytes(t: dict) -> int:
    """Bytes of a packed linear's tensors (qweight + qzeros + scales, or its format's)."""
    return sum(v.numel() * v.element_size() for v in t.values())


def rotating(t: dict, small: bool) -> list[dict]:
    """Copies of the packed tensors `t` (equal values) whose bytes add up to ~ROTATE_BYTES (at most ROTATE_MAX), so
    that back-to-back calls in one graph read their weights from memory, not from L2; [t] when small."""
    n = 1 if small else max(1, min(ROTATE_MAX, ROTATE_BYTES // packed_nbytes(t)))
    return [t] + [{k: v.clone() for k, v in t.items()} for _ in range(n - 1)]


def bench(fn, small, graph=False, calls=1):
    """ms per call (median; L2 flushed before each run of fn); graph: of a CUDA graph replay of fn; fn makes `calls`
    calls (back to back in the graph, as a decode step's kernels run) and the time is divided by them."""
    if small:
        fn()
        return float("nan")
    from triton.testing import do_bench

    if graph:
        fn()  # compile outside the capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    return do_bench(fn, warmup=25, rep=100, return_mode="median") / calls


def copy_gbs(small: bool) -> float:
    """Device copy bandwidth (read + write) of a 1 GiB buffer, GB/s (engine_timing.copy_bandwidth_gbs)."""
    if small:
        return float("nan")
    from engine_timing import copy_bandwidth_gbs

    return copy_bandwidth_gbs("cuda", gib=1.0)


def gemv_rows(fmt_name, fmt, t, label, N, K, Ms, dtype, args, gen, rows):
    """Time both GEMV paths (and a copy of the packed bytes) at each M; print one line per M."""
    from revolta.kernels.quant.common import device_facts
    from revolta.kernels.quant.gemv_nibble import nibble_gemv_config

    device = t[next(iter(t))].device
    graph = not args.eager
    packed_bytes = packed_nbytes(t)
    flat = torch.cat([v.reshape(-1).view(torch.uint8) for v in t.values()])
    dst = torch.empty_like(flat)
    copy_ms = bench(lambda: dst.copy_(flat), args.small, graph)
    w_ref = fmt.dequantize(t, torch.float32)
    sms, arch = device_facts(device)
    group = fmt.group(K)
    layout = {"awq": "awq", "ct-int4": "ct_int4"}.get(fmt.name, "nvfp4")
    copies = rotating(t, args.small or not graph)
    for M in Ms:
        x = torch.randn(M, K, generator=gen, device=device).to(dtype)
        want = x.float() @ w_ref.t()
        r = dict(kind="gemv", fmt=fmt_name, proj=label, N=N, K=K, M=M, dtype=str(dtype), bytes=packed_bytes,
                 copy_us=copy_ms * 1e3,
                 graph=graph)
        for path, nibble in (("tile", False), ("nibble", True)):
            r[f"{path}_err"] = rel_err(fmt.gemv(x, t, None, nibble=nibble), want)
            ms = bench(lambda: [fmt.gemv(x, c, None, nibble=nibble) for c in copies], args.small, graph, len(copies))
            r[f"{path}_us"], r[f"{path}_of_copy"] = ms * 1e3, packed_bytes / (ms * 1e-3) / 1e9 / args.copy_gbs
        c = nibble_gemv_config(M, N, K, group, layout, sms, arch)
        r["nibble_cfg"] = f"{c['BLOCK_M']}x{c['BLOCK_N']}/{c['SPLIT_K']}"
        rows.append(r)
        print(f"{label:16s} {N:>6d}x{K:<6d} {M:>3d} {r['copy_us']:8.2f} {r['tile_us']:8.2f} {r['tile_of_copy']:7.1%} "
              f"{r['nibble_us']:9.2f} {r['nibble_of_copy']:7.1%} {r['tile_us'] / r['nibble_us']:7.2f}x "
              f"{r['nibble_cfg']:>10s} {max(r['tile_err'], r['nibble_err']):9.2e}")


GEMV_HEADER = (f"{'projection':16s} {'N x K':>13s} {'M':>3s} {'copy us':>8s} {'tile us':>8s} {'% copy':>7s} "
               f"{'nibble us':>9s} {'% copy':>7s} {'speedup':>8s} {'nibble cfg':>10s} {'rel err':>9s}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="CPU / interpreter: tiny shapes, correctness only")
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16", help="activations of the GEMV rows")
    ap.add_argument("--eager", action="store_true", help="time the GEMV calls themselves, not a graph replay")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--ms", default="1,5,8,16,40",
                    help="the GEMV rows' token counts (comma list; \"\": none, the prefill rows only)")
    ap.add_argument("--moe", action="store_true", help="AWQ MoE at the real shapes beside the 16-bit grouped MoE "
                                                       "(bench_quant_moe.py) instead of the linears")
    ap.add_argument("--moe-ms", default="1,8,40", help="--moe: the token counts")
    ap.add_argument("--moe-dtypes", default="bf16,fp16", help="--moe: the activation dtypes")
    ap.add_argument("--moe-variants", help="--moe: the variants timed beside the default (comma list, 'none'; "
                                           "default: all that apply)")
    ap.add_argument("--moe-kernels", action="store_true", help="--moe: the default's time per kernel (profiler)")
    args = ap.parse_args()
    if args.small:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.moe:
        from bench_quant_moe import run

        return run(args.small, args.json, tuple(int(m) for m in args.moe_ms.split(",")),
                   tuple({"bf16": torch.bfloat16, "fp16": torch.float16}[d] for d in args.moe_dtypes.split(",")),
                   None if args.moe_variants is None else tuple(v for v in args.moe_variants.split(",")
                                                                if v not in ("", "none")),
                   args.moe_kernels)
    from revolta.config import ModelConfig
    from revolta.layers.linear import quant_linear

    from revolta.kernels.quant.common import device_facts
    from revolta.kernels.quant.gemv_nibble import use_nibble

    device = torch.device("cpu" if args.small else "cuda")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    cfg = ModelConfig.from_pretrained(os.path.join(HERE, "..", "tests", "data", "qwen3_8_flash_next_config.json"))
    shapes = projections(cfg)
    Ms = tuple(int(m) for m in args.ms.split(",") if m)  # "": prefill rows only
    if args.small:
        shapes, Ms = [("small a", 128, 256), ("small b", 64, 128)], (1, 5, 17)
    gen = torch.Generator(device=device).manual_seed(0)
    rows, start = [], time.time()
    args.copy_gbs = copy_gbs(args.small)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (interpreter)"
    arch = device_facts(device)[1]
    default = ", ".join(f"{f} {'nibble' if use_nibble(arch, dtype, f) else 'tile'}" for f in ("awq", "ct_int4", "nvfp4"))
    print(f"device {name}, torch {torch.__version__}, activations {args.dtype}, AWQ group {args.group}, timing "
          f"{'eager calls' if args.eager else 'CUDA graph replay'}, copy bandwidth {args.copy_gbs:,.0f} GB/s (% copy "
          f"is over it)\nmodel default here above one row: {default} "
          f"(kernels/quant/gemv_nibble.py NIBBLE_GEMV_SM80); one 16-bit row of a wide AWQ weight takes the "
          f"word-column walk instead (gemv_wordcol.use_wordcol), not timed here: sweep_nibble_gemv.py --half2 --ms 1")
    print(GEMV_HEADER)
    for label, N, K in shapes:
        fmt, t = packed_awq(N, K, args.group, device, gen)
        gemv_rows("awq", fmt, t, label, N, K, Ms, dtype, args, gen, rows)
    for fmt_name in ("ct-int4", "nvfp4"):
        print(f"\n{fmt_name} ({'group ' + str(args.group) + ', symmetric' if fmt_name == 'ct-int4' else 'ModelOpt'})")
        for label, N, K in shapes[:1] + shapes[3:4]:
            fmt, t = packed_ct(N, K, args.group, device, gen) if fmt_name == "ct-int4" else packed_nvfp4(N, K, device, gen)
            gemv_rows(fmt_name, fmt, t, label, N, K, Ms[:1] + Ms[2:3], dtype, args, gen, rows)  # M = 1 and 8 by default
    one = [r for r in rows if r["M"] == 1 and r["fmt"] == "awq"]
    if one and not args.small:
        print(f"\nAWQ M = 1, % of copy: tile {min(r['tile_of_copy'] for r in one):.0%}-"
              f"{max(r['tile_of_copy'] for r in one):.0%}, nibble {min(r['nibble_of_copy'] for r in one):.0%}-"
              f"{max(r['nibble_of_copy'] for r in one):.0%} (target >= 70%)")
    if args.skip_prefill:
        return _finish(rows, args, start)
    print(f"\nprefill: {args.prefill_tokens} tokens, dequantized {args.dtype} slices + cuBLAS vs cuBLAS on "
          f"{args.dtype} weights")
    print(f"{'projection':16s} {'N x K':>13s} {'quant ms':>9s} {args.dtype + ' ms':>8s} {'of ' + args.dtype:>8s} "
          f"{'TFLOP/s':>8s} {'graph q ms':>10s} {'graph ' + args.dtype:>10s} {'of':>6s} {'rel err':>9s}")
    T = 64 + 8 if args.small else args.prefill_tokens
    for label, N, K in shapes[:6]:
        fmt, t = packed_awq(N, K, args.group, device, gen)
        x = torch.randn(T, K, generator=gen, device=device).to(dtype)
        w16 = fmt.dequantize(t, dtype)
        got = quant_linear(x, fmt, t, N, kernel="triton")
        err = rel_err(got, torch.nn.functional.linear(x.float(), w16.float()))
        q_ms = bench(lambda: quant_linear(x, fmt, t, N, kernel="triton"), args.small)
        f_ms = bench(lambda: torch.nn.functional.linear(x, w16), args.small)
        qg_ms = bench(lambda: quant_linear(x, fmt, t, N, kernel="triton"), args.small, graph=True)
        fg_ms = bench(lambda: torch.nn.functional.linear(x, w16), args.small, graph=True)
        tflops = 2 * T * N * K / q_ms / 1e9
        rows.append(dict(kind="prefill", fmt="awq", proj=label, N=N, K=K, M=T, ms=q_ms, fp16_ms=f_ms,
                         of_fp16=f_ms / q_ms, tflops=tflops, graph_ms=qg_ms, graph_fp16_ms=fg_ms,
                         graph_of_fp16=fg_ms / qg_ms, rel_err=err))
        print(f"{label:16s} {N:>6d}x{K:<6d} {q_ms:9.3f} {f_ms:8.3f} {f_ms / q_ms:8.1%} {tflops:8.1f} {qg_ms:10.3f} "
              f"{fg_ms:10.3f} {fg_ms / qg_ms:6.1%} {err:9.2e}")
        del w16
    return _finish(rows, args, start)


def _finish(rows, args, start) -> int:
    worst = max(v for r in rows for k, v in r.items() if k.endswith("err"))
    print(f"\nworst relative error {worst:.2e} ({args.dtype} outputs); {time.time() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if worst < 2e-2 else 1

if __name__ == "__main__":
    sys.exit(main())

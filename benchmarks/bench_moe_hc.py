"""K5 (MoE grouped GEMM), K7 (HyperConnection read / write) and norm microbenchmarks, spec/performance.md §6.2.

One H200, bf16 (fp16 for the V100 launch configs, correctness only). Order:
  1. ceilings measured in this run: copy bandwidth (read + write of 2 GiB) and bf16 matmul 8192³;
  2. correctness of every timed path against the torch references (and the sm70 configs in fp16);
  3. timings: CUDA-graph replay of a chain of calls over rotating input sets (> 60 MB working set, so
     no call finds its weights in L2); paths that need a host sync (the per-expert torch loop) are
     timed eagerly with events and labelled so;
  4. JSON to $OUT/bench_moe_hc.json (default ./bench_out), the table printed last.

MoE: hidden 2560, ffn 640, 512 experts, top-10, shared expert (ffn 640) with a sigmoid gate.
  ours            = moe_route + fused_moe (Triton), shared expert fused as expert 512 (k = 11)
  ours_unfused    = routed experts through fused_moe (k = 10), shared expert as torch matmuls
  grouped_mm      = sort + torch._grouped_mm (bf16, when it exists), shared fused the same way
  torch_loop      = per-expert torch.matmul loop (eager; host sync for the counts)
  GB/s counts the distinct touched experts' weights (plus the shared expert); TFLOP/s 2·M·k·3·H·I.
HC: d 2560, h 4, r 320: ours = hc_read (Triton), torch = HyperConnection.read (graph and eager);
  hc_combine (the write: x_b + inject_b * out) vs its torch reference.
Norms: the (1+w) RMSNorm over d 2560 (zc_rms_norm) and the GDN gated RMSNorm over 48 heads x 128
  (gated_rms_norm), vs their torch references; GB/s counts input + output (+ gate) bytes.

Run: python benchmarks/bench_moe_hc.py [--quick] [--parts moe,hc,elementwise]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import triton

from revolta.kernels import hc as HC
from revolta.kernels import moe as MOE
from revolta.kernels import norm as NORM
from revolta.layers.hyperconnection import HyperConnection

H, I, E, TOPK = 2560, 640, 512, 10
D, NH, R = 2560, 4, 320
L2_BYTES = 60 * 2**20


def graph_time_us(fns, reps=20):
    """Median µs per call of a CUDA graph that runs every fn once (rotating inputs)."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / len(fns))
    del g
    return statistics.median(times)


def eager_time_us(fns, reps=10):
    for f in fns:
        f()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for f in fns:
            f()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / len(fns))
    return statistics.median(times)


def ceilings():
    n = 2**30  # bf16 elements = 2 GiB
    a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    t = eager_time_us([lambda: b.copy_(a)], reps=10)
    copy_gbs = 2 * a.numel() * 2 / (t * 1e-6) / 1e9
    del a, b
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = eager_time_us([lambda: x @ y], reps=10)
    mm_tflops = 2 * 8192**3 / (t * 1e-6) / 1e12
    return copy_gbs, mm_tflops


def routing(M, kind, gen, num_sets):
    """num_sets router-logit sets [M, E]: 'uniform' (Gumbel noise) or 'zipf' (Gumbel-top-k on Zipf(1) popularity)."""
    sets = []
    for _ in range(num_sets):
        gumbel = -torch.log(-torch.log(torch.rand(M, E, device="cuda", generator=gen).clamp_min(1e-20)))
        if kind == "zipf":
            pop = 1.0 / torch.arange(1, E + 1, device="cuda", dtype=torch.float32)
            perm = torch.randperm(E, device="cuda", generator=gen)  # which experts are popular changes per set
            logits = torch.log(pop)[perm][None, :] + gumbel
        else:
            logits = gumbel
        sets.append(logits)
    return sets


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def bench_moe(Ms, copy_gbs, mm_tflops, quick):
    dt = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    # routed experts + the shared expert as expert E
    w1 = (torch.randn(E + 1, 2 * I, H, device="cuda", dtype=dt, generator=gen) * H**-0.5)
    w2 = (torch.randn(E + 1, H, I, device="cuda", dtype=dt, generator=gen) * I**-0.5)
    w_sg = torch.randn(1, H, device="cuda", dtype=dt, generator=gen) * H**-0.5
    expert_bytes = 3 * H * I * 2
    rows, checks = [], []
    has_grouped = hasattr(torch, "_grouped_mm")
    for M in Ms:
        for kind in ("zipf", "uniform"):
            num_sets = 2 if M >= 4096 else 8
            logit_sets = routing(M, kind, gen, num_sets)
            xs = [torch.randn(M, H, device="cuda", dtype=dt, generator=gen) for _ in range(num_sets)]
            shared_logits = [x @ w_sg.t() for x in xs]
            routes = [MOE.moe_route(lg, TOPK, shared_logits=s[:, 0]) for lg, s in zip(logit_sets, shared_logits)]
            routed = [MOE.moe_route(lg, TOPK) for lg in logit_sets]
            distinct = statistics.mean(len(torch.unique(ids[:, :TOPK])) for ids, _ in routes)
            touched = (distinct + 1) * expert_bytes
            flops = 2 * M * (TOPK + 1) * 3 * H * I
            # correctness first (set 0)
            ids, w = routes[0]
            ref = MOE.fused_moe_ref(xs[0], w1, w2, ids, w)
            out = MOE.fused_moe(xs[0], w1, w2, ids, w, path="triton")
            checks.append(dict(what=f"moe triton M={M} {kind}", rel_err=rel_err(out, ref)))
            ri, rw = MOE.moe_route_ref(logit_sets[0], TOPK, shared_logits=shared_logits[0][:, 0])
            checks.append(dict(what=f"moe_route M={M} {kind}", ids_equal=bool(torch.equal(ri, ids)),
                               max_w_err=(rw - w).abs().max().item()))
            if has_grouped:
                try:
                    outg = MOE.fused_moe_torch(xs[0], w1, w2, ids, w, use_grouped_mm=True)
                    checks.append(dict(what=f"moe grouped_mm M={M} {kind}", rel_err=rel_err(outg, ref)))
                except Exception as e:  # noqa: BLE001 - a missing or shape-limited private op is reported, not fatal
                    checks.append(dict(what=f"moe grouped_mm M={M} {kind}", error=repr(e)[:200]))
                    has_grouped = False
            res = dict(M=M, routing=kind, distinct_experts=distinct, touched_MB=touched / 1e6, flops=flops)

            def ours(i):
                def f():
                    ids_i, w_i = MOE.moe_route(logit_sets[i], TOPK, shared_logits=shared_logits[i][:, 0])
                    return MOE.fused_moe(xs[i], w1, w2, ids_i, w_i, path="triton")
                return f

            res["ours_us"] = graph_time_us([ours(i) for i in range(num_sets)])
            res["ours_gemm_only_us"] = graph_time_us(
                [(lambda i=i: MOE.fused_moe(xs[i], w1, w2, *routes[i], path="triton")) for i in range(num_sets)])

            def unfused(i):
                def f():
                    ids_r, w_r = routed[i]
                    y = MOE.fused_moe(xs[i], w1, w2, ids_r, w_r, path="triton")
                    gu = xs[i] @ w1[E].t()
                    g_, u_ = gu.split(I, dim=-1)
                    sh = (torch.nn.functional.silu(g_) * u_) @ w2[E].t()
                    return (y.float() + torch.sigmoid(shared_logits[i].float()) * sh.float()).to(dt)
                return f

            res["ours_unfused_shared_us"] = graph_time_us([unfused(i) for i in range(num_sets)])
            if has_grouped:
                try:
                    res["grouped_mm_us"] = graph_time_us(
                        [(lambda i=i: MOE.fused_moe_torch(xs[i], w1, w2, *routes[i], use_grouped_mm=True))
                         for i in range(num_sets)])
                except Exception as e:  # noqa: BLE001
                    res["grouped_mm_error"] = repr(e)[:200]
            if not quick or M <= 64:
                res["torch_loop_eager_us"] = eager_time_us(
                    [(lambda i=i: MOE.fused_moe_torch(xs[i], w1, w2, *routes[i], use_grouped_mm=False))
                     for i in range(num_sets)], reps=3 if M >= 4096 else 5)
            t = res["ours_us"]
            res["ours_GBps"] = touched / (t * 1e-6) / 1e9
            res["ours_frac_copy"] = res["ours_GBps"] / copy_gbs
            res["ours_TFLOPs"] = flops / (t * 1e-6) / 1e12
            res["ours_frac_mm"] = res["ours_TFLOPs"] / mm_tflops
            rows.append(res)
            print(json.dumps(res), flush=True)
    # the V100 launch configs (fp16, sm70 tiles) for correctness only
    w1h, w2h = w1[:64].half(), w2[:64].half()
    for M in (1, 5, 64, 512):
        x = torch.randn(M, H, device="cuda", dtype=torch.float16, generator=gen)
        ids, w = MOE.moe_route(torch.randn(M, 64, device="cuda", generator=gen), TOPK)
        out = MOE.fused_moe(x, w1h, w2h, ids, w, path="triton", config=MOE.moe_config(M, TOPK, 64, arch=70))
        checks.append(dict(what=f"moe sm70 config fp16 M={M}", rel_err=rel_err(out, MOE.fused_moe_ref(x, w1h, w2h, ids, w))))
    return rows, checks


def bench_hc(Ms, copy_gbs, mm_tflops):
    dt = torch.bfloat16
    torch.manual_seed(0)
    num_mods = 8  # 8 × 13.1 MB of weights rotate through L2
    mods = []
    for _ in range(num_mods):
        m = HyperConnection(D, NH, R, 1e-6).cuda().to(dt)
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
        mods.append(m)
    weights = [(m.hc_norm.weight.detach(), m.input_mix_weight_down.weight.detach(), m.input_mix_weight_up.weight.detach(),
                m.block_inject_weight.weight.detach()) for m in mods]
    wbytes = sum(w.numel() for w in weights[0]) * 2
    rows, checks = [], []
    for M in Ms:
        n = 2 if M >= 4096 else num_mods
        xs = [torch.randn(M, NH * D, device="cuda", dtype=dt) * 2 for _ in range(n)]
        ref_u, ref_i = HC.hc_read_ref(xs[0], *weights[0], NH, 1e-6)
        u, inj = HC.hc_read(xs[0], *weights[0], NH, 1e-6, path="triton")
        checks.append(dict(what=f"hc_read M={M}", rel_err_u=rel_err(u, ref_u), rel_err_inject=rel_err(inj, ref_i)))
        xh = xs[0].half()
        wh = [w.half() for w in weights[0]]
        cfg70 = HC.hc_config(M, D, R, NH, arch=70)
        u70, _ = HC.hc_read(xh, *wh, NH, 1e-6, path="triton", config=cfg70)
        checks.append(dict(what=f"hc_read sm70 config fp16 M={M}",
                           rel_err_u=rel_err(u70, HC.hc_read_ref(xh, *wh, NH, 1e-6)[0])))
        res = dict(M=M, weight_MB=wbytes / 1e6, x_MB=xs[0].numel() * 2 / 1e6)
        res["ours_us"] = graph_time_us([(lambda i=i: HC.hc_read(xs[i], *weights[i % num_mods], NH, 1e-6, path="triton")) for i in range(n)])
        with torch.no_grad():
            res["torch_graph_us"] = graph_time_us([(lambda i=i: mods[i % num_mods].read(xs[i])) for i in range(n)])
            res["torch_eager_us"] = eager_time_us([(lambda i=i: mods[i % num_mods].read(xs[i])) for i in range(n)])
        touched = wbytes + xs[0].numel() * 2 + M * D * 2
        t = res["ours_us"]
        res["ours_GBps"] = touched / (t * 1e-6) / 1e9
        res["ours_frac_copy"] = res["ours_GBps"] / copy_gbs
        flops = 2 * M * NH * D * (2 * R + NH)
        res["ours_TFLOPs"] = flops / (t * 1e-6) / 1e12
        rows.append(res)
        print(json.dumps(res), flush=True)
    return rows, checks


def bench_elementwise(Ms, copy_gbs):
    """HC write (hc_combine) and the two norms: small M is launch/latency bound, so each call is timed
    inside a graph of many calls over rotating inputs (> L2 at large M)."""
    dt = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, checks = [], []
    w_norm = torch.randn(D, device="cuda", dtype=dt, generator=gen) * 0.1
    w_gate = torch.randn(128, device="cuda", dtype=dt, generator=gen) * 0.1
    for M in Ms:
        n = 4 if M >= 4096 else 64  # calls per graph
        sets = 2 if M >= 4096 else 16
        xs = [torch.randn(M, NH * D, device="cuda", dtype=dt, generator=gen) for _ in range(sets)]
        inj = [torch.randn(M, NH, device="cuda", dtype=dt, generator=gen) for _ in range(sets)]
        us = [torch.randn(M, D, device="cuda", dtype=dt, generator=gen) for _ in range(sets)]
        hs = [torch.randn(M, D, device="cuda", dtype=dt, generator=gen) for _ in range(sets)]
        os_ = [torch.randn(M * 48, 128, device="cuda", dtype=dt, generator=gen) for _ in range(sets)]
        zs = [torch.randn(M * 48, 128, device="cuda", dtype=dt, generator=gen) for _ in range(sets)]
        checks.append(dict(what=f"hc_combine M={M}", rel_err=rel_err(HC.hc_combine(xs[0], inj[0], us[0]),
                                                                      HC.hc_combine_ref(xs[0], inj[0], us[0]))))
        checks.append(dict(what=f"zc_rms_norm M={M}", rel_err=rel_err(NORM.zc_rms_norm(hs[0], w_norm, 1e-6),
                                                                       NORM.zc_rms_norm_ref(hs[0], w_norm, 1e-6))))
        checks.append(dict(what=f"gated_rms_norm M={M}", rel_err=rel_err(NORM.gated_rms_norm(os_[0], w_gate, zs[0], 1e-6),
                                                                          NORM.gated_rms_norm_ref(os_[0], w_gate, zs[0], 1e-6))))
        cases = {
            "hc_combine": ((lambda i: HC.hc_combine(xs[i % sets], inj[i % sets], us[i % sets])),
                           (lambda i: HC.hc_combine_ref(xs[i % sets], inj[i % sets], us[i % sets])),
                           (2 * M * NH * D + M * D + M * NH) * 2),
            "zc_rms_norm": ((lambda i: NORM.zc_rms_norm(hs[i % sets], w_norm, 1e-6)),
                            (lambda i: NORM.zc_rms_norm_ref(hs[i % sets], w_norm, 1e-6)),
                            (2 * M * D + D) * 2),
            "gated_rms_norm": ((lambda i: NORM.gated_rms_norm(os_[i % sets], w_gate, zs[i % sets], 1e-6)),
                               (lambda i: NORM.gated_rms_norm_ref(os_[i % sets], w_gate, zs[i % sets], 1e-6)),
                               (3 * M * 48 * 128 + 128) * 2),
        }
        for name, (ours, ref, nbytes) in cases.items():
            t = graph_time_us([(lambda i=i: ours(i)) for i in range(n)])
            t_ref = graph_time_us([(lambda i=i: ref(i)) for i in range(n)])
            res = dict(op=name, M=M, bytes=nbytes, ours_us=t, torch_graph_us=t_ref,
                       ours_GBps=nbytes / (t * 1e-6) / 1e9)
            res["ours_frac_copy"] = res["ours_GBps"] / copy_gbs
            rows.append(res)
            print(json.dumps(res), flush=True)
    return rows, checks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="skip the eager torch loop at prefill sizes")
    ap.add_argument("--parts", default="moe,hc,elementwise", help="comma-separated subset of moe,hc,elementwise")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    out_dir = os.environ.get("OUT", "./bench_out")
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    info = dict(torch=torch.__version__, triton=triton.__version__, device=torch.cuda.get_device_name(),
                start=time.strftime("%Y-%m-%d %H:%M:%S"), has_grouped_mm=hasattr(torch, "_grouped_mm"))
    copy_gbs, mm_tflops = ceilings()
    info.update(copy_GBps=copy_gbs, matmul_TFLOPs=mm_tflops)
    print(json.dumps(info), flush=True)
    moe_rows, moe_checks = bench_moe([1, 5, 8, 40, 64, 8192], copy_gbs, mm_tflops, args.quick) if "moe" in parts else ([], [])
    hc_rows, hc_checks = bench_hc([1, 5, 8, 8192], copy_gbs, mm_tflops) if "hc" in parts else ([], [])
    ew_rows, ew_checks = bench_elementwise([1, 5, 8, 64, 8192], copy_gbs) if "elementwise" in parts else ([], [])
    info["wall_s"] = time.time() - t0
    result = dict(info=info, checks=moe_checks + hc_checks + ew_checks, moe=moe_rows, hc=hc_rows, elementwise=ew_rows)
    with open(os.path.join(out_dir, "bench_moe_hc.json"), "w") as f:
        json.dump(result, f, indent=1)

    print("\ncorrectness (rel. error vs torch reference)")
    for c in result["checks"]:
        print("  " + ", ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in c.items()))
    print(f"\nceilings: copy {copy_gbs:,.0f} GB/s, bf16 matmul {mm_tflops:,.0f} TFLOP/s; "
          f"torch {info['torch']}, triton {info['triton']}, {info['device']}")
    hdr = (f"{'MoE M':>6} {'route':>7} {'experts':>7} {'ours us':>8} {'gemm us':>8} {'unfused':>8} {'grp_mm':>8} "
           f"{'loop*':>9} {'GB/s':>7} {'%copy':>6} {'TFLOP/s':>8} {'%mm':>5} {'vs grp':>6}")
    print("\n" + hdr)
    for r in moe_rows:
        g = r.get("grouped_mm_us")
        print(f"{r['M']:>6} {r['routing']:>7} {r['distinct_experts']:>7.1f} {r['ours_us']:>8.1f} "
              f"{r['ours_gemm_only_us']:>8.1f} {r['ours_unfused_shared_us']:>8.1f} {g if g else float('nan'):>8.1f} "
              f"{r.get('torch_loop_eager_us', float('nan')):>9.1f} {r['ours_GBps']:>7.0f} {100 * r['ours_frac_copy']:>5.0f}% "
              f"{r['ours_TFLOPs']:>8.1f} {100 * r['ours_frac_mm']:>4.0f}% {(g / r['ours_us']) if g else float('nan'):>5.2f}x")
    print("  ours = route + fused_moe incl. shared expert (k=11, CUDA graph); gemm = fused_moe only; unfused = shared "
          "expert as torch matmuls; loop* = eager per-expert torch loop (host sync)")
    print(f"\n{'HC M':>6} {'ours us':>8} {'torch graph':>11} {'torch eager':>11} {'GB/s':>7} {'%copy':>6} {'TFLOP/s':>8} {'speedup':>7}")
    for r in hc_rows:
        print(f"{r['M']:>6} {r['ours_us']:>8.1f} {r['torch_graph_us']:>11.1f} {r['torch_eager_us']:>11.1f} "
              f"{r['ours_GBps']:>7.0f} {100 * r['ours_frac_copy']:>5.0f}% {r['ours_TFLOPs']:>8.1f} "
              f"{r['torch_graph_us'] / r['ours_us']:>6.2f}x")
    print(f"\n{'op':>15} {'M':>6} {'bytes':>10} {'ours us':>8} {'torch graph':>11} {'GB/s':>7} {'%copy':>6} {'speedup':>7}")
    for r in ew_rows:
        print(f"{r['op']:>15} {r['M']:>6} {r['bytes']:>10,} {r['ours_us']:>8.2f} {r['torch_graph_us']:>11.2f} "
              f"{r['ours_GBps']:>7.0f} {100 * r['ours_frac_copy']:>5.0f}% {r['torch_graph_us'] / r['ours_us']:>6.2f}x")
    print(f"\nwall {info['wall_s']:.0f} s; JSON: {os.path.join(out_dir, 'bench_moe_hc.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

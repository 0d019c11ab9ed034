"""K5 (MoE grouped GEMM), K7 (HyperConnection read / write) and norm microbenchmarks, spec/performance.md §6.2.

One H200, bf16 (fp16 for the V100 launch configs, correctness only). Order:
  1. ceilings measured in this run: copy bandwidth (read + write of 2 GiB) and bf16 matmul 8192³;
  2. correctness of every timed path against the torch references (and the sm70 configs in fp16);
  3. timings: CUDA-graph replay of a chain of calls over rotating input sets (> 60 MB working set, so
     no call finds its weights in L2); paths that need a host sync (the per-expert torch loop) are
     timed eagerly with events and labelled so;
  4. JSON to $OUT/bench_moe_hc.json (default ./bench_out), the table printed last.

MoE: hidden 2560, ffn 640, top-10 of 512 experts (bf16: M = 1, 8, 40, 64, 8192, uniform and Zipf routing;
  fp16: M = 1, 8, 40) and of the full-depth stand-in's 64 experts (fp16, M = 1, 8, 40), each with the shared
  expert (ffn 640, sigmoid gate) riding as expert E (k = 11); see bench_moe for the columns. The tile
  variants (moe_variants) are timed beside the default config; a fused_moe CUDA graph is replayed on new
  inputs and checked. GB/s counts the distinct touched experts' weights (plus the shared expert).
HC: d 2560, h 4, r 320, M = 1, 2, 4, 5, 8, 16, 64, 8192 (--hc-ms): ours = hc_read's default config, beside
  the K7 kernel ("tiles"), variants of the small-M rows kernels and of the tl.dot passes ("dot*", issue 19:
  each weight tile multiplied once against a 16-row tile) (hc_variants), torch = HyperConnection.read
  (graph and eager); one row per config with its % of the copy bandwidth measured in the same run.
  hc_combine (the write: x_b + inject_b * out) vs its torch reference.
Norms: the (1+w) RMSNorm over d 2560 (zc_rms_norm) and the GDN gated RMSNorm over 48 heads x 128
  (gated_rms_norm), vs their torch references; GB/s counts input + output (+ gate) bytes.

Run: python benchmarks/bench_moe_hc.py [--quick] [--parts moe,hc,elementwise] [--hc-ms 1,8]
[--hc-variants tiles,fused]; no GPU: --smoke (the MoE part
at tiny shapes under the Triton interpreter).
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


def _graph_of(fns) -> torch.cuda.CUDAGraph:
    """A CUDA graph that runs every fn once, warmed (compiled eagerly, then on a side stream) and replayed once."""
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
    return g


def graph_time_us(fns, reps=20):
    """Median µs per call of a CUDA graph that runs every fn once (rotating inputs)."""
    g = _graph_of(fns)
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


def graph_kernel_times_us(fns, reps=20) -> tuple[dict[str, float], float]:
    """Where graph_time_us's time goes: ({kernel name: GPU µs per call}, wall µs per call) of the same graph (every fn
    once, rotating inputs) replayed reps times under the torch profiler. The wall time over the kernels' sum is the
    launch gaps between the graph's nodes."""
    from torch.profiler import ProfilerActivity, profile

    g = _graph_of(fns)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            g.replay()
        e.record()
        e.synchronize()
    per_call = reps * len(fns)
    times: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            times[ev.name] = times.get(ev.name, 0.0) + ev.time_range.elapsed_us() / per_call
    del g
    return times, s.elapsed_time(e) * 1e3 / per_call


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


def routing(M, kind, gen, num_sets, num_experts=E, device="cuda"):
    """num_sets router-logit sets [M, E]: 'uniform' (Gumbel noise) or 'zipf' (Gumbel-top-k on Zipf(1) popularity)."""
    sets = []
    for _ in range(num_sets):
        gumbel = -torch.log(-torch.log(torch.rand(M, num_experts, device=device, generator=gen).clamp_min(1e-20)))
        if kind == "zipf":
            pop = 1.0 / torch.arange(1, num_experts + 1, device=device, dtype=torch.float32)
            perm = torch.randperm(num_experts, device=device, generator=gen)  # which experts are popular changes per set
            logits = torch.log(pop)[perm][None, :] + gumbel
        else:
            logits = gumbel
        sets.append(logits)
    return sets


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------------- MoE (K5)

# (routed experts, token rows, routings, dtypes): the real model, then the full-depth stand-in's 64 experts
MOE_PLAN = ((E, (1, 8, 40, 64, 8192), ("uniform", "zipf"), (torch.bfloat16,)),
            (E, (1, 8, 40), ("uniform",), (torch.float16,)),
            (64, (1, 8, 40), ("uniform",), (torch.float16,)))  # the stand-in runs fp16
MOE_SMOKE_PLAN = ((16, (1, 8), ("zipf",), (torch.float16,)),)  # CPU, interpreter, tiny shapes


def moe_variants(M, top_k, num_experts, arch):
    """Tile configs timed beside the default one (`moe_config`'s choice), so one GPU run can pick the best;
    change the defaults in revolta.kernels.moe_grouped.grouped_config."""
    base = MOE.moe_config(M, top_k, num_experts, arch)
    if not base["GROUPED"] or (arch is not None and arch < 80):
        return {}
    v = {"n16/32": dict(base, BLOCK_N_UP=16, BLOCK_N_DOWN=32),  # the default before K5b
         "n64/128": dict(base, BLOCK_N_UP=64, BLOCK_N_DOWN=128),
         "k64s6": dict(base, BLOCK_K_UP=64, BLOCK_K_DOWN=64, num_stages=6),
         "w8": dict(base, num_warps=8)}
    if M == 1:  # CUDA-core GEMV: no tl.dot, no padding of the one row
        v["gemv"] = dict(base, USE_DOT=False, BLOCK_M=1, BLOCK_N_UP=16, BLOCK_K_UP=256, BLOCK_N_DOWN=32,
                         BLOCK_K_DOWN=128, num_stages=1)
    if M >= 32:
        v["m32"] = dict(base, BLOCK_M=32)
    return v


def legacy_config(M, top_k, num_experts, arch):
    """The kernel K5 measured before the grouped path (commit 511eba2): the pairs kernels, with GEMV tiles
    (no tl.dot, BLOCK_M 1..8) below 12 rows per expert on every arch, tl.dot tiles above."""
    T = M * top_k
    if T / max(1, min(T, num_experts)) < 12:
        return dict(MOE.pairs_config(M, top_k, num_experts, arch=70), num_stages=3)
    return MOE.pairs_config(M, top_k, num_experts, arch)


def _moe_bank(num_experts, dtype, gen, device, h, i):
    """Routed experts with the shared one stacked last ([E+1, 2I, H], [E+1, H, I]) and the shared expert
    as views of row E (what the model passes: its own gate / up / down tensors, same row strides)."""
    w1 = torch.randn(num_experts + 1, 2 * i, h, device=device, dtype=dtype, generator=gen) * h**-0.5
    w2 = torch.randn(num_experts + 1, h, i, device=device, dtype=dtype, generator=gen) * i**-0.5
    return w1, w2, (w1[num_experts, :i], w1[num_experts, i:], w2[num_experts])


def graph_replay_check(run, ref, M, h, num_experts, dt, gen):
    """run(x, ids, weights) captured once in a CUDA graph, replayed on new tokens [M, h] and new routing written
    into the captured buffers: rel. error against ref(x, ids, weights) of the new inputs."""

    def inputs():
        x = torch.randn(M, h, device="cuda", dtype=dt, generator=gen)
        logits = routing(M, "uniform", gen, 1, num_experts)[0]
        return (x, *MOE.moe_route(logits, TOPK, shared_logits=torch.randn(M, device="cuda", generator=gen)))

    x, ids, w = inputs()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(x, ids, w)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run(x, ids, w)
    new = inputs()
    for buf, val in zip((x, ids, w), new):
        buf.copy_(val)
    g.replay()
    torch.cuda.synchronize()
    return rel_err(out, ref(*new))


def moe_graph_check(w1r, w2r, shared, M, num_experts, dt, gen):
    """fused_moe through `graph_replay_check`."""
    return graph_replay_check(lambda x, ids, w: MOE.fused_moe(x, w1r, w2r, ids, w, shared_expert=shared),
                              lambda x, ids, w: MOE.fused_moe_ref(x, w1r, w2r, ids, w, shared_expert=shared),
                              M, w1r.shape[-1], num_experts, dt, gen)


def bench_moe(copy_gbs, mm_tflops, quick, timer, smoke=False):
    """K5 rows. ours = fused_moe(path="auto") with the shared expert riding as expert E; route = + moe_route;
    prev = the pairs kernels with K5's configs (legacy_config); grouped_mm = sort + torch._grouped_mm over the
    stacked bank (bf16); loop = eager per-expert torch.matmul (host sync). Bytes: distinct touched routed
    experts plus the shared one, 3·H·I weights each; floor = bytes / copy bandwidth of this run."""
    device = "cpu" if smoke else "cuda"
    h, i = (64, 32) if smoke else (H, I)
    arch = MOE._arch(torch.device(device))
    gen = torch.Generator(device=device).manual_seed(0)
    rows, checks = [], []
    has_grouped = hasattr(torch, "_grouped_mm") and not smoke
    for num_experts, Ms, kinds, dtypes in (MOE_SMOKE_PLAN if smoke else MOE_PLAN):
        for dt in dtypes:
            w1, w2, shared = _moe_bank(num_experts, dt, gen, device, h, i)
            w1r, w2r = w1[:num_experts], w2[:num_experts]
            w_sg = torch.randn(1, h, device=device, dtype=dt, generator=gen) * h**-0.5
            expert_bytes = 3 * h * i * w1.element_size()
            for M in Ms:
                if not smoke and M <= 64:
                    checks.append(dict(what=f"moe CUDA-graph replay on new inputs E={num_experts} M={M} {dt}",
                                       rel_err=moe_graph_check(w1r, w2r, shared, M, num_experts, dt, gen)))
                for kind in kinds:
                    num_sets = 1 if smoke else 2 if M >= 4096 else 8
                    logit_sets = routing(M, kind, gen, num_sets, num_experts, device)
                    xs = [torch.randn(M, h, device=device, dtype=dt, generator=gen) for _ in range(num_sets)]
                    shared_logits = [(x @ w_sg.t())[:, 0] for x in xs]
                    routes = [MOE.moe_route(lg, TOPK, shared_logits=s) for lg, s in zip(logit_sets, shared_logits)]
                    distinct = statistics.mean(len(torch.unique(ids[:, :TOPK])) for ids, _ in routes)
                    touched = (distinct + 1) * expert_bytes
                    res = dict(experts=num_experts, M=M, routing=kind, dtype=str(dt).split(".")[-1],
                               distinct_experts=distinct, touched_MB=touched / 1e6, floor_us=touched / copy_gbs / 1e3,
                               flops=2 * M * (TOPK + 1) * 3 * h * i)
                    tag = f"E={num_experts} M={M} {kind} {res['dtype']}"
                    ids, w = routes[0]
                    ref = MOE.fused_moe_ref(xs[0], w1r, w2r, ids, w, shared_expert=shared)
                    ri, rw = MOE.moe_route_ref(logit_sets[0], TOPK, shared_logits=shared_logits[0])
                    checks.append(dict(what=f"moe_route {tag}", ids_equal=bool(torch.equal(ri, ids)),
                                       max_w_err=(rw - w).abs().max().item()))
                    variants = {"ours": None, "prev": legacy_config(M, TOPK + 1, num_experts + 1, arch)}
                    if kind == "uniform" or smoke:
                        variants.update(moe_variants(M, TOPK + 1, num_experts + 1, arch))
                    for name, cfg in variants.items():
                        out = MOE.fused_moe(xs[0], w1r, w2r, ids, w, path="auto" if cfg is None else "triton",
                                            config=cfg, shared_expert=shared)
                        checks.append(dict(what=f"moe {name} {tag}", rel_err=rel_err(out, ref)))
                        res[f"{name}_us"] = timer([
                            (lambda j=j, cfg=cfg: MOE.fused_moe(xs[j], w1r, w2r, *routes[j], config=cfg,
                                                                path="auto" if cfg is None else "triton",
                                                                shared_expert=shared)) for j in range(num_sets)])

                    def routed_moe(j):
                        def f():
                            ids_j, w_j = MOE.moe_route(logit_sets[j], TOPK, shared_logits=shared_logits[j])
                            return MOE.fused_moe(xs[j], w1r, w2r, ids_j, w_j, shared_expert=shared)
                        return f

                    res["route_us"] = timer([routed_moe(j) for j in range(num_sets)])
                    if has_grouped and dt == torch.bfloat16:
                        try:
                            outg = MOE.fused_moe_torch(xs[0], w1, w2, ids, w, use_grouped_mm=True)
                            checks.append(dict(what=f"moe grouped_mm {tag}", rel_err=rel_err(outg, ref)))
                            res["grouped_mm_us"] = timer([
                                (lambda j=j: MOE.fused_moe_torch(xs[j], w1, w2, *routes[j], use_grouped_mm=True))
                                for j in range(num_sets)])
                        except Exception as e:  # noqa: BLE001 - a missing or shape-limited private op is reported
                            checks.append(dict(what=f"moe grouped_mm {tag}", error=repr(e)[:200]))
                            has_grouped = False
                    if not smoke and M <= 64 and not quick and num_experts == E and dt == torch.bfloat16:
                        res["loop_eager_us"] = eager_time_us(
                            [(lambda j=j: MOE.fused_moe_torch(xs[j], w1, w2, *routes[j], use_grouped_mm=False))
                             for j in range(num_sets)], reps=3)
                    timed = {n: res[f"{n}_us"] for n in variants}
                    res["best"] = min(timed, key=timed.get)
                    for n in ("ours", "route", "best"):
                        t = res[f"{res['best']}_us"] if n == "best" else res[f"{n}_us"]
                        res[f"{n}_frac_copy"] = touched / (t * 1e-6) / 1e9 / copy_gbs
                    res["ours_TFLOPs"] = res["flops"] / (res["ours_us"] * 1e-6) / 1e12
                    res["ours_frac_mm"] = res["ours_TFLOPs"] / mm_tflops
                    rows.append(res)
                    print(json.dumps(res), flush=True)
    if not smoke:  # the V100 launch configs (fp16, sm70 tiles: CUDA-core FMA) for correctness only
        w1h, w2h, sh = _moe_bank(64, torch.float16, gen, device, h, i)
        for M in (1, 5, 40, 64, 512):
            x = torch.randn(M, h, device=device, dtype=torch.float16, generator=gen)
            ids, w = MOE.moe_route(torch.randn(M, 64, device=device, generator=gen), TOPK,
                                   shared_logits=torch.randn(M, device=device, generator=gen))
            cfg = MOE.moe_config(M, TOPK + 1, 65, arch=70)
            out = MOE.fused_moe(x, w1h[:64], w2h[:64], ids, w, path="triton", config=cfg, shared_expert=sh)
            ref = MOE.fused_moe_ref(x, w1h[:64], w2h[:64], ids, w, shared_expert=sh)
            checks.append(dict(what=f"moe sm70 config fp16 M={M} grouped={cfg['GROUPED']}", rel_err=rel_err(out, ref)))
    return rows, checks


def print_moe_table(rows, copy_gbs):
    """One line per row: µs per call (CUDA graph of rotating inputs) and % of the copy bandwidth over the
    distinct touched experts' bytes."""
    if not rows:
        return
    nan = float("nan")
    print(f"\nMoE (top-{TOPK} + shared): µs per call; %copy = touched bytes / time / "
          f"{copy_gbs:,.0f} GB/s")
    hdr = (f"{'E':>4} {'M':>5} {'route':>7} {'dtype':>8} {'experts':>7} {'MB':>7} {'floor':>7} {'ours':>8} {'%copy':>6} "
           f"{'+route':>8} {'%copy':>6} {'prev':>8} {'grp_mm':>8} {'loop*':>8} {'best':>9} {'best us':>8} {'%copy':>6}")
    print(hdr)
    for r in rows:
        print(f"{r['experts']:>4} {r['M']:>5} {r['routing']:>7} {r['dtype']:>8} {r['distinct_experts']:>7.1f} "
              f"{r['touched_MB']:>7.1f} {r['floor_us']:>7.1f} {r['ours_us']:>8.1f} {100 * r['ours_frac_copy']:>5.0f}% "
              f"{r['route_us']:>8.1f} {100 * r['route_frac_copy']:>5.0f}% {r['prev_us']:>8.1f} "
              f"{r.get('grouped_mm_us', nan):>8.1f} {r.get('loop_eager_us', nan):>8.1f} {r['best']:>9} "
              f"{r[r['best'] + '_us']:>8.1f} {100 * r['best_frac_copy']:>5.0f}%")
    print("  ours = fused_moe (auto path) incl. the shared expert; +route = moe_route + ours; prev = the pairs kernels "
          "with K5's configs; grp_mm = torch._grouped_mm (bf16); loop* = eager per-expert torch loop (host sync); "
          "best = fastest of ours / prev / the tile variants (moe_variants); floor = bytes at the copy bandwidth")
    variants = sorted({k[:-3] for r in rows for k in r if k.endswith("_us")} - {"ours", "route", "prev", "grouped_mm",
                                                                                    "loop_eager", "floor"})
    if variants:
        print("  variants (µs): " + "; ".join(
            f"E={r['experts']} M={r['M']} {r['routing']} {r['dtype']}: "
            + ", ".join(f"{v} {r[v + '_us']:.1f}" for v in variants if v + "_us" in r) for r in rows if r["M"] <= 64))


HC_MS = (1, 2, 4, 5, 8, 16, 64, 8192)


def hc_variants(M, arch):
    """name -> hc_read config timed beside the default (`hc_config`'s choice, "ours"); change the default
    in the one dict of revolta.kernels.hc.hc_rows_default. "tiles" is the kernel K7 measured (three
    launches, GEMV tiles at M <= 8); the rest are variants of `hc_rows_default()` (all M <= 64) and of
    `hc_dot_default()` ("dot*": the tl.dot passes of kernels/hc_dot.py, at every M <= 64 here; hc_config
    picks them for M = 4-8 only once their ENABLED flag is set on a measurement)."""
    if M > 64:
        return {}
    rows = dict(HC.hc_rows_default(arch), MAX_M=64)
    delta = {
        "rows": {}, "rows-nopdl": dict(PDL=False),
        "fused": dict(FUSED_MIX=True, SPLITS_PER_BRANCH=1, BLOCK_R=4),  # two launches, 4 splits
        "fused-nopdl": dict(FUSED_MIX=True, SPLITS_PER_BRANCH=1, BLOCK_R=4, PDL=False),
        "fused-spb2": dict(FUSED_MIX=True, SPLITS_PER_BRANCH=2, BLOCK_R=8),
        "br8": dict(BLOCK_R=8), "br32": dict(BLOCK_R=32),
        "spb10": dict(SPLITS_PER_BRANCH=10, BLOCK_R=32, BLOCK_K=256),
        "bc4": dict(BLOCK_C=4, WARPS_UP=4), "bc16": dict(BLOCK_C=16),
        "bm4": dict(BLOCK_M=4), "bm16": dict(BLOCK_M=16)}
    dot = dict(HC.hc_dot_default(arch), MAX_M=64)
    dot_delta = {
        "dot": {}, "dot-nopdl": dict(PDL=False),
        "dot-rowsup": dict(UP="rows", BLOCK_C=4), "dot-rowsdown": dict(DOWN="rows", BLOCK_R=16, BLOCK_K=512),  # one pass each
        "dot-bk128": dict(BLOCK_K=128), "dot-bk512": dict(BLOCK_K=512),
        "dot-br16": dict(BLOCK_R=16), "dot-br64": dict(BLOCK_R=64), "dot-spb10": dict(SPLITS_PER_BRANCH=10),
        "dot-w8": dict(WARPS_DOWN=8, WARPS_UP=8), "dot-bc4": dict(BLOCK_C=4), "dot-bc16": dict(BLOCK_C=16),
        "dot-kc64": dict(UP_BLOCK_K=64)}
    v = {"tiles": HC.hc_config_tiles(M, D, R, NH, arch)}
    v.update({name: HC.rows_config(dict(rows, **dv), M, D, R, NH) for name, dv in delta.items()})
    v.update({name: HC.rows_config(dict(dot, **dv), M, D, R, NH) for name, dv in dot_delta.items()})
    return v


def bench_hc(Ms, copy_gbs, mm_tflops, variant_names=None):
    """K7 rows: hc_read's default config ("ours"), the variants of `hc_variants` and the torch reference
    (HyperConnection.read, under a CUDA graph and eager), each timed as a CUDA graph of calls over 8
    modules (105 MB of weights, so no call finds its weights in L2); % copy = bytes / time / copy GB/s."""
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
    arch = MOE._arch(torch.device("cuda"))
    rows, checks = [], []
    for M in Ms:
        n = 2 if M >= 4096 else num_mods
        xs = [torch.randn(M, NH * D, device="cuda", dtype=dt) * 2 for _ in range(n)]
        ref_u, ref_i = HC.hc_read_ref(xs[0], *weights[0], NH, 1e-6)
        u, inj = HC.hc_read(xs[0], *weights[0], NH, 1e-6, path="triton")
        checks.append(dict(what=f"hc_read M={M}", rel_err_u=rel_err(u, ref_u), rel_err_inject=rel_err(inj, ref_i)))
        if 1 < M <= 64:  # a row's result alone vs among M rows (the rows kernels are row-invariant by design)
            u1, i1 = HC.hc_read(xs[0][M // 2:M // 2 + 1].contiguous(), *weights[0], NH, 1e-6, path="triton")
            checks.append(dict(what=f"hc_read row invariance M={M} vs 1 (default configs)",
                               bitwise=bool(torch.equal(u1[0], u[M // 2]) and torch.equal(i1[0], inj[M // 2]))))
        xh = xs[0].half()
        wh = [w.half() for w in weights[0]]
        cfg70 = HC.hc_config(M, D, R, NH, arch=70)
        u70, _ = HC.hc_read(xh, *wh, NH, 1e-6, path="triton", config=cfg70)
        checks.append(dict(what=f"hc_read sm70 config fp16 M={M}",
                           rel_err_u=rel_err(u70, HC.hc_read_ref(xh, *wh, NH, 1e-6)[0])))
        if 1 < M <= 16:  # the dot passes: sm70's config (K chunks) in fp16, a row alone vs among M rows (bitwise)
            dot = dict(HC.hc_dot_default(arch), MAX_M=16)
            dot70 = HC.rows_config(dict(HC.hc_dot_default(70), MAX_M=16), M, D, R, NH)
            u70, _ = HC.hc_read(xh, *wh, NH, 1e-6, config=dot70)
            checks.append(dict(what=f"hc_read dot sm70 config fp16 M={M}",
                               rel_err_u=rel_err(u70, HC.hc_read_ref(xh, *wh, NH, 1e-6)[0])))
            ud, idot = HC.hc_read(xs[0], *weights[0], NH, 1e-6, config=HC.rows_config(dot, M, D, R, NH))
            u1, i1 = HC.hc_read(xs[0][M // 2:M // 2 + 1].contiguous(), *weights[0], NH, 1e-6,
                                config=HC.rows_config(dot, 1, D, R, NH))
            checks.append(dict(what=f"hc_read dot row invariance M={M} vs 1",
                               bitwise=bool(torch.equal(u1[0], ud[M // 2]) and torch.equal(i1[0], idot[M // 2]))))
        touched = wbytes + xs[0].numel() * 2 + M * D * 2
        res = dict(M=M, weight_MB=wbytes / 1e6, x_MB=xs[0].numel() * 2 / 1e6, bytes=touched,
                   floor_us=touched / copy_gbs / 1e3, config=HC.hc_config(M, D, R, NH, arch))
        variants = {"ours": None, **hc_variants(M, arch)}
        for name, cfg in variants.items():
            if variant_names and name != "ours" and name not in variant_names:
                continue
            try:
                uv, iv = HC.hc_read(xs[0], *weights[0], NH, 1e-6, path="triton", config=cfg)
                checks.append(dict(what=f"hc_read {name} M={M}", rel_err_u=rel_err(uv, ref_u),
                                   rel_err_inject=rel_err(iv, ref_i)))
                res[f"{name}_us"] = graph_time_us([
                    (lambda i=i, cfg=cfg: HC.hc_read(xs[i], *weights[i % num_mods], NH, 1e-6, path="triton",
                                                     config=cfg)) for i in range(n)])
            except Exception as e:  # noqa: BLE001 - one failing variant (e.g. PDL under capture) is reported
                checks.append(dict(what=f"hc_read {name} M={M}", error=repr(e)[:300]))
        with torch.no_grad():
            res["torch_graph_us"] = graph_time_us([(lambda i=i: mods[i % num_mods].read(xs[i])) for i in range(n)])
            res["torch_eager_us"] = eager_time_us([(lambda i=i: mods[i % num_mods].read(xs[i])) for i in range(n)])
        for key in [k for k in res if k.endswith("_us") and k != "floor_us"]:
            res[key[:-3] + "_frac_copy"] = touched / (res[key] * 1e-6) / 1e9 / copy_gbs
        if "ours_us" in res:
            res["ours_GBps"] = touched / (res["ours_us"] * 1e-6) / 1e9
            res["ours_TFLOPs"] = 2 * M * NH * D * (2 * R + NH) / (res["ours_us"] * 1e-6) / 1e12
        rows.append(res)
        print(json.dumps(res), flush=True)
    return rows, checks


def print_hc_table(rows):
    """One line per (M, config): µs per call, % of the copy bandwidth (weights + x + out), speedup over the
    torch reference under a CUDA graph; the fastest config per M marked."""
    if not rows:
        return
    print(f"\n{'HC M':>6} {'config':>12} {'us':>8} {'%copy':>6} {'vs torch graph':>14}")
    for r in rows:
        timed = {k[:-3]: v for k, v in r.items() if k.endswith("_us") and k not in ("floor_us", "torch_eager_us")}
        best = min(timed, key=timed.get)
        for name, t in timed.items():
            mark = "  <- fastest" if name == best else ""
            print(f"{r['M']:>6} {name:>12} {t:>8.2f} {100 * r[name + '_frac_copy']:>5.0f}% "
                  f"{r['torch_graph_us'] / t:>13.2f}x{mark}")
        print(f"{r['M']:>6} {'torch eager':>12} {r['torch_eager_us']:>8.1f}   floor {r['floor_us']:.2f} us "
              f"(bytes at the copy bandwidth); ours = {r['config']}")
    print("  ours = hc_read's default (hc_config); tiles = the K7 kernel (three launches); rows = hc_rows_default() "
          "at every M (= ours up to its MAX_M); rows-nopdl / fused* / br* / spb* / bc* / bm* = variants of it; "
          "dot = hc_dot_default() (tl.dot down and up passes over 16-row tiles), dot-* = variants of it "
          "(benchmarks/bench_moe_hc.py hc_variants); torch graph = HyperConnection.read under a CUDA graph")


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


def moe_smoke():
    """The MoE part's code path on CPU at tiny shapes (Triton interpreter): correctness checks and the table,
    timings meaningless. Run: TRITON_INTERPRET=1 python benchmarks/bench_moe_hc.py --smoke"""
    a = torch.randn(2**24)
    t0 = time.perf_counter()
    a.clone()
    copy_gbs = 2 * a.numel() * 4 / (time.perf_counter() - t0) / 1e9

    def timer(fns):
        t0 = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t0) * 1e6 / len(fns)

    rows, checks = bench_moe(copy_gbs, 1.0, False, timer, smoke=True)
    for c in checks:
        print("  " + ", ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in c.items()))
    print_moe_table(rows, copy_gbs)
    bad = [c for c in checks if c.get("rel_err", 0) > 1e-2 or c.get("ids_equal") is False or "error" in c]
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="skip the eager per-expert torch loop")
    ap.add_argument("--parts", default="moe,hc,elementwise", help="comma-separated subset of moe,hc,elementwise")
    ap.add_argument("--smoke", action="store_true", help="no GPU: the MoE part at tiny shapes on CPU (interpreter)")
    ap.add_argument("--hc-ms", default=",".join(map(str, HC_MS)), help="token counts of the hc part")
    ap.add_argument("--hc-variants", default="", help="comma-separated subset of hc_variants' names (default: all)")
    args = ap.parse_args()
    if args.smoke:
        return moe_smoke()
    parts = set(args.parts.split(","))
    out_dir = os.environ.get("OUT", "./bench_out")
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    info = dict(torch=torch.__version__, triton=triton.__version__, device=torch.cuda.get_device_name(),
                start=time.strftime("%Y-%m-%d %H:%M:%S"), has_grouped_mm=hasattr(torch, "_grouped_mm"))
    copy_gbs, mm_tflops = ceilings()
    info.update(copy_GBps=copy_gbs, matmul_TFLOPs=mm_tflops)
    print(json.dumps(info), flush=True)
    moe_rows, moe_checks = bench_moe(copy_gbs, mm_tflops, args.quick, graph_time_us) if "moe" in parts else ([], [])
    hc_ms = [int(m) for m in args.hc_ms.split(",")]
    hc_names = set(args.hc_variants.split(",")) if args.hc_variants else None
    hc_rows, hc_checks = bench_hc(hc_ms, copy_gbs, mm_tflops, hc_names) if "hc" in parts else ([], [])
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
    print_moe_table(moe_rows, copy_gbs)
    print_hc_table(hc_rows)
    print(f"\n{'op':>15} {'M':>6} {'bytes':>10} {'ours us':>8} {'torch graph':>11} {'GB/s':>7} {'%copy':>6} {'speedup':>7}")
    for r in ew_rows:
        print(f"{r['op']:>15} {r['M']:>6} {r['bytes']:>10,} {r['ours_us']:>8.2f} {r['torch_graph_us']:>11.2f} "
              f"{r['ours_GBps']:>7.0f} {100 * r['ours_frac_copy']:>5.0f}% {r['torch_graph_us'] / r['ours_us']:>6.2f}x")
    print(f"\nwall {info['wall_s']:.0f} s; JSON: {os.path.join(out_dir, 'bench_moe_hc.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

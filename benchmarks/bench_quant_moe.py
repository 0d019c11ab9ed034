"""AWQ MoE (`bench_quant.py --moe`): packed experts through kernels/quant/moe.py beside the 16-bit grouped MoE.

Real shapes: hidden 2560, ffn 640, 512 routed experts + the shared expert (ffn 640, riding as expert 512),
top-10 (+1), AWQ int4 group 32 with zero points; M = 1, 8, 40 rows (--moe-ms), uniform routing, bf16 and fp16.
  * copy ceiling measured in this run (device copy of 2 GiB, read + write);
  * quant = quant_fused_moe in its default config (on sm80+ up to 40 tokens the word-column walk, moe_wordcol.py,
    on fp16 pairs for fp16; the group-factored "nib" path above), timed as a CUDA graph over 8 rotating inputs and
    routings (each call finds few of its experts in L2); % copy = distinct touched experts' packed bytes (qweight +
    qzeros + scales of gate_up and down, the shared expert counted) / time / copy bandwidth; target >= 60%;
  * the variants (VARIANTS: the tile path of K5c, the nib path's tiles and split-K, the word-column walks: "wc-" one
    token, "wcp-" a program row per pair above it, "-h2-" on fp16 pairs, "-bh2-" bf16 x on fp16 pairs, "fx" the
    reduces inside the kernels) timed beside the default, the fp16-pair ones at fp16 and the rest at bf16 ("tile"
    and the "fx" ones at both dtypes), so one run can pick the best;
  * 16-bit = moe.fused_moe (the grouped kernels) on a bf16/fp16 bank of the same shapes and routing, its
    % copy over its own touched bytes, and quant's speedup over it;
  * checks: every timed path against quant_fused_moe_ref (rel. L2 error), and a CUDA graph of quant_fused_moe
    captured once and replayed on new tokens and routing written into its buffers (no host sync inside);
  * `--moe-variants a,b` (bench_quant.py) times only those variants beside the default ('none': none), and
    `--moe-kernels` adds the default's GPU time per kernel over the same graph's replays and the replay's wall time
    (the rest: the gaps between the graph's nodes; RESULTS.md K5i).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import statistics

import torch

HERE = os.path.dirname(os.path.abspath(__file__))

H, I, E, TOPK, GROUP = 2560, 640, 512, 10, 32
WC = dict(WORDCOL=True, NIBBLE_DOT=False, BLOCK_M=1, USE_DOT=False, BLOCK_N_UP=256, BLOCK_N_DOWN=256, num_warps=1,
          num_stages=1)
VARIANTS = {  # name -> (path, config overrides of quant_grouped_config's choice for that path): "tile" = the
    # decode-each-weight kernels (moe.py), "nib" = the group-factored decode (moe_decode.py; the sm80+ default, whose
    # 4 / 2 K splits at every M won in K5f). Variants that lost in K5e / K5f (narrower tiles, 3 stages, scales ahead,
    # several groups a step) were taken out so a cold-cache run compiles fewer kernels
    "tile": ("tile", {}),
    "nib-d64": ("nib", dict(BLOCK_N_DOWN=64)),
    "nib-sk2": ("nib", dict(SPLIT_UP=2, SPLIT_DOWN=2)),
    "nib-sk8": ("nib", dict(SPLIT_UP=8, SPLIT_DOWN=4)),
    # M = 1 only: the word-column walk on CUDA cores (moe_wordcol.py), single-warp programs of 256 features
    "wc-sk32-8": ("nib", dict(WC, SPLIT_UP=32, SPLIT_DOWN=8)),
    "wc-sk64-16": ("nib", dict(WC, SPLIT_UP=64, SPLIT_DOWN=16)),
    "wc-r8-sk64-16": ("nib", dict(WC, SPLIT_UP=64, SPLIT_DOWN=16, ROWS=8)),
    "wc-pf-sk64-16": ("nib", dict(WC, SPLIT_UP=64, SPLIT_DOWN=16, ROWS=8, PREFETCH=True)),
    "wc-pf-sk128-32": ("nib", dict(WC, SPLIT_UP=128, SPLIT_DOWN=32, ROWS=8, PREFETCH=True)),
    # M = 1, fp16 only: the same walk on fp16 pairs (gemv_wordcol.wordcol_slice_half2)
    "wc-h2-r8-sk64-16": ("nib", dict(WC, SPLIT_UP=64, SPLIT_DOWN=16, ROWS=8, HALF2=True)),
    "wc-h2-r16-sk32-8": ("nib", dict(WC, SPLIT_UP=32, SPLIT_DOWN=8, ROWS=16, HALF2=True)),
    "wc-h2-r16-sk64-16": ("nib", dict(WC, SPLIT_UP=64, SPLIT_DOWN=16, ROWS=16, HALF2=True)),
    "wc-h2-r32-sk32-8": ("nib", dict(WC, SPLIT_UP=32, SPLIT_DOWN=8, ROWS=32, HALF2=True)),
    # M > 1 only: the same walk a program row per (token, slot) pair (an expert several tokens chose is read once per
    # pair: M = 8 ~1.16x the distinct experts' bytes, M = 40 ~1.6x), fewer K slices (many more pairs)
    "wcp-r8-sk16-4": ("nib", dict(WC, SPLIT_UP=16, SPLIT_DOWN=4, ROWS=8)),
    "wcp-r16-sk8-2": ("nib", dict(WC, SPLIT_UP=8, SPLIT_DOWN=2, ROWS=16)),
    "wcp-h2-r16-sk16-4": ("nib", dict(WC, SPLIT_UP=16, SPLIT_DOWN=4, ROWS=16, HALF2=True)),
    "wcp-h2-r32-sk8-2": ("nib", dict(WC, SPLIT_UP=8, SPLIT_DOWN=2, ROWS=32, HALF2=True)),
    "wcp-h2-r8-sk16-4": ("nib", dict(WC, SPLIT_UP=16, SPLIT_DOWN=4, ROWS=8, HALF2=True)),
    "wcp-h2-r16-sk32-8": ("nib", dict(WC, SPLIT_UP=32, SPLIT_DOWN=8, ROWS=16, HALF2=True)),
    "wcp-h2-r16-sk8-2": ("nib", dict(WC, SPLIT_UP=8, SPLIT_DOWN=2, ROWS=16, HALF2=True)),
    "wcp-r16-sk16-4": ("nib", dict(WC, SPLIT_UP=16, SPLIT_DOWN=4, ROWS=16)),
    # the default's config (any M, dtype) with the split-K reduces inside the kernels (FIXUP: no split-act or
    # slot-sum launch), over the weights' own counters ("fx") or counters zeroed by a memset each call ("fxm")
    # bf16 on the fp16-pair walk (each step's x scaled into fp16 by a power of two), bf16 only ("-bh2-")
    "wc-bh2-r16-sk32-8": ("nib", dict(WC, SPLIT_UP=32, SPLIT_DOWN=8, ROWS=16, HALF2=True)),
    "wc-bh2-r16-sk32-8-fx": ("nib", dict(WC, SPLIT_UP=32, SPLIT_DOWN=8, ROWS=16, HALF2=True, FIXUP=True)),
    "wcp-bh2-r16-sk16-4": ("nib", dict(WC, SPLIT_UP=16, SPLIT_DOWN=4, ROWS=16, HALF2=True)),
    "wcp-bh2-r16-sk16-4-fx": ("nib", dict(WC, SPLIT_UP=16, SPLIT_DOWN=4, ROWS=16, HALF2=True, FIXUP=True)),
    "wcp-bh2-r32-sk16-4": ("nib", dict(WC, SPLIT_UP=16, SPLIT_DOWN=4, ROWS=32, HALF2=True)),  # 32-row steps alone
    # the default's config with its program rows in expert order (pairs of an expert side by side: the later ones
    # read its words from L2); M > 1 only
    "eo": ("default", dict(EXPERT_ORDER=True)),
    "fx": ("default", dict(FIXUP=True)),
    "fxm": ("default", dict(FIXUP=True, COUNTERS="memset")),
    "fx-sk2x": ("default", dict(FIXUP=True, SPLIT_SCALE=2)),  # and twice the default's K slices
    # the default's config with gate and up in one walk (JOINT: both weights' words of a step in flight together,
    # half the dependent steps), its four launches chained by programmatic dependent launch (PDL, sm_90), the
    # split-act / slot-sum programs on 64 features (more programs at one token: 110 / 40 instead of 33 / 10), and
    # without the reduces inside the kernels (nofx: one bf16 token's default has FIXUP)
    "j": ("default", dict(JOINT=True)),
    "pdl": ("default", dict(PDL=True)),
    "b64": ("default", dict(ACT_BLOCK=64, SUM_BLOCK=64)),
    "pdl-b64": ("default", dict(PDL=True, ACT_BLOCK=64, SUM_BLOCK=64)),  # each gained at 8 fp16 tokens (K5n, K5o)
    # chained, with the reduces inside the kernels (two launches), or with twice the down / gate_up K slices (more
    # loads in flight for the H200's bandwidth: K5o's M = 8 fp16 was 59% of copy there against 67% on an H100)
    "fx-pdl": ("default", dict(FIXUP=True, PDL=True)),
    "pdl-sd2x": ("default", dict(PDL=True, SPLIT_DOWN=8)),
    "pdl-su2x": ("default", dict(PDL=True, SPLIT_UP=32)),
    "pdl-eo": ("default", dict(PDL=True, EXPERT_ORDER=True)),  # K5m's expert order (H100: 1-3% slower), chained
    "j-pdl": ("default", dict(JOINT=True, PDL=True)),
    "j-pdl-b64": ("default", dict(JOINT=True, PDL=True, ACT_BLOCK=64, SUM_BLOCK=64)),
    "j-nofx-pdl-b64": ("default", dict(JOINT=True, PDL=True, ACT_BLOCK=64, SUM_BLOCK=64, FIXUP=False)),
    "j-r32-pdl-b64": ("default", dict(JOINT=True, PDL=True, ACT_BLOCK=64, SUM_BLOCK=64, ROWS=32)),
    "j-sk2x-pdl-b64": ("default", dict(JOINT=True, PDL=True, ACT_BLOCK=64, SUM_BLOCK=64, SPLIT_SCALE=2)),
}


def scaled_splits(cfg):
    """cfg with its SPLIT_UP / SPLIT_DOWN times SPLIT_SCALE (a VARIANTS key; taken out)."""
    f = cfg.pop("SPLIT_SCALE", 1)
    return cfg | dict(SPLIT_UP=cfg.get("SPLIT_UP", 1) * f, SPLIT_DOWN=cfg.get("SPLIT_DOWN", 1) * f) if f > 1 else cfg


def awq_bank(num_experts, h, i, device, gen):
    """(gate_up, down) PackedWeights of num_experts AWQ experts and the shared expert's (gate, up, down)."""
    from revolta.quant.awq import AWQ
    from revolta.quant.config import WeightScheme

    fmt = AWQ(WeightScheme("awq", 4, GROUP, False))

    def packed(n_out, n_in, lead=(), shards=1):
        t = {n: torch.empty((*lead, *s.shape), dtype=s.dtype, device=device)
             for n, s in fmt.specs(n_out, n_in, shards).items()}
        fmt.random_(t, n_in ** -0.5, gen)
        return fmt.kernel_weights(t)

    experts = (packed(2 * i, h, (num_experts,), 2), packed(h, i, (num_experts,)))
    return experts, (packed(i, h), packed(i, h), packed(h, i))


def moe_hc():
    """benchmarks/bench_moe_hc.py (its timers, routing and 16-bit bank), loaded by path."""
    spec = importlib.util.spec_from_file_location("_bench_moe_hc", os.path.join(HERE, "bench_moe_hc.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(small: bool = False, json_path: str | None = None, ms: tuple[int, ...] = (1, 8, 40),
        dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16), only: tuple[str, ...] | None = None,
        kernels: bool = False) -> int:
    """only: the VARIANTS timed beside the default (None: all that apply); kernels: also the default's time per
    kernel and the graph's launch gaps (bench_moe_hc.graph_kernel_times_us)."""
    from revolta.kernels import moe as MOE
    from revolta.kernels.quant import moe as QMOE

    device = "cpu" if small else "cuda"
    h, i, num_experts, Ms = (64, 32, 16, (1, 8)) if small else (H, I, E, ms)
    hc = moe_hc()
    _moe_bank, eager_time_us, graph_time_us, rel_err, routing = (hc._moe_bank, hc.eager_time_us, hc.graph_time_us,
                                                                 hc.rel_err, hc.routing)
    unknown = set(only or ()) - set(VARIANTS)
    assert not unknown, f"unknown MoE variants {sorted(unknown)}; known: {', '.join(VARIANTS)}"
    gen = torch.Generator(device=device).manual_seed(0)
    arch = MOE._arch(torch.device(device))
    if small:
        copy_gbs, timer = float("nan"), lambda fns: (fns[0](), float("nan"))[1]
    else:
        a = torch.empty(2**30, dtype=torch.int16, device=device)
        b = torch.empty_like(a)
        copy_gbs = 2 * a.numel() * 2 / (eager_time_us([lambda: b.copy_(a)]) * 1e-6) / 1e9
        del a, b
        timer = graph_time_us
    (gate_up, down), shared = awq_bank(num_experts, h, i, device, gen)
    gate_up_own = dataclasses.replace(gate_up, counters=torch.zeros(1 << 14, dtype=torch.int32, device=device))
    expert_bytes = (gate_up.nbytes + down.nbytes) // num_experts
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (interpreter)"
    print(f"{name}: copy {copy_gbs:,.0f} GB/s; AWQ g{GROUP} experts {expert_bytes / 1e6:.2f} MB each "
          f"(16-bit: {3 * h * i * 2 / 1e6:.2f} MB); {num_experts} experts + shared, top-{TOPK}")
    rows, checks, num_sets = [], [], 1 if small else 8
    for dt in (torch.float16,) if small else dtypes:  # the interpreter's bf16 dots are wrong
        w1, w2, shared16 = _moe_bank(num_experts, dt, gen, device, h, i)
        w1r, w2r = w1[:num_experts], w2[:num_experts]
        for M in Ms:
            logit_sets = routing(M, "uniform", gen, num_sets, num_experts, device)
            xs = [torch.randn(M, h, device=device, dtype=dt, generator=gen) for _ in range(num_sets)]
            routes = [MOE.moe_route(lg, TOPK, shared_logits=torch.randn(M, device=device, generator=gen))
                      for lg in logit_sets]
            distinct = statistics.mean(len(torch.unique(ids[:, :TOPK])) for ids, _ in routes)
            touched = (distinct + 1) * expert_bytes
            res = dict(M=M, dtype=str(dt).split(".")[-1], distinct_experts=distinct, packed_MB=touched / 1e6,
                       floor_us=touched / copy_gbs / 1e3, touched16_MB=(distinct + 1) * 3 * h * i * 2 / 1e6)
            tag = f"M={M} {res['dtype']}"
            ref = QMOE.quant_fused_moe_ref(xs[0], gate_up, down, *routes[0], shared_expert=shared)
            base = {p: QMOE.quant_grouped_config(M, TOPK + 1, num_experts + 1, arch, nibble=p == "nib")
                    for p in ("tile", "nib")}
            base["default"] = QMOE.quant_grouped_config(M, TOPK + 1, num_experts + 1, arch, layout="awq", dtype=dt)
            variants = {"quant": None} | {n: scaled_splits(base[p] | v) for n, (p, v) in VARIANTS.items()
                                          if (only is None or n in only)
                                          and (n == "tile" or p == "default" or small
                                               or (dt == torch.float16) == ("-h2-" in n))  # -bh2-: bf16
                                          and (M == 1 or not n.startswith("wc-"))
                                          and (M > 1 or not (n.startswith("wcp-") or n.endswith("eo")))}
            for vname, cfg in variants.items():
                # the weights' own counters, as layers/quant_moe.py gives them, unless the variant times a memset
                gu = gate_up if cfg is not None and cfg.get("COUNTERS") == "memset" else gate_up_own
                try:
                    out = QMOE.quant_fused_moe(xs[0], gu, down, *routes[0], shared_expert=shared, config=cfg)
                except Exception as e:  # a variant that does not build (compile error) is reported, not fatal
                    if vname == "quant":
                        raise
                    print(f"{tag} variant {vname} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    checks.append(dict(what=f"quant {vname} {tag} FAILED", rel_err=float("nan")))
                    continue
                checks.append(dict(what=f"quant {vname} {tag}", rel_err=rel_err(out, ref)))
                t = timer([(lambda j=j, cfg=cfg, gu=gu: QMOE.quant_fused_moe(xs[j], gu, down, *routes[j],
                                                                             shared_expert=shared, config=cfg))
                           for j in range(num_sets)])
                res[f"{vname}_us"], res[f"{vname}_frac_copy"] = t, touched / (t * 1e-6) / 1e9 / copy_gbs
            if kernels and not small:
                fns = [(lambda j=j: QMOE.quant_fused_moe(xs[j], gate_up, down, *routes[j], shared_expert=shared))
                       for j in range(num_sets)]
                per_kernel, wall = hc.graph_kernel_times_us(fns)
                res["kernels_us"], res["kernels_wall_us"] = per_kernel, wall
                print(f"{tag} default, µs per call: " + ", ".join(f"{n} {t:.2f}" for n, t in per_kernel.items())
                      + f"; kernels {sum(per_kernel.values()):.2f} of the replay's {wall:.2f}", flush=True)
            timed = {n: res[f"{n}_us"] for n in variants if f"{n}_us" in res}
            res["best"] = min(timed, key=timed.get)
            out16 = MOE.fused_moe(xs[0], w1r, w2r, *routes[0], shared_expert=shared16)
            checks.append(dict(what=f"16-bit {tag}", rel_err=rel_err(out16, MOE.fused_moe_ref(
                xs[0], w1r, w2r, *routes[0], shared_expert=shared16))))
            t16 = timer([(lambda j=j: MOE.fused_moe(xs[j], w1r, w2r, *routes[j], shared_expert=shared16))
                         for j in range(num_sets)])
            res.update(b16_us=t16, b16_frac_copy=res["touched16_MB"] * 1e6 / (t16 * 1e-6) / 1e9 / copy_gbs,
                       speedup=t16 / res["quant_us"])
            if not small:
                checks.append(dict(what=f"quant CUDA-graph replay on new inputs {tag}",
                                   rel_err=graph_check(gate_up, down, shared, M, dt, h, num_experts, gen)))
            rows.append(res)
            print(json.dumps(res), flush=True)
    print_table(rows, checks, copy_gbs)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(copy_GBps=copy_gbs, rows=rows, checks=checks), f, indent=1)
    worst = max(c["rel_err"] for c in checks if "FAILED" not in c["what"])
    return 0 if worst < 2e-2 and not any("FAILED" in c["what"] for c in checks) else 1


def graph_check(gate_up, down, shared, M, dt, h, num_experts, gen) -> float:
    """quant_fused_moe captured once in a CUDA graph, replayed on new tokens and routing written into the captured
    buffers (bench_moe_hc.graph_replay_check): rel. error against the reference of the new inputs."""
    from revolta.kernels.quant import moe as QMOE

    return moe_hc().graph_replay_check(
        lambda x, ids, w: QMOE.quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared),
        lambda x, ids, w: QMOE.quant_fused_moe_ref(x, gate_up, down, ids, w, shared_expert=shared),
        M, h, num_experts, dt, gen)


def print_table(rows, checks, copy_gbs):
    print(f"\nAWQ MoE (g{GROUP}, top-{TOPK} + shared): µs per call (CUDA graph, rotating inputs); %copy = distinct "
          f"touched experts' bytes / time / {copy_gbs:,.0f} GB/s; target quant >= 60%")
    print(f"{'M':>3} {'dtype':>8} {'experts':>7} {'MB':>6} {'floor':>6} {'quant us':>9} {'%copy':>6} {'tile us':>8} "
          f"{'%copy':>6} {'best':>11} {'best us':>8} {'%copy':>6} {'16-bit us':>9} {'%copy':>6} {'speedup':>7}")
    nan = float("nan")
    for r in rows:
        b = r["best"]
        print(f"{r['M']:>3} {r['dtype']:>8} {r['distinct_experts'] + 1:>7.1f} {r['packed_MB']:>6.1f} "
              f"{r['floor_us']:>6.1f} {r['quant_us']:>9.1f} {100 * r['quant_frac_copy']:>5.0f}% "
              f"{r.get('tile_us', nan):>8.1f} {100 * r.get('tile_frac_copy', nan):>5.0f}% {b:>11} {r[b + '_us']:>8.1f} "
              f"{100 * r[b + '_frac_copy']:>5.0f}% "
              f"{r['b16_us']:>9.1f} {100 * r['b16_frac_copy']:>5.0f}% {r['speedup']:>6.2f}x")
    for r in rows:
        others = {k[:-3]: round(v, 1) for k, v in r.items() if k.endswith("_us") and not k.startswith("kernels")
                  and k not in ("quant_us", "b16_us", "floor_us")}
        if others:
            print(f"  M={r['M']} {r['dtype']} variants µs: {others}")
    print(f"worst check rel. error {max(c['rel_err'] for c in checks):.2e}:")
    for c in checks:
        print(f"  {c['what']}: {c['rel_err']:.2e}")

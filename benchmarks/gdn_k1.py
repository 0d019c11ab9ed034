"""K1 (GDN chunked prefill) helpers for bench_gdn.py: per-kernel GPU time with the torch profiler,
kernels grouped into the stages both implementations share, and the printed tables.

Stages (ours / fla 0.6.0 `chunk_gated_delta_rule`):
  prep:  our chunk-index table / fla's q, k L2 norms and gate cumsum;
  intra: our fused KKᵀ + solve + W, U kernel / fla's KKᵀ + solve (A to memory) and W, U from A;
  walk:  our serial or split state walk (prescan, merge, walk) / fla's `chunk_..._fwd_kernel_h`;
  out:   the output kernel of each;
  other: anything else on the GPU (fills, copies).
So the table shows which of our stages grows faster than fla's from 8K to 32K, and the per-stage
ratio to fla, independently of launch overhead (fla's Python dispatch is in its eager µs, not here).
"""

from __future__ import annotations

import torch

STAGES = ("prep", "intra", "walk", "out", "other")
_PATTERNS = (  # first match wins; names are Triton kernel function names as the profiler reports them
    ("walk", ("_walk_", "_prescan_", "_merge_", "fwd_kernel_h")),
    ("intra", ("_intra_", "kkt", "solve", "recompute_w_u")),
    ("out", ("_chunk_o_", "fwd_kernel_o")),
    ("prep", ("_index_", "l2norm", "cumsum")),
)


def stage_of(kernel_name: str) -> str:
    for stage, parts in _PATTERNS:
        if any(p in kernel_name for p in parts):
            return stage
    return "other"


def kernel_times(fn, reps: int = 3) -> dict:
    """GPU µs per call of each kernel `fn` launches (torch.profiler over `reps` eager calls after one
    untimed call)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0)
        if us > 0:
            out[e.key[:90]] = us / reps
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def stage_times(kernels_us: dict) -> dict:
    """{stage: µs} summed over the kernels of each stage (every stage present, zero if none)."""
    out = dict.fromkeys(STAGES, 0.0)
    for name, us in kernels_us.items():
        out[stage_of(name)] += us
    return out


def autotuned_configs(modules: dict) -> dict:
    """The configuration each autotuned Triton kernel of fla settled on ({kernel: str}), best effort:
    names which walk tile, warps and stages fla's own timing picked on this GPU."""
    from triton.runtime.autotuner import Autotuner
    out = {}
    for mod_name, names in modules.items():
        try:
            mod = __import__(mod_name, fromlist=["_"])
        except Exception as e:  # noqa: BLE001
            out[mod_name] = f"not importable: {e!r}"[:120]
            continue
        for name in names:
            obj = getattr(mod, name, None)
            while obj is not None and not isinstance(obj, Autotuner):  # heuristics wrap the autotuner
                obj = getattr(obj, "fn", None)
            found = obj is not None and (obj.cache or getattr(obj, "best_config", None))  # {key: Config}
            out[name] = str(found)[:300] if found else "not tuned in this process"
    return out


FLA_TUNED = {  # fla 0.6.0 kernels of the forward, by module
    "fla.ops.common.chunk_delta_h": ["chunk_gated_delta_rule_fwd_kernel_h_blockdim64"],
    "fla.ops.common.chunk_o": ["chunk_fwd_kernel_o"],
    "fla.ops.gated_delta_rule.chunk_fwd": ["chunk_gated_delta_rule_fwd_kkt_solve_kernel"],
    "fla.ops.gated_delta_rule.wy_fast": ["recompute_w_u_fwd_kernel"],
}


def print_stage_table(profiles: list) -> None:
    """Per stage: µs at each profiled shape, growth from the first to the last shape, ours / fla."""
    if not profiles:
        return
    print("\n== K1 per-stage GPU µs (torch profiler; growth = last shape / first; x fla = ours / fla) ==")
    shapes = list(dict.fromkeys(p["shape"] for p in profiles))
    by = {(p["shape"], p["dtype"], p["who"]): p["stages_us"] for p in profiles}
    for dtype in dict.fromkeys(p["dtype"] for p in profiles):
        for who in dict.fromkeys(p["who"] for p in profiles):
            cells = []
            for stage in STAGES + ("total",):
                vals = [sum(by[s, dtype, who].values()) if stage == "total" else by[s, dtype, who][stage]
                        for s in shapes if (s, dtype, who) in by]
                if not vals:
                    continue
                growth = f" x{vals[-1] / vals[0]:.2f}" if len(vals) > 1 and vals[0] > 0 else ""
                fla = [sum(by[s, dtype, "fla"].values()) if stage == "total" else by[s, dtype, "fla"][stage]
                       for s in shapes if (s, dtype, "fla") in by]
                vs_fla = (" (" + "/".join(f"{v / f:.2f}" for v, f in zip(vals, fla) if f > 0) + " x fla)"
                          if who != "fla" and len(fla) == len(vals) else "")
                cells.append(f"{stage} " + "/".join(f"{v:.0f}" for v in vals) + growth + vs_fla)
            print(f"{dtype:9s} {who:16s} [{' -> '.join(shapes)}] " + " | ".join(cells))


def print_variant_table(rows: list) -> None:
    """shape, dtype, variant, µs, fla / ours (> 1: ours faster), per-stage µs, output difference to
    our default's (fla's row: its best µs from k1_prefill, its stages from the profiler)."""
    rows = [r for r in rows if r["kernel"] == "K1 variant"]
    if not rows:
        return
    nan = float("nan")
    print("\n== K1 variants (graph µs per call; fla/ours > 1: ours faster; walk = prescan + merge + walk kernels) ==")
    print(f"{'shape':7s} {'dtype':9s} {'variant':18s} {'µs':>9s} {'fla/ours':>8s} {'walk µs':>8s} "
          f"{'intra µs':>8s} {'out µs':>8s}  {'diff to default':>15s}  walk")
    for r in sorted(rows, key=lambda r: (r["shape"], r["dtype"], r["us"])):
        st = r.get("stages_us") or {}
        walk = f"split {r['split_segments']} chunks/seg" if r["split_segments"] else "serial"
        walk = "fla's serial walk" if r["variant"] == "fla" else walk
        print(f"{r['shape']:7s} {r['dtype']:9s} {r['variant']:18s} {r['us']:9.1f} "
              f"{r['ratio_peer_over_ours'] or nan:8.2f} {st.get('walk', nan):8.1f} {st.get('intra', nan):8.1f} "
              f"{st.get('out', nan):8.1f}  {r.get('rel_diff_to_default', nan):15.1e}  {walk}")


if __name__ == "__main__":  # the K1 tables from a saved run: python benchmarks/gdn_k1.py $OUT/bench_gdn.json
    import json
    import sys

    with open(sys.argv[1]) as f:
        saved = json.load(f)
    print_stage_table(saved.get("profiles", []))
    print_variant_table(saved.get("rows", []))
    print("fla autotuned:", saved.get("fla_autotuned", "not recorded"))

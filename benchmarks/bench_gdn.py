"""GDN kernel benchmarks on one GPU (spec/performance.md §6.2 K1-K3), peers in the same process.

    PYTHONPATH=src python benchmarks/bench_gdn.py          # results: $OUT/bench_gdn.json (default ./bench_out)

Stages, in this order (GDN_STAGES=a,b selects; the default runs all but k3_verify, several
minutes on an H200, most of it Triton compiling ours and autotuning fla):
1. correctness: every kernel vs its torch reference at the real head shape (H=16, HV=48,
   K=V=128), bf16 and fp16: chunk prefill (varlen with an empty and a 1-token sequence, 1 x 8K, the
   split walk with forced 1-chunk segments, and in bf16 the default split at 1 x 32K), decode,
   verify, and replay == kept state bitwise;
2. k1_prefill: chunk prefill at 1x8K, 1x32K, 8x1K varlen (initial states from a slot pool), bf16
   and fp16, vs fla `chunk_gated_delta_rule` (Triton path; one sequence in fla's batch form,
   varlen with cu_seqlens); µs per layer eager and CUDA-graph for both, fla / ours ratios (> 1:
   ours faster), chunk-form TFLOP/s (180 k FLOP/token/v-head), output and state difference to fla;
3. k1_profile: per-kernel GPU time (torch.profiler) of ours (default, no split) and fla at 1x8K
   and 1x32K, bf16 and fp16, grouped into stages (gdn_k1.py: prep, intra, walk, out) with each
   stage's growth from 8K to 32K and its ratio to fla's; fla's autotuned configurations;
4. k1_variant_checks, k1_variants: the sm_90 launch-configuration candidates of
   kernels/gdn/chunk_variants.py (GDN_VARIANTS=a,b selects the timed ones; GDN_DTYPES=bf16 times
   one dtype here and in k1_prefill, GDN_SHAPES=1x8K,1x32K some shapes), each checked against the
   torch reference (varlen, serial and split, bf16 and fp16), then timed at the three shapes, CUDA
   graph, beside the default and fla's µs from k1_prefill, each with its per-stage GPU µs (profiler) and its output's
   difference to the default's, so one run shows which configuration to make the default (needs
   k1_prefill in the same run for fla's µs); then the shared memory / registers / spills of
   every compiled chunk kernel;
5. k2_decode: batch 1/8/64/256 (fp32 state pool) vs fla `fused_recurrent_gated_delta_rule` on
   the same states; µs/layer, state GB/s (read + write), output difference to fla, a BV sweep;
6. v100_configs: the sm70 launch configurations (plain and split walk), fp16, correctness only;
7. k3_verify (only when named): T = 2/5/8 vs T = 1 at batch 1 and 8, keep and replay schemes,
   plus fla recurrent over the T tokens.
Timing: CUDA-graph replay of a sequence of calls over rotating inputs/slots (> 60 MB of distinct
data); eager CUDA-event timing as well for prefill, and where a peer cannot be captured. Each
stage catches its own errors, so one failure does not lose the rest.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gdn_k1 beside it, also when a test loads this by path

from gdn_k1 import (FLA_TUNED, autotuned_configs, kernel_times, print_stage_table,  # noqa: E402
                    print_variant_table, stage_times)
from revolta.kernels.gdn import recurrent as rec_mod  # noqa: E402
from revolta.kernels.gdn.chunk import chunk_config, gdn_chunk_prefill  # noqa: E402
from revolta.kernels.gdn.chunk_variants import chunk_variants, variant_overrides  # noqa: E402
from revolta.kernels.gdn.recurrent import gdn_commit, gdn_recurrent_update, gdn_replay_commit, gdn_verify  # noqa: E402
from revolta.kernels.gdn.ref import (gdn_chunk_prefill_ref, gdn_recurrent_update_ref,  # noqa: E402
                                     gdn_verify_ref)

H, HV, K, V = 16, 48, 128, 128
STATE_BYTES = HV * K * V * 4  # one sequence, one layer, fp32
L2_BYTES = 60 << 20
DEV = "cuda"
RESULTS: dict = {"rows": [], "errors": [], "checks": [], "profiles": []}
T_START = time.time()

# Prefill launch configurations timed side by side in k1_variants: kernels/gdn/chunk_variants.py
# (GDN_VARIANTS=a,b selects); the JSON keeps every row.
VARIANTS = chunk_variants(K, V)

try:
    os.environ.setdefault("FLA_FLASH_QLA", "0")  # the Triton path, as in the peer table
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    import fla
    PEER = f"fla {getattr(fla, '__version__', '?')} (Triton path)"
except Exception as e:  # noqa: BLE001
    chunk_gated_delta_rule = fused_recurrent_gated_delta_rule = None
    PEER = f"peer unavailable ({type(e).__name__}: {e})"


def log(*a):
    print(f"[{time.time() - T_START:6.1f}s]", *a, flush=True)


def section(fn):
    @functools.wraps(fn)  # keeps the stage name GDN_STAGES selects by
    def run(*a, **kw):
        try:
            fn(*a, **kw)
        except Exception as e:  # noqa: BLE001
            log(f"ERROR in {fn.__name__}: {e!r}")
            RESULTS["errors"].append({"section": fn.__name__, "error": repr(e), "trace": traceback.format_exc()})
        torch.cuda.synchronize()
    return run


# ---------------------------------------------------------------------------------------------- timing


def time_graph(calls: list, reps: int = 20) -> float:
    """Median µs per call: capture all `calls` (one per rotating input set) in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:  # warm-up and JIT outside the capture
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    del graph
    return sorted(times)[len(times) // 2]


def time_eager(calls: list, reps: int = 10) -> float:
    for c in calls:
        c()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for c in calls:
            c()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return sorted(times)[len(times) // 2]


def time_best(calls: list) -> tuple[float, str]:
    try:
        return time_graph(calls), "graph"
    except Exception:  # noqa: BLE001
        torch.cuda.synchronize()
        return time_eager(calls), "eager"


def n_sets(bytes_per_set: int, cap: int = 8) -> int:
    return max(2, min(cap, -(-2 * L2_BYTES // max(bytes_per_set, 1))))


def row(**kw):
    RESULTS["rows"].append(kw)
    log("  ", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in kw.items()})


# ---------------------------------------------------------------------------------------------- inputs


def rand_inputs(lead, dtype, gen_seed):
    torch.manual_seed(gen_seed)
    q = torch.randn(*lead, H, K, device=DEV, dtype=dtype)
    k = torch.randn(*lead, H, K, device=DEV, dtype=dtype)
    v = torch.randn(*lead, HV, V, device=DEV, dtype=dtype)
    g = torch.nn.functional.logsigmoid(torch.randn(*lead, HV, device=DEV)) * 0.5  # log decay <= 0
    beta = torch.rand(*lead, HV, device=DEV).sigmoid()
    return q, k, v, g, beta


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def check(name, got, want, tol):
    err = rel_err(got, want)
    ok = bool(err <= tol and not torch.isnan(got).any())
    RESULTS["checks"].append({"check": name, "rel_err": err, "tol": tol, "ok": ok})
    log(f"check {name}: rel err {err:.2e} (tol {tol:.0e}) {'OK' if ok else 'FAIL'}")
    return ok


# ---------------------------------------------------------------------------------------------- sections


def _prefill_case(lens, dtype, seed, num_extra_slots=1):
    """Inputs of one varlen prefill: (q, k, v, g, beta), cu_seqlens, a slot pool, slots, initial-state flags."""
    T, B = sum(lens), len(lens)
    x = rand_inputs((T,), dtype, seed)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    pool = torch.randn(B + num_extra_slots, HV, K, V, device=DEV) * 0.1
    slots = torch.arange(num_extra_slots, B + num_extra_slots, dtype=torch.int32, device=DEV)
    return x, cu, pool, slots


def check_prefill(name, lens, dtype, config=None, init=None, tol=None):
    """Ours vs the torch reference: outputs, final states, untouched slots."""
    tol = tol or (2e-2 if dtype == torch.bfloat16 else 5e-3)
    x, cu, pool, slots = _prefill_case(lens, dtype, 1, num_extra_slots=2)
    init = torch.tensor(init or [True] * len(lens), device=DEV)
    p1, p2 = pool.clone(), pool.clone()
    o = gdn_chunk_prefill(*x, cu, p1, slots, init, config=config)
    o_ref = gdn_chunk_prefill_ref(*x, cu, p2, slots, init)
    check(f"chunk_prefill {name} out {dtype}", o, o_ref, tol)
    check(f"chunk_prefill {name} state {dtype}", p1[slots.long()], p2[slots.long()], tol)
    assert torch.equal(p1[:2], pool[:2]), "untouched slots changed"


@section
def correctness():
    torch.manual_seed(0)
    split1 = dataclasses.replace(chunk_config(K, V, 90), cp_min_tokens=1, seg_chunks=1)
    for dtype in (torch.bfloat16, torch.float16):
        tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
        check_prefill("varlen", [1, 100, 0, 199], dtype, init=[True, False, True, True])
        check_prefill("varlen split1", [1, 100, 0, 199], dtype, config=split1, init=[True, False, True, True])
        check_prefill("1x8K", [8192], dtype)
        if dtype == torch.bfloat16:
            check_prefill("1x32K default", [32768], dtype)  # the split walk at its default length

        B = 3
        pool = torch.randn(8, HV, K, V, device=DEV) * 0.1
        slots = torch.tensor([3, 5, 7], dtype=torch.int32, device=DEV)
        qd, kd, vd, gd, bd = rand_inputs((B,), dtype, 2)
        p1, p2 = pool.clone(), pool.clone()
        od = gdn_recurrent_update(qd, kd, vd, gd, bd, p1, slots)
        od_ref = gdn_recurrent_update_ref(qd, kd, vd, gd, bd, p2, slots)
        check(f"decode out {dtype}", od, od_ref, tol)
        check(f"decode state {dtype}", p1, p2, 1e-5)

        Tv = 5
        qv, kv, vv, gv, bv = rand_inputs((B, Tv), dtype, 3)
        buf = torch.empty(B, Tv, HV, K, V, device=DEV)
        p1 = pool.clone()
        ov = gdn_verify(qv, kv, vv, gv, bv, p1, slots, draft_states=buf)
        ov_ref = gdn_verify_ref(qv, kv, vv, gv, bv, pool.clone(), slots)
        check(f"verify out {dtype}", ov, ov_ref, tol)
        assert torch.equal(p1, pool), "verify modified the pool"
        for n in range(Tv + 1):
            acc = torch.tensor([n, Tv - n, min(n, 2)], dtype=torch.int32, device=DEV)
            kept, rep = pool.clone(), pool.clone()
            gdn_commit(buf, kept, slots, acc)
            gdn_replay_commit(qv, kv, vv, gv, bv, rep, slots, acc)
            same = torch.equal(kept, rep)
            RESULTS["checks"].append({"check": f"replay bitwise n={n} {dtype}", "ok": same})
            if not same:
                log(f"check replay bitwise n={n} {dtype}: FAIL max diff {(kept - rep).abs().max().item():.2e}")
    log("correctness done")


@section
def k1_variant_checks():
    """Every candidate of chunk_variants.py vs the torch reference, serial and split, bf16 and fp16
    (bf16 is checked only here: the interpreter's bf16 tl.dot is wrong). Its own stage, so the GPU
    test that runs `correctness` does not compile every candidate."""
    for dtype in (torch.bfloat16, torch.float16):
        for vname, cfg in VARIANTS.items():
            if vname != "default":
                check_prefill(f"varlen {vname}", [1, 100, 0, 199], dtype, config=cfg, init=[True, False, True, True])
                check_prefill(f"varlen {vname} split1", [1, 100, 0, 199], dtype, init=[True, False, True, True],
                              config=dataclasses.replace(cfg, cp_min_tokens=1, seg_chunks=1))


PREFILL_CASES = [("1x8K", [8192]), ("1x32K", [32768]), ("8x1K", [1024] * 8)]
EXTRA_PREFILL_CASES = [("1x4K", [4096]), ("1x16K", [16384])]  # only where GDN_SHAPES names them


def _prefill_cases() -> list:
    """k1_prefill's and k1_variants' shapes: GDN_SHAPES=1x8K,1x32K times those (default PREFILL_CASES' three;
    EXTRA_PREFILL_CASES only when named)."""
    names = os.environ.get("GDN_SHAPES", ",".join(n for n, _ in PREFILL_CASES)).split(",")
    cases = PREFILL_CASES + EXTRA_PREFILL_CASES
    unknown = set(names) - {n for n, _ in cases}
    assert not unknown, f"GDN_SHAPES names unknown shapes {sorted(unknown)}: choose from {[n for n, _ in cases]}"
    return [(n, lens) for n, lens in cases if n in names]


def _fla_prefill_calls(sets, lens, pool):
    """fla chunk prefill on the same inputs: one sequence in fla's batch form [1, T, ...] (no
    cu_seqlens, its fastest path), several with int64 cu_seqlens; initial states = our slots' states."""
    B = len(lens)
    h0 = pool[1:B + 1].clone()
    cu64 = None if B == 1 else torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=DEV)
    return [lambda s=s: chunk_gated_delta_rule(
        s[0][None], s[1][None], s[2][None], g=s[3][None], beta=s[4][None], scale=K**-0.5, initial_state=h0,
        output_final_state=True, cu_seqlens=cu64, use_qk_l2norm_in_kernel=True) for s in sets]


def _prefill_sets(lens, dtype):
    T = sum(lens)
    per_set = T * (2 * H * K + HV * V) * 2
    return [rand_inputs((T,), dtype, 10 + i) for i in range(n_sets(per_set, cap=2))]


PEER_US: dict = {}  # (shape, dtype) -> fla graph µs, for the variants' ratios


@section
def k1_prefill():
    for dtype in _prefill_dtypes():
        for name, lens in _prefill_cases():
            T, B = sum(lens), len(lens)
            sets = _prefill_sets(lens, dtype)
            cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
            pool = torch.randn(B + 1, HV, K, V, device=DEV) * 0.1
            slots = torch.arange(1, B + 1, dtype=torch.int32, device=DEV)
            init = torch.ones(B, dtype=torch.bool, device=DEV)
            ours = [lambda s=s: gdn_chunk_prefill(*s, cu, pool, slots, init) for s in sets]
            t_ours = time_eager(ours)
            t_ours_graph, how = time_best(ours)
            flops = 180e3 * T * HV
            dt = str(dtype).split(".")[-1]
            r = dict(kernel="K1 chunk prefill", shape=name, dtype=dt, ours_us=t_ours, ours_graph_us=t_ours_graph,
                     ours_timing=how, ours_tflops=flops / min(t_ours, t_ours_graph) / 1e6)
            if chunk_gated_delta_rule is not None:
                peer = _fla_prefill_calls(sets, lens, pool)
                t_peer = time_eager(peer)
                t_peer_graph, how_p = time_best(peer)
                PEER_US[name, dt] = min(t_peer, t_peer_graph)
                o_p, ht_p = peer[0]()
                p1 = pool.clone()
                o_o = gdn_chunk_prefill(*sets[0], cu, p1, slots, init)
                r.update(peer_us=t_peer, peer_graph_us=t_peer_graph, peer_timing=how_p,
                         ratio_eager=t_peer / t_ours, ratio_graph=t_peer_graph / t_ours_graph,
                         ratio_best=min(t_peer, t_peer_graph) / min(t_ours, t_ours_graph),
                         peer_rel_diff=rel_err(o_o, o_p[0]), peer_state_rel_diff=rel_err(p1[1:B + 1], ht_p))
            row(**r)
            del sets
            torch.cuda.empty_cache()


def _prefill_dtypes() -> tuple[torch.dtype, ...]:
    """k1_prefill's and k1_variants' dtypes: GDN_DTYPES=bf16 (or fp16) times one (default both)."""
    names = os.environ.get("GDN_DTYPES", "bf16,fp16").split(",")
    known = {"bf16": torch.bfloat16, "fp16": torch.float16}
    assert set(names) <= set(known), f"GDN_DTYPES takes bf16 and / or fp16, got {names}"
    return tuple(known[n] for n in names)


@section
def k1_variants():
    wanted = os.environ.get("GDN_VARIANTS")
    names = wanted.split(",") if wanted else list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    assert not unknown, f"GDN_VARIANTS names unknown candidates {unknown}: choose from {list(VARIANTS)}"
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for dtype in _prefill_dtypes():
        dt = str(dtype).split(".")[-1]
        for name, lens in _prefill_cases():
            B = len(lens)
            sets = _prefill_sets(lens, dtype)
            cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
            pool = torch.randn(B + 1, HV, K, V, device=DEV) * 0.1
            slots = torch.arange(1, B + 1, dtype=torch.int32, device=DEV)
            init = torch.ones(B, dtype=torch.bool, device=DEV)
            pool0 = pool.clone()  # the timed calls overwrite the pool's states; the differences start from these
            o_default = gdn_chunk_prefill(*sets[0], cu, pool0.clone(), slots, init, config=VARIANTS["default"])
            for vname in names:
                cfg = VARIANTS[vname]
                calls = [lambda s=s, cfg=cfg: gdn_chunk_prefill(*s, cu, pool, slots, init, config=cfg) for s in sets]
                t, how = time_best(calls)
                stages = stage_times(kernel_times(calls[0]))
                o_v = gdn_chunk_prefill(*sets[0], cu, pool0.clone(), slots, init, config=cfg)
                peer = PEER_US.get((name, dt))
                row(kernel="K1 variant", variant=vname, shape=name, dtype=dt, us=t, timing=how,
                    split_segments=cfg.segment_chunks(sum(lens), HV, num_sms, cfg.serial_walk_programs(B, HV, V)),
                    stages_us=stages,
                    rel_diff_to_default=rel_err(o_v, o_default),
                    ratio_peer_over_ours=(peer / t) if peer else None, overrides=variant_overrides(vname))
            if chunk_gated_delta_rule is not None and (name, dt) in PEER_US:  # fla's row in the same table
                o_p = _fla_prefill_calls(sets[:1], lens, pool0)[0]()[0][0]
                row(kernel="K1 variant", variant="fla", shape=name, dtype=dt, us=PEER_US[name, dt],
                    timing="best of k1_prefill", split_segments=0, ratio_peer_over_ours=1.0,
                    stages_us=stage_times(kernel_times(_fla_prefill_calls(sets[:1], lens, pool)[0])),
                    rel_diff_to_default=rel_err(o_p, o_default), overrides={})
            del sets
            torch.cuda.empty_cache()
    RESULTS["kernel_resources"] = _compiled_resources()  # now with every candidate's builds
    for r in RESULTS["kernel_resources"]:
        log("  ", r)


def _compiled_resources() -> list:
    """Shared memory, registers and spills of every compiled chunk-prefill kernel in this process
    (occupancy: how many programs of each share an SM). Best effort across Triton versions."""
    from revolta.kernels.gdn import chunk_index, chunk_intra, chunk_out, chunk_state
    out = []
    for mod in (chunk_index, chunk_intra, chunk_state, chunk_out):
        for name in dir(mod):
            fn = getattr(mod, name)
            for caches in getattr(fn, "device_caches", {}).values():
                for key, ck in caches[0].items():
                    try:
                        ck._init_handles()
                        out.append(dict(kernel=name, warps=ck.metadata.num_warps, stages=ck.metadata.num_stages,
                                        shared=ck.metadata.shared, regs=ck.n_regs, spills=ck.n_spills,
                                        key=str(key)[-160:]))
                    except Exception as e:  # noqa: BLE001
                        out.append(dict(kernel=name, error=repr(e)[:120]))
    return out


@section
def k1_profile():
    for dtype in (torch.bfloat16, torch.float16):
        dt = str(dtype).split(".")[-1]
        for name, lens in PREFILL_CASES[:2]:
            x, cu, pool, slots = _prefill_case(lens, dtype, 50)
            init = torch.ones(len(lens), dtype=torch.bool, device=DEV)
            runs = {"ours default": lambda: gdn_chunk_prefill(*x, cu, pool, slots, init),
                    "ours no_split": lambda: gdn_chunk_prefill(*x, cu, pool, slots, init,
                                                               config=VARIANTS["no_split"])}
            if chunk_gated_delta_rule is not None:
                runs["fla"] = _fla_prefill_calls([x], lens, pool)[0]
            for who, fn in runs.items():
                times = kernel_times(fn)
                RESULTS["profiles"].append(dict(shape=name, dtype=dt, who=who, kernels_us=times,
                                                stages_us=stage_times(times), total_us=sum(times.values())))
                log(f"  profile {name} {dt} {who}: total {sum(times.values()):.1f} µs")
                for kname, us in times.items():
                    log(f"      {us:9.1f} µs  {kname}")
            del x
            torch.cuda.empty_cache()
    if chunk_gated_delta_rule is not None:
        RESULTS["fla_autotuned"] = autotuned_configs(FLA_TUNED)
        log("  fla autotuned:", RESULTS["fla_autotuned"])
    RESULTS["kernel_resources"] = _compiled_resources()
    for r in RESULTS["kernel_resources"]:
        log("  ", r)


def _decode_calls(B, dtype):
    num_sets = n_sets(B * STATE_BYTES, cap=32)
    pool = torch.randn(B * num_sets + 1, HV, K, V, device=DEV) * 0.1
    inputs = [rand_inputs((B,), dtype, 20 + i) for i in range(num_sets)]
    slot_sets = [torch.arange(1 + i * B, 1 + (i + 1) * B, dtype=torch.int32, device=DEV) for i in range(num_sets)]
    calls = [lambda s=s, sl=sl: gdn_recurrent_update(*s, pool, sl) for s, sl in zip(inputs, slot_sets)]
    return calls, pool, inputs, slot_sets


def _fla_recurrent(x, h0):
    """fla's recurrent kernel on q, k, v [B, T, H(V), K(V)] and g, beta [B, T, HV] with initial
    states h0 [B, HV, K, V] fp32. g and beta go by keyword: the fourth and fifth positional
    parameters of `fused_recurrent_gated_delta_rule` are g and gk (per-key decay, [B, T, HV, K]),
    so passing beta fifth made fla read gk K times past the end of beta: the illegal memory access
    this script hit at batch 8 and 256."""
    q, k, v, g, beta = x
    return fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, scale=K**-0.5, initial_state=h0,
                                            output_final_state=True, use_qk_l2norm_in_kernel=True)


@section
def k2_decode():
    dtype = torch.bfloat16
    for B in (1, 8, 64, 256):
        default_cfg = rec_mod.recurrent_config(B * HV, V, K)
        calls, pool, inputs, slot_sets = _decode_calls(B, dtype)
        t_ours, how = time_best(calls)
        sweep = {}
        orig = rec_mod.recurrent_config
        for bv, warps in ((8, 1), (16, 1), (16, 2), (32, 2), (32, 4), (64, 4), (128, 4), (128, 8)):
            rec_mod.recurrent_config = lambda *a, bv=bv, warps=warps: (bv, warps)
            try:
                sweep[f"BV{bv}/w{warps}"] = time_best(calls)[0]
            except Exception as e:  # noqa: BLE001
                sweep[f"BV{bv}/w{warps}"] = repr(e)[:80]
            finally:
                rec_mod.recurrent_config = orig
        r = dict(kernel="K2 decode", batch=B, dtype="bf16 in, fp32 state", ours_us=t_ours, timing=how,
                 ours_config=f"BV{default_cfg[0]}/w{default_cfg[1]}",
                 ours_state_GBps=2 * B * STATE_BYTES / t_ours / 1e3, bv_sweep_us=sweep)
        if fused_recurrent_gated_delta_rule is not None:
            h0s = [pool[sl.long()].clone() for sl in slot_sets]  # the same states ours reads
            peer = [lambda s=s, h0=h0: _fla_recurrent([x[:, None] for x in s], h0) for s, h0 in zip(inputs, h0s)]
            p1 = pool.clone()
            o_ours = gdn_recurrent_update(*inputs[0], p1, slot_sets[0])
            o_peer, ht_peer = peer[0]()
            t_peer, how_p = time_best(peer)
            r.update(peer_us=t_peer, peer_timing=how_p, peer_state_GBps=2 * B * STATE_BYTES / t_peer / 1e3,
                     ratio_peer_over_ours=t_peer / t_ours, peer_rel_diff=rel_err(o_ours, o_peer[:, 0]),
                     peer_state_rel_diff=rel_err(p1[slot_sets[0].long()], ht_peer))
        row(**r)
        del calls, pool, inputs
        torch.cuda.empty_cache()


@section
def k3_verify():
    dtype = torch.bfloat16
    for B in (1, 8):
        base = None
        for T in (1, 2, 5, 8):
            num_sets = n_sets(B * STATE_BYTES * (T + 1), cap=16)
            pool = torch.randn(B * num_sets + 1, HV, K, V, device=DEV) * 0.1
            inputs = [rand_inputs((B, T), dtype, 30 + i) for i in range(num_sets)]
            slot_sets = [torch.arange(1 + i * B, 1 + (i + 1) * B, dtype=torch.int32, device=DEV)
                         for i in range(num_sets)]
            bufs = [torch.empty(B, T, HV, K, V, device=DEV) for _ in range(num_sets)]
            acc = torch.full((B,), max(1, T // 2), dtype=torch.int32, device=DEV)
            keep = [lambda s=s, sl=sl, bf=bf: (gdn_verify(*s, pool, sl, draft_states=bf), gdn_commit(bf, pool, sl, acc))
                    for s, sl, bf in zip(inputs, slot_sets, bufs)]
            verify_only = [lambda s=s, sl=sl: gdn_verify(*s, pool, sl) for s, sl in zip(inputs, slot_sets)]
            replay = [lambda s=s, sl=sl: (gdn_verify(*s, pool, sl), gdn_replay_commit(*s, pool, sl, acc))
                      for s, sl in zip(inputs, slot_sets)]
            t_keep, how = time_best(keep)
            t_vonly, _ = time_best(verify_only)
            t_replay, _ = time_best(replay)
            if T == 1:
                base = t_vonly
            r = dict(kernel="K3 verify", batch=B, T=T, dtype="bf16 in, fp32 state", timing=how,
                     keep_verify_commit_us=t_keep, verify_no_states_us=t_vonly, replay_verify_commit_us=t_replay,
                     ratio_to_T1=t_vonly / base if base else None,
                     keep_bytes=B * STATE_BYTES * (1 + T + 2), replay_bytes=B * STATE_BYTES * 3, launches_keep=2,
                     launches_replay=2)
            if fused_recurrent_gated_delta_rule is not None:
                h0s = [pool[sl.long()].clone() for sl in slot_sets]
                peer = [lambda s=s, h0=h0: _fla_recurrent(s, h0) for s, h0 in zip(inputs, h0s)]
                r["peer_recurrent_T_tokens_us"] = time_best(peer)[0]
            row(**r)
            del pool, inputs, bufs
            torch.cuda.empty_cache()


@section
def v100_configs():
    """The sm70 launch configurations (smaller chunk tiles, FMA-sized), fp16, for correctness only."""
    sm70 = chunk_config(K, V, 70)
    check_prefill("sm70 config", [130, 64], torch.float16, config=sm70, init=[True, False])
    check_prefill("sm70 config split", [130, 64], torch.float16, init=[True, False],
                  config=dataclasses.replace(sm70, cp_min_tokens=1, seg_chunks=1))


DEFAULT_STAGES = ("correctness", "k1_prefill", "k1_profile", "k1_variant_checks", "k1_variants", "k2_decode",
                  "v100_configs")


def _print_summary(path):
    print("\n== GDN kernels, µs per layer call (fla/ours > 1: ours faster) ==")
    nan = float("nan")
    for r in RESULTS["rows"]:
        if r["kernel"] == "K1 chunk prefill":
            print(f"K1 {r['shape']:6s} {r['dtype']:9s} ours {r['ours_us']:8.1f} eager {r['ours_graph_us']:8.1f} graph "
                  f"({r['ours_tflops']:5.1f} TFLOP/s) | fla {r.get('peer_us', nan):8.1f} eager "
                  f"{r.get('peer_graph_us', nan):8.1f} {r.get('peer_timing', '')} | fla/ours eager "
                  f"{r.get('ratio_eager', nan):5.2f} graph {r.get('ratio_graph', nan):5.2f} best "
                  f"{r.get('ratio_best', nan):5.2f} | diff to fla {r.get('peer_rel_diff', nan):.1e}")
        elif r["kernel"] == "K1 variant":
            continue  # the variant table below
        elif r["kernel"] == "K2 decode":
            print(f"K2 B={r['batch']:<4d} ours {r['ours_us']:8.2f} {r['ours_state_GBps']:7.0f} GB/s {r['ours_config']:8s}"
                  f" fla {r.get('peer_us', nan):8.2f} fla/ours {r.get('ratio_peer_over_ours', nan):5.2f}"
                  f" diff {r.get('peer_rel_diff', nan):.1e}"
                  f"  best sweep {min((v, k) for k, v in r['bv_sweep_us'].items() if isinstance(v, float))}")
        else:
            print(f"K3 B={r['batch']:<2d} T={r['T']} verify {r['verify_no_states_us']:8.2f} (x{r['ratio_to_T1']:.2f} of T=1)"
                  f"  keep+commit {r['keep_verify_commit_us']:8.2f}  verify+replay {r['replay_verify_commit_us']:8.2f}"
                  f"  fla(T tokens) {r.get('peer_recurrent_T_tokens_us', nan):8.2f}")
    for p in RESULTS["profiles"]:
        top = ", ".join(f"{k.split('(')[0][:40]} {v:.0f}" for k, v in list(p["kernels_us"].items())[:6])
        print(f"profile {p['shape']:6s} {p['dtype']:9s} {p['who']:14s} {p['total_us']:8.1f} µs: {top}")
    print_stage_table(RESULTS["profiles"])
    print_variant_table(RESULTS["rows"])
    if "fla_autotuned" in RESULTS:
        print("fla autotuned:", RESULTS["fla_autotuned"])
    bad = [c for c in RESULTS["checks"] if not c["ok"]]
    for c in bad:
        print(f"FAILED check {c['check']}: {c}")
    for e in RESULTS["errors"]:
        print(f"ERROR in {e['section']}: {e['error'][:300]}")
    print(f"checks: {len(RESULTS['checks']) - len(bad)} ok, {len(bad)} failed; errors: {len(RESULTS['errors'])}; "
          f"wall {RESULTS['meta']['wall_s']:.0f} s; json: {path}")


def main():
    out_dir = os.environ.get("OUT", "./bench_out")
    os.makedirs(out_dir, exist_ok=True)
    import triton
    RESULTS["meta"] = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           peer=PEER, date=time.strftime("%Y-%m-%d %H:%M:%S"), shape=dict(H=H, HV=HV, K=K, V=V))
    log(RESULTS["meta"])
    path = os.path.join(out_dir, "bench_gdn.json")

    def save():  # after every stage: a crash later (a CUDA fault poisons the context) keeps what ran
        RESULTS["meta"]["wall_s"] = time.time() - T_START
        with open(path, "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)

    stages = (correctness, k1_prefill, k1_profile, k1_variant_checks, k1_variants, k2_decode, v100_configs, k3_verify)
    wanted = os.environ.get("GDN_STAGES", ",".join(DEFAULT_STAGES)).split(",")  # e.g. GDN_STAGES=k1_prefill
    for stage in stages:
        if stage.__name__ in wanted:
            log(f"== {stage.__name__}")
            stage()
            save()
    _print_summary(path)


if __name__ == "__main__":
    main()

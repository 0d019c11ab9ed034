"""Full-depth stand-in for Qwen3.8-Flash-Next on the engine (issue 19): plain decode, MTP4 and DFlash2
rounds, where the GPU time goes, and how far each step is from its memory roofline.

    python benchmarks/bench_fulldepth.py              # one H200 (~5 min cold); JSON in $OUT (or --json PATH)
    python benchmarks/bench_fulldepth.py --quick      # C1/C8 only, fewer steps
    python benchmarks/bench_fulldepth.py --device cpu --layers 4 --experts 8   # smoke run: tiny widths, torch path
    python benchmarks/bench_fulldepth.py --fullsize   # the real model: 512 experts, AWQ int4, PLE table on the host

--fullsize (issues 21 and 22) is the full-size model on one H200: the real config (48 layers, 512 experts,
the real 47.7 GiB n-gram table) with random AWQ int4 weights (group 32) drawn on the GPU
(quantized.random_quantized_model, 72.6 GiB) and the PLE table as random FP8 rows in pinned host memory
(ple_placement "host", ple/random_table.py); its roofline counts the packed bytes. --weights awq and
--ple host also apply to the 64-expert stand-in.

The stand-in (benchmarks/standin.py): the real config (48 layers, real widths, top-10 routing, vocab
248,320, the MTP layer) with --experts experts per layer (64 instead of 512 so fp16 weights fit one
GPU), random weights drawn on the device (deterministic seed, the library's init: embeddings ~N(0, 1),
projections ~N(0, 1/fan_in), so routing spreads; the measured distinct experts per layer are printed
beside the uniform expectation), no vision tower, driven through `Engine` with CUDA graphs and the
Triton kernels in fp16, --prompt-len-token random prompts.

Measured:
  * decode steps without speculation at each --concurrency: wall time around `Engine.step` (host work
    and the greedy argmax included) and the decode graph's GPU time (CUDA events);
  * speculative rounds at each --spec-concurrency: MTP4 (draft, verify and commit graphs' GPU times,
    the whole round's wall time) and DFlash2 (a drafter of the released shape with random weights;
    its rounds run eagerly: drafter and verify wall times); drafts are forced (the MTP head / drafter
    still runs): draft j is the no-speculation run's own token with probability --rate, so acceptance
    is what the run got, and it collapses once a near-tie on random weights lets the verify's token
    differ from the reference (RESULTS.md S1/S1b/S2). So the speedup is also given from the cost model:
    a round emits 1 + a + ... + a^k tokens per request at per-draft acceptance a, against one per plain
    step: speedup(a) = (1 + a + ... + a^k) x plain step / round, for a = 0.6, 0.7, 0.8 (and with step
    and round both at their rooflines: what a memory-bound engine could reach on this stand-in);
  * per kernel family (MoE, GDN, QSA, HC, norms, lm_head/sampling, other), the GPU time of a plain
    decode step's and an MTP4 verify's graph replay (benchmarks/kernel_families.py);
  * the roofline of each step: the bytes it must move (every non-expert weight and lm_head once, the
    experts each layer's rows touched, measured in an eager copy of the step or else uniform, the
    embedding/n-gram rows, each request's GDN state read + write, its QSA K/V and index keys; an MTP
    round adds k MTP steps with lm_head each) over the copy bandwidth measured in the same run.

The last lines printed are markdown tables; the JSON holds every figure, and $OUT/measured_speedup.json
is the start-up warning's table (src/revolta/spec/measured_speedup.json) filled from this run.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from engine_timing import (HostProfile, Req, copy_bandwidth_gbs, decode_loop_ms, drive, gpu_ms, host_split,  # noqa: E402
                           random_prompts, round_split, step_once, sync, time_graphs)
from forced_drafts import force_drafts  # noqa: E402
from kernel_families import FAMILIES, breakdown, count_routing  # noqa: E402
from standin import (DrafterShape, build_model, mtp_draft_bytes, standin_config, step_bytes, weight_tensors,  # noqa: E402
                     write_drafter)

from revolta.cli import add_dflash2_graph_flags  # noqa: E402
from revolta.engine import Engine, EngineConfig  # noqa: E402
from revolta.spec.graphs import SpecGraphs  # noqa: E402

ACCEPTANCES = (0.6, 0.7, 0.8)  # the cost model's per-draft acceptance rates
RECORD_ACCEPTANCE = 0.7  # the figure measured_speedup.json records for the start-up warning
MTP_DRAFTS = 4


class Log:
    """Progress lines with the seconds since start (a single device call must show where its time went)."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.1f} s] {msg}", flush=True)


def expected_tokens(a: float, k: int) -> float:
    """Tokens a round emits per request when each draft is accepted with probability a (given the ones
    before it were): 1 + a + a^2 + ... + a^k."""
    return sum(a ** i for i in range(k + 1))


class SyncTimer:
    """Wraps a callable; `total` sums the wall seconds of its calls, device synced on both sides (for
    eager rounds only: the syncs would break the overlap of a graph-replayed round)."""

    def __init__(self, fn, device):
        self.fn, self.device, self.total = fn, device, 0.0

    def __call__(self, *args, **kwargs):
        sync(self.device)
        t0 = time.perf_counter()
        out = self.fn(*args, **kwargs)
        sync(self.device)
        self.total += time.perf_counter() - t0
        return out


class LastCall:
    """Replaces obj.<name> with a wrapper that remembers the arguments (and result) of the last call
    that `keep(args)` accepts."""

    def __init__(self, obj, name: str, keep=lambda args: True):
        self.args = self.result = None
        fn = getattr(obj, name)

        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            if keep(args):
                self.args, self.result = args, out
            return out

        setattr(obj, name, call)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def engine_config(args, spec: dict, capture: tuple[int, ...]) -> EngineConfig:
    largest = max(args.concurrency)
    return EngineConfig(max_model_len=args.max_model_len, max_num_seqs=largest,
                        max_num_batched_tokens=max(2048, largest * args.prompt_len), kv_cache_gib=args.kv_cache_gib,
                        kernels="triton" if args.cuda else "torch", enable_prefix_caching=False,
                        speculative_config=spec, cudagraph_capture_sizes=capture,
                        dflash2_graph_rounds=args.dflash2_graph_rounds, dflash2_draft_graph=args.dflash2_draft_graph)


def eager_round_graphs(engine, sizes: list[int]) -> None:
    """On the CPU: the MTP round graphs' code run eagerly on their static buffers (`SpecGraphs.capture(
    graphs=False)`, as the CPU tests do), so a smoke run takes the path of a GPU run's graph rounds."""
    k = engine.spec.num_speculative_tokens
    width = -(-(engine.config.max_model_len + k) // engine.plan.layout.block_size)
    engine.executor.spec_graphs = SpecGraphs(engine.runner, list(sizes), k, engine.spec.spec_state_replay, width)
    engine.spec_graphs.capture(graphs=False)


def graphs_size(graphs, b: int) -> int:
    """The captured batch size a step of b requests replays (DecodeGraphs.run's choice)."""
    return next(size for size in graphs.batch_sizes if size >= b)


def measured_routing(runner, forward, model) -> list[int] | None:
    """Distinct experts each target layer touched in `forward()` (an eager copy of a step), or None (then
    the roofline assumes uniform routing) when the routing hook did not see every layer."""
    with count_routing(runner) as counts:
        forward()
    layers = model.cfg.text.num_hidden_layers
    return counts[:layers] if len(counts) >= layers else None


def kv_bytes(engine) -> int:
    return {"fp8_e4m3": 1, "int8": 1, "fp32": 4}.get(engine.storage.layout.kv_cache_dtype, 2)


def release() -> None:
    """Free the last stage's engine (cache, graphs, workspaces: reference cycles) before the next one."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- plain decoding ---------------------------------------------------------------------------------


def plain_stage(model, args, bw_gbs: float, log: Log, out: dict) -> dict:
    """Decode steps at every concurrency; returns each request's tokens (the forced drafts' reference)."""
    engine = Engine(model, engine_config(args, {"method": None}, tuple(args.concurrency) if args.cuda else None))
    log(f"plain engine ready (decode graphs for {args.concurrency if engine.graphs else 'none: eager'})")
    parts = time_graphs(engine)
    graphs = engine.graphs
    batch = {}  # the concurrency running: the step breakdown and routing copy a decode step of all C requests
    last = LastCall(graphs if graphs is not None else engine.runner, "run" if graphs is not None else "execute",
                    keep=lambda a: len(a[0]) == batch["C"] and all(len(s.token_ids) == 1 for s in a[0]))
    refs = {}
    tokens = 1 + args.warmup + args.steps
    for C in args.concurrency:
        batch["C"], last.args = C, None
        reqs = [Req(f"c{C}r{i}", p, tokens, device=model.device) for i, p in enumerate(args.prompts[:C])]
        n0 = len(parts.get("decode", []))
        steps = [r for r in drive(engine, reqs) if r.decoding][args.warmup:]
        refs.update({r.request_id: (len(r.prompt_token_ids), r.token_ids) for r in reqs})
        wall = median([s.wall_s * 1e3 for s in steps])
        row = {"concurrency": C, "step_ms": wall, "tok_s": C / wall * 1e3, "steps": len(steps),
               "graph_steps": sum(s.graphed for s in steps)}
        row.update(gpu_ms({"graph": parts.get("decode", [])[n0:]}, skip=args.warmup + 1))
        row.update(host_split([s for s in steps if s.graphed], parts.get("decode", [])[n0:]))
        seqs = last.args[0] if last.args else None
        distinct = None if seqs is None else measured_routing(engine.runner, lambda: engine.runner.execute(seqs),
                                                              model)
        context = args.prompt_len + 1 + args.warmup + args.steps // 2
        measured = step_bytes(model, C, context, kv_bytes(engine), 1, distinct)
        uniform = step_bytes(model, C, context, kv_bytes(engine), 1)
        row.update(bytes=measured, uniform_distinct=uniform["distinct_experts_per_layer"],
                   measured_distinct=measured["distinct_experts_per_layer"], min_distinct=min(distinct or [0]),
                   roofline_ms=measured["total"] / bw_gbs / 1e6, uniform_roofline_ms=uniform["total"] / bw_gbs / 1e6)
        row["roofline_frac"] = row["roofline_ms"] / wall
        if "graph_gpu_ms" in row:
            row["roofline_frac_gpu"] = row["roofline_ms"] / row["graph_gpu_ms"]
        log(f"plain C{C}: step {wall:.2f} ms wall ({row.get('graph_gpu_ms', float('nan')):.2f} ms graph GPU), "
            f"{C / wall * 1e3:.1f} tok/s, {row['measured_distinct']:.1f} distinct experts/layer (uniform "
            f"{row['uniform_distinct']:.1f}), {row['roofline_frac']:.0%} of roofline")
        if "host_before_ms" in row:  # the step's wall time outside its graph's GPU time (issue 19: C8's lever)
            log(f"  step = host before the replay {row['host_before_ms']:.2f} ms + replay (GPU) "
                f"{row['replay_gpu_ms']:.2f} ms + after it {row['after_replay_ms']:.2f} ms (medians)")
        if row["measured_distinct"] < 0.5 * row["uniform_distinct"]:
            log(f"  routing is concentrated: {row['measured_distinct']:.1f} distinct experts per layer against "
                f"{row['uniform_distinct']:.1f} uniform; the roofline uses the measured ones")
        if args.async_ab and C in args.profile_concurrency:
            row.update(async_ab(engine, model, args, C, tokens, log, row["roofline_ms"]))
        out["decode"].append(row)
        if C in args.profile_concurrency and seqs is not None:
            replay = None
            if graphs is not None:  # the graphs share one input buffer: put this step back in it first
                graphs.run(seqs)
                replay = graphs.graphs[graphs_size(graphs, C)].graph.replay
            bd = breakdown(model, lambda: engine.runner.execute(seqs), replay)
            out["breakdown"].append({"what": "plain step", "concurrency": C, **bd})
            log(f"  breakdown ({bd['source']}, {bd['items']} items, {bd['matched']:.0%} matched): "
                + ", ".join(f"{f} {bd['share'][f]:.0%}" for f in FAMILIES))
        out.save()
    return refs


def async_ab(engine, model, args, C: int, tokens: int, log: Log, roofline_ms: float) -> dict:
    """The same decode (C requests, `tokens` each) timed as a loop without syncs between steps, with
    async_scheduling off and on, on this engine and its graphs (engine_timing.decode_loop_ms)."""
    ms = {}
    for on in (False, True):
        engine.config = replace(engine.config, async_scheduling=on)  # the same engine and graphs: an A/B
        reqs = [Req(f"async{int(on)}c{C}r{i}", p, tokens, device=model.device) for i, p in enumerate(args.prompts[:C])]
        ms[on], steps = decode_loop_ms(engine, reqs, warmup=1 + args.warmup)
    engine.config = replace(engine.config, async_scheduling=False)
    row = {"loop_step_ms_sync": ms[False], "loop_step_ms_async": ms[True], "async_speedup": ms[False] / ms[True],
           "roofline_frac_loop_sync": roofline_ms / ms[False], "roofline_frac_loop_async": roofline_ms / ms[True],
           "async_chained_steps": engine.num_chained_steps}
    log(f"  decode loop of {steps} steps: synchronous {ms[False]:.2f} ms a step ({row['roofline_frac_loop_sync']:.0%} "
        f"of roofline), async_scheduling {ms[True]:.2f} ms ({row['roofline_frac_loop_async']:.0%}): "
        f"{row['async_speedup']:.3f}x")
    return row


# ---- speculative rounds ---------------------------------------------------------------------------


def spec_stage(model, method: str, args, refs: dict, bw_gbs: float, log: Log, out: dict) -> None:
    spec = {"method": method, "draft_policy": "always"}  # every step a round: rounds are what is timed
    if args.state != "default":
        spec["spec_state_replay"] = args.state == "replay"
    capture = tuple(args.spec_concurrency) if args.cuda else None
    drafter_bytes = 0
    if method == "mtp":
        spec["num_speculative_tokens"] = MTP_DRAFTS
        engine = Engine(model, engine_config(args, spec, capture))
    else:
        shape = DrafterShape() if args.widths == "real" else DrafterShape.tiny()
        with tempfile.TemporaryDirectory() as tmp:  # the engine loads the drafter at start-up
            spec["model"] = write_drafter(model.cfg, Path(tmp) / "drafter", device=str(model.device),
                                          dtype=model.dtype, shape=shape)
            log(f"{method}: drafter of {shape} written")
            engine = Engine(model, engine_config(args, spec, capture))
        drafter_bytes = sum(p.numel() * p.element_size() for p in engine.drafter.drafter.parameters())
    if method == "mtp" and not args.cuda:
        eager_round_graphs(engine, args.spec_concurrency)
    sg = engine.spec_graphs
    log(f"{method} engine ready ({'round graphs for ' + str(args.spec_concurrency) if sg else 'eager rounds'})")
    parts = time_graphs(engine)
    timers = {}
    if sg is None:  # eager rounds: time the drafter and the verify forward
        timers = {"draft": SyncTimer(engine.drafter.propose, model.device),
                  "verify": SyncTimer(engine.runner.verify, model.device)}
        engine.drafter.propose, engine.runner.verify = timers["draft"], timers["verify"]
    batch = {}  # the concurrency running: the verify breakdown and routing copy a round of all C requests
    full = lambda a: len(a[0]) == batch["C"]  # noqa: E731
    last = LastCall(engine.runner if sg is None else sg, "verify", keep=full)
    rng = random.Random(args.seed)
    vocab = model.cfg.text.vocab_size
    force_drafts(engine, refs, lambda rid, d: [t if rng.random() < args.rate else (t + 1) % vocab for t in d])
    tokens = 1 + args.warmup + args.steps
    for C in args.spec_concurrency:
        batch["C"], last.args = C, None
        reqs = [Req(f"c{C}r{i}", p, tokens, device=model.device) for i, p in enumerate(args.prompts[:C])]
        n0 = {name: len(ev) for name, ev in parts.items()}
        stats0 = (engine.spec_stats.num_draft_tokens, engine.spec_stats.num_accepted_tokens)
        before = {name: t.total for name, t in timers.items()}
        records, per_step = [], []
        for r in reqs:
            engine.add_request(r)
        profile = HostProfile() if args.host_profile and C in args.profile_concurrency else None

        def steady(r, C=C):  # a steady-state round of the whole batch (graph-served where there are graphs)
            return r.decoding and r.active == C and (r.graphed or sg is None)

        while engine.has_unfinished():  # drive(), reading the timers between steps
            if profile is not None and len(records) > args.warmup:  # after the warm-up steps
                records.append(profile.run(lambda: step_once(engine, reqs), keep=steady))
            else:
                records.append(step_once(engine, reqs))
            per_step.append({name: t.total - before[name] for name, t in timers.items()})
            before = {name: t.total for name, t in timers.items()}
        keep = [i for i, r in enumerate(records) if steady(r)][args.warmup:]
        rounds = [records[i] for i in keep]
        wall = median([r.wall_s * 1e3 for r in rounds])
        drafted = engine.spec_stats.num_draft_tokens - stats0[0]
        accepted = engine.spec_stats.num_accepted_tokens - stats0[1]
        k = engine.spec.drafts_at(C)  # what a full round verifies (the last rounds may draft fewer)
        row = {"method": method, "concurrency": C, "drafts": k, "round_ms": wall, "rounds": len(rounds),
               "graph_rounds": sum(r.graphed for r in rounds), "acceptance": accepted / drafted if drafted else 0.0,
               "tokens_per_round": statistics.mean(r.emitted / r.active for r in rounds) if rounds else float("nan")}
        for name in timers:
            row[f"{name}_ms"] = median([per_step[i][name] * 1e3 for i in keep])
        if parts:
            row.update(gpu_ms({name: ev[n0.get(name, 0):] for name, ev in parts.items()}, skip=args.warmup + 1))
        plain = next(r for r in out["decode"] if r["concurrency"] == C)
        row["round_over_step"] = wall / plain["step_ms"]
        if "verify_gpu_ms" in row and "graph_gpu_ms" in plain:
            row["verify_over_step_gpu"] = row["verify_gpu_ms"] / plain["graph_gpu_ms"]
        row["measured_speedup"] = row["tokens_per_round"] * plain["step_ms"] / wall
        row["model_speedup"] = {str(a): expected_tokens(a, k) * plain["step_ms"] / wall for a in ACCEPTANCES}
        # the roofline: the verify of 1 + k rows per request (routing measured in an eager copy) + drafting
        steps, slot_rows = verify_inputs(engine, last, sg)
        routing = None if steps is None else measured_routing(engine.runner, lambda: engine.runner.verify(steps, slot_rows),
                                                              model)
        context = args.prompt_len + 1 + args.warmup + args.steps // 2
        vb = step_bytes(model, C, context, kv_bytes(engine), 1 + k, routing)
        draft_b = mtp_draft_bytes(model, C, k, context, kv_bytes(engine)) if method == "mtp" else drafter_bytes
        row.update(verify_bytes=vb, draft_bytes=draft_b, verify_distinct=vb["distinct_experts_per_layer"],
                   verify_roofline_ms=vb["total"] / bw_gbs / 1e6,
                   round_roofline_ms=(vb["total"] + draft_b) / bw_gbs / 1e6)
        row["round_roofline_frac"] = row["round_roofline_ms"] / wall
        # the same cost model with step and round both at their rooflines: what a memory-bound engine could reach
        row["roofline_speedup"] = {str(a): expected_tokens(a, k) * plain["roofline_ms"] / row["round_roofline_ms"]
                                   for a in ACCEPTANCES}
        graph_ms = [row[f"{p}_gpu_ms"] for p in ("draft", "verify", "commit") if f"{p}_gpu_ms" in row]
        if len(graph_ms) == 3:
            row["outside_graphs_ms"] = wall - sum(graph_ms)  # host work and gaps the GPU waits on
        if parts:  # where the round's host time sits between the replays' calls (issue 19: a round's host part)
            row["round_split"] = round_split([r for r in rounds if r.graphed],
                                             {name: ev[n0.get(name, 0):] for name, ev in parts.items()})
        if "verify_gpu_ms" in row:
            row["verify_roofline_frac_gpu"] = row["verify_roofline_ms"] / row["verify_gpu_ms"]
        log(f"{method} C{C}: round {wall:.2f} ms ({row['round_over_step']:.2f}x a plain step; "
            + ", ".join(f"{p} {row[p + '_gpu_ms' if sg else p + '_ms']:.2f} ms" for p in
                        (("draft", "verify", "commit") if sg else ("draft", "verify")) if (p + ('_gpu_ms' if sg else '_ms')) in row)
            + f"), acceptance {row['acceptance']:.2f}, {row['tokens_per_round']:.2f} tokens/round, measured "
            f"{row['measured_speedup']:.2f}x, at a=0.7 {row['model_speedup']['0.7']:.2f}x")
        if not rounds:  # every request finished inside the warm-up: the nan figures above are not a failure
            log(f"  C{C}: no full-batch round after the {args.warmup} warm-up rounds ({len(records)} rounds in all, "
                f"{tokens} tokens a request): raise --steps to time {method} at C{C}")
        if row.get("round_split"):
            log("  round on the host = " + " + ".join(f"{k[5:-3].replace('_to_', ' -> ')} {v:.2f} ms"
                                                     for k, v in row["round_split"].items()) + " (medians)")
        if profile is not None:  # the host breakdown (these rounds ran under the profiler)
            row["host_profile"] = {"cumulative": profile.top(), "own": profile.top(15, own=True)}
            for what, entries in row["host_profile"].items():
                log(f"  host profile over {profile.calls} rounds, by {what} time (cProfile; ms a round, cumulative / "
                    "own; calls a round):")
                for e in entries:
                    log(f"    {e['cum_ms']:8.3f} {e['own_ms']:8.3f} {e['calls']:7.1f}  {e['function']}")
        out["spec"].append(row)
        if method == "mtp" and C in args.profile_concurrency and steps is not None:
            B = graphs_size(sg, C) if sg is not None else None
            replay = None
            if sg is not None:  # the sizes share one input buffer: put this round's verify back in it first
                sg.verify(*last.args)
                replay = sg.graphs[B].verify
            bd = breakdown(model, lambda: engine.runner.verify(steps, slot_rows), replay)
            out["breakdown"].append({"what": f"MTP{k} verify", "concurrency": C, **bd})
            log(f"  verify breakdown ({bd['source']}, {bd['items']} items, {bd['matched']:.0%} matched): "
                + ", ".join(f"{f} {bd['share'][f]:.0%}" for f in FAMILIES))
        out.save()


def verify_inputs(engine, last: LastCall, graphs):
    """The last verify of the run as eager `runner.verify` arguments, every request padded to 1 + k
    rows like the graph (None when no verify ran)."""
    if last.args is None:
        return None, None
    if graphs is not None:  # SpecGraphs.verify(steps, drafts, num_drafts, slot_rows) -> (.., .., host drafts)
        steps, _, _, slot_rows = last.args
        drafts = last.result[2]
        k = graphs.k
    else:  # runner.verify(vsteps, slot_rows): the drafts are already in the steps
        vsteps, slot_rows = last.args
        steps = [replace(s, token_ids=s.token_ids[:1]) for s in vsteps]
        drafts = [s.token_ids[1:] for s in vsteps]
        k = max(len(d) for d in drafts)
    padded = [replace(s, token_ids=s.token_ids + d + [0] * (k - len(d))) for s, d in zip(steps, drafts)]
    bs = engine.runner.block_size
    padded = [replace(s, block_ids=s.block_ids + [0] * (-(-(s.num_computed + 1 + k) // bs) - len(s.block_ids)))
              for s in padded]
    return padded, slot_rows


# ---- results --------------------------------------------------------------------------------------


class Results(dict):
    """The JSON rows, saved after every stage (a crash later keeps what ran)."""

    def __init__(self, path: Path, **kw):
        super().__init__(decode=[], spec=[], breakdown=[], **kw)
        self.path = path

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self, indent=1, default=str))


def measured_speedup_table(out: dict, gpu: str, commit: str) -> dict:
    """The start-up warning's table (src/revolta/spec/measured_speedup.json) from this run's rows; `source` names
    the model the run built (the full-size AWQ model or the 16-bit stand-in) and its RESULTS.md section."""
    m = out["model"]
    what = ("F3, the full-size model (AWQ int4, 512 experts)" if m["experts"] == 512 and m["weights"] == "awq"
            else f"F1, the full-depth stand-in ({m['layers']} layers, {m['experts']} experts, {m['weights']})")
    rows = [{"method": r["method"], "num_speculative_tokens": r["drafts"], "concurrency": r["concurrency"],
             "speedup": round(r["model_speedup"][str(RECORD_ACCEPTANCE)], 3),
             "basis": f"cost model at per-draft acceptance {RECORD_ACCEPTANCE} over the measured round and step "
                      "times",
             "device": gpu, "source": f"benchmarks/RESULTS.md {what}, bench_fulldepth.py",
             "commit": commit} for r in out["spec"] if math.isfinite(r["model_speedup"][str(RECORD_ACCEPTANCE)])]
    return {"rows": rows}


def tables(out: dict) -> str:
    lines = ["| C | step ms (wall) | graph GPU ms | tok/s | distinct experts / layer (measured, uniform) | "
             "step GB | roofline ms | % of roofline (wall) | % of roofline (graph GPU) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in out["decode"]:
        lines.append(f"| {r['concurrency']} | {r['step_ms']:.2f} | {r.get('graph_gpu_ms', float('nan')):.2f} | "
                     f"{r['tok_s']:.1f} | {r['measured_distinct']:.1f}, {r['uniform_distinct']:.1f} | "
                     f"{r['bytes']['total'] / 1e9:.2f} | {r['roofline_ms']:.2f} | {r['roofline_frac']:.0%} | "
                     f"{r.get('roofline_frac_gpu', float('nan')):.0%} |")
    ab = [r for r in out["decode"] if "loop_step_ms_async" in r]
    if ab:
        lines += ["", "| C | decode loop ms a step (synchronous) | async_scheduling | speedup | % of roofline (sync) | "
                  "% of roofline (async) |", "| --- " * 6 + "|"]
        lines += [f"| {r['concurrency']} | {r['loop_step_ms_sync']:.2f} | {r['loop_step_ms_async']:.2f} | "
                  f"{r['async_speedup']:.3f}x | {r['roofline_frac_loop_sync']:.0%} | {r['roofline_frac_loop_async']:.0%} |"
                  for r in ab]
    lines += ["", "| method | C | drafts | draft ms | verify ms | commit ms | verify / step (GPU) | round ms (wall) | "
              "round / step | acceptance | tokens / round | measured speedup | speedup a=0.6 | a=0.7 | a=0.8 | "
              "round GB | % of roofline | a=0.7 at both rooflines |", "| --- " * 18 + "|"]
    for r in out["spec"]:
        gpu = "verify_gpu_ms" in r
        cell = lambda p: f"{r[p + ('_gpu_ms' if gpu else '_ms')]:.2f}" if (p + ('_gpu_ms' if gpu else '_ms')) in r else ""
        gb = (r["verify_bytes"]["total"] + r["draft_bytes"]) / 1e9
        lines.append(f"| {r['method']} | {r['concurrency']} | {r['drafts']} | {cell('draft')} | {cell('verify')} | "
                     f"{cell('commit')} | {r.get('verify_over_step_gpu', float('nan')):.2f}x | {r['round_ms']:.2f} | "
                     f"{r['round_over_step']:.2f}x | {r['acceptance']:.2f} | "
                     f"{r['tokens_per_round']:.2f} | {r['measured_speedup']:.2f}x | "
                     + " | ".join(f"{r['model_speedup'][str(a)]:.2f}x" for a in ACCEPTANCES)
                     + f" | {gb:.2f} | {r['round_roofline_frac']:.0%} | {r['roofline_speedup']['0.7']:.2f}x |")
    lines += ["", "| graph | C | " + " | ".join(FAMILIES) + " | total ms | source |", "| --- " * (len(FAMILIES) + 4) + "|"]
    for b in out["breakdown"]:
        lines.append(f"| {b['what']} | {b['concurrency']} | "
                     + " | ".join(f"{b['family_ms'][f]:.2f} ({b['share'][f]:.0%})" for f in FAMILIES)
                     + f" | {b['total_ms']:.2f} | {b['source']} |")
        if "eager_ms" in b and b["source"] != "eager":
            # the replay's durations overlap where a launch waits inside (programmatic dependent launch: the HC
            # read's mix / up kernels start before the grid they wait for ends), so its sums exceed the graph's
            # GPU time; the eager forward's kernels, run one after another, do not
            eager, eager_total = b["eager_ms"], sum(b["eager_ms"].values())
            lines.append(f"| {b['what']} (eager) | {b['concurrency']} | "
                         + " | ".join(f"{eager[f]:.2f} ({eager[f] / eager_total:.0%})" for f in FAMILIES)
                         + f" | {eager_total:.2f} | eager forward |")
    return "\n".join(lines)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=64, help="experts per layer (the real model: 512)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--widths", choices=("real", "tiny"), default=None,
                    help="default: real on CUDA, tiny (the embedded default's widths) on CPU")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--spec-concurrency", default="1,8")
    ap.add_argument("--profile-concurrency", default="1,8", help="where to break the step and verify down")
    ap.add_argument("--methods", default="mtp,dflash2")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps (and the tokens spec runs make)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed decode steps / rounds first")
    ap.add_argument("--rate", type=float, default=0.7, help="forced drafts: probability a draft is the reference token")
    ap.add_argument("--state", choices=("default", "per-draft", "replay"), default="default",
                    help="spec_state_replay (default: each method's, per-draft slots for MTP, replay for DFlash2)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="default: the prompt + tokens rounded up to 256 (graph block tables are this wide)")
    ap.add_argument("--kv-cache-gib", type=float, default=None, help="default: 16 on CUDA, 0.05 on CPU")
    ap.add_argument("--weights", choices=("16bit", "awq"), default="16bit",
                    help="awq: random AWQ int4 weights (group 32) drawn on the device")
    ap.add_argument("--ple", choices=("device", "host"), default="device",
                    help="host: the n-gram table as random FP8 rows in pinned host memory")
    ap.add_argument("--real-ngram-table", action="store_true", help="the real 47.7 GiB n-gram table size")
    ap.add_argument("--fullsize", action="store_true",
                    help="the real model: --experts 512 --weights awq --ple host --real-ngram-table, 48 layers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-packed-merge", action="store_true",
                    help="run each packed (quantized) input projection as its own GEMV, as before the packed merge "
                         "(layers/merged_linear.merge_quant_linears): the A/B of that change")
    ap.add_argument("--quick", action="store_true", help="C1 and C8 only, 12 timed steps")
    ap.add_argument("--no-async-ab", dest="async_ab", action="store_false",
                    help="skip the decode loop with async_scheduling off / on at the profile concurrencies")
    ap.add_argument("--host-profile", action="store_true",
                    help="cProfile the timed rounds at the --profile-concurrency levels (their times then include "
                         "the profiler's overhead: a run for the host's breakdown, not for the round times)")
    ap.add_argument("--json", default=None, help="default: $OUT/bench_fulldepth.json")
    ap.add_argument("--strict", action="store_true", help="raise when a speculative stage fails (default: log it)")
    add_dflash2_graph_flags(ap)  # EngineConfig.dflash2_graph_rounds / dflash2_draft_graph
    args = ap.parse_args(argv)
    if args.layers < 4:
        ap.error(f"--layers {args.layers}: the stand-in repeats GDN GDN GDN QSA, so it needs at least 4 layers "
                 "to hold a full-attention layer")
    if args.quick:
        args.concurrency, args.steps = "1,8", min(args.steps, 12)
    if args.fullsize:
        args.layers, args.experts, args.weights, args.ple, args.real_ngram_table = 48, 512, "awq", "host", True
    args.cuda = args.device.startswith("cuda")
    args.widths = args.widths or ("real" if args.cuda else "tiny")
    args.kv_cache_gib = args.kv_cache_gib if args.kv_cache_gib is not None else (16.0 if args.cuda else 0.05)
    for name in ("concurrency", "spec_concurrency", "profile_concurrency"):
        setattr(args, name, [int(c) for c in getattr(args, name).split(",") if c])
    args.spec_concurrency = [c for c in args.spec_concurrency if c in args.concurrency]
    args.methods = [m for m in args.methods.split(",") if m]
    tokens = 1 + args.warmup + args.steps
    args.max_model_len = args.max_model_len or -(-(args.prompt_len + tokens + 64) // 256) * 256
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    log = Log()
    json_path = Path(args.json) if args.json else Path(os.environ.get("OUT", ".")) / "bench_fulldepth.json"
    dtype = torch.float16 if args.cuda else torch.float32
    gpu = torch.cuda.get_device_name() if args.cuda else "cpu"
    commit = os.popen("git rev-parse --short HEAD 2>/dev/null").read().strip()
    out = Results(json_path, device=gpu, commit=commit, torch=torch.__version__,
                  args={k: v for k, v in vars(args).items() if k != "prompts"})
    log(f"{gpu}, torch {torch.__version__}, commit {commit or '?'}")
    bw = copy_bandwidth_gbs(args.device, gib=1.0 if args.cuda else 1 / 64)
    out["copy_GBps"] = bw
    log(f"copy bandwidth {bw:,.0f} GB/s")
    if args.no_packed_merge:  # the layers imported the function by name: replace it where they call it
        import revolta.layers.gdn
        import revolta.layers.qsa

        for mod in (revolta.layers.gdn, revolta.layers.qsa):
            mod.merge_quant_linears = lambda parts, merged=None: None
    cfg = standin_config(args.layers, args.experts, with_mtp=True, widths=args.widths,
                         real_ngram_table=args.real_ngram_table)
    ple_table = "host" if args.ple == "host" else None
    if args.weights == "awq":
        from revolta.quantized import random_quantized_model

        model = random_quantized_model(cfg, args.device, dtype, seed=args.seed, with_mtp=True, ple_table=ple_table)
    else:
        model = build_model(cfg, args.device, dtype, seed=args.seed, with_mtp=True)
        if ple_table is not None:
            from revolta.ple.random_table import attach_random_tables

            attach_random_tables(model, ple_table, args.device, seed=args.seed)
    from revolta.ple.load import ple_memory

    weights = sum(t.numel() * t.element_size() for _, t in weight_tensors(model))
    ple = ple_memory(model)
    out["model"] = {"layers": args.layers, "experts": args.experts, "widths": args.widths, "weights": args.weights,
                    "weight_GiB": weights / 2**30, "ple": ple.describe()}
    log(f"model built: {args.layers} layers, {args.experts} experts, {args.weights} weights "
        f"({str(dtype).removeprefix('torch.')} activations), {weights / 2**30:.1f} GiB on the device; "
        f"PLE table: {ple.describe()}")
    args.prompts = random_prompts(max(args.concurrency), args.prompt_len, min(cfg.text.vocab_size, 248_044), args.seed)
    refs = plain_stage(model, args, bw, log, out)
    release()
    for method in args.methods:
        try:  # a failing method still leaves the other rows and the tables
            spec_stage(model, method, args, refs, bw, log, out)
        except Exception as e:  # noqa: BLE001
            log(f"{method} stage failed: {type(e).__name__}: {e}")
            out.setdefault("errors", []).append(f"{method}: {type(e).__name__}: {e}")
            if args.strict:
                raise
        release()
    out["measured_speedup"] = measured_speedup_table(out, gpu, commit)
    out.save()
    (json_path.parent / "measured_speedup.json").write_text(json.dumps(out["measured_speedup"], indent=1) + "\n")
    log(f"done; JSON in {json_path}")
    print("\n" + tables(out), flush=True)
    for error in out.get("errors", []):
        print(f"\nFAILED {error}", flush=True)
    return out


if __name__ == "__main__":
    main()

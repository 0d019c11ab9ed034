"""The engine benchmarks run end to end on CPU (tiny widths, torch path), so they cannot rot between
GPU runs: every stage of bench_fulldepth.py, the kernel-family attribution and the measured-speedup
table the start-up warning reads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def fulldepth(tmp_path_factory):
    sys.path.insert(0, str(BENCHMARKS))
    import bench_fulldepth

    path = tmp_path_factory.mktemp("fulldepth") / "bench_fulldepth.json"
    out = bench_fulldepth.main(["--device", "cpu", "--layers", "4", "--experts", "8", "--prompt-len", "8",
                                "--steps", "5", "--warmup", "0", "--concurrency", "2", "--spec-concurrency", "2",
                                "--profile-concurrency", "2", "--host-profile", "--strict", "--json", str(path)])
    return out, path


def test_fulldepth_smoke_rows(fulldepth):
    out, path = fulldepth
    saved = json.loads(path.read_text())
    assert [r["concurrency"] for r in saved["decode"]] == [2]
    assert {(r["method"], r["concurrency"]) for r in saved["spec"]} == {("mtp", 2), ("dflash2", 2)}
    mtp, dflash2 = saved["spec"]
    # on CPU the MTP rounds run the round graphs' code eagerly on their buffers: the GPU run's path
    assert mtp["graph_rounds"] == mtp["rounds"] > 0 and mtp["verify_gpu_ms"] > 0 and mtp["draft_gpu_ms"] > 0
    assert set(mtp["round_split"]) == {"host_start_to_draft_ms", "host_draft_to_verify_ms",
                                       "host_verify_to_commit_ms", "host_commit_to_end_ms"}
    # each a median of intervals inside one round (their sum is no bound: medians of the parts come from different
    # rounds, and a loaded CI machine's rounds vary: 4.8 s against a 2.7 s median round once)
    assert all(0 <= v <= mtp["round_ms"] * 1.5 for v in mtp["round_split"].values()), (mtp["round_split"], mtp["round_ms"])
    assert dflash2["verify_ms"] > 0 and dflash2["draft_ms"] > 0  # eager rounds, as on the GPU
    functions = [e["function"] for e in mtp["host_profile"]["cumulative"]]
    assert any(f.startswith("step (engine.py") for f in functions), functions  # the profiled rounds' engine steps
    for r in saved["spec"]:
        assert r["round_ms"] > 0 and set(r["model_speedup"]) == {"0.6", "0.7", "0.8"}
        assert r["verify_bytes"]["total"] > 0 and r["draft_bytes"] > 0
    plain = saved["decode"][0]
    assert 0 < plain["measured_distinct"] <= 8 and plain["roofline_ms"] > 0
    # the decode loop A/B: both timed, and the async run planned steps on unread tokens
    assert plain["loop_step_ms_sync"] > 0 and plain["loop_step_ms_async"] > 0 and plain["async_chained_steps"] > 0
    step, verify = saved["breakdown"]
    assert (step["what"], step["source"]) == ("plain step", "eager")
    assert (verify["what"], verify["source"]) == ("MTP4 verify", "graph replay") and verify["matched"] > 0.9
    for b in saved["breakdown"]:
        assert b["total_ms"] > 0 and b["family_ms"]["MoE"] > 0 and b["family_ms"]["GDN"] > 0


def test_fulldepth_writes_the_warning_table(fulldepth):
    from revolta.spec.measured import load_measured, slower_warning

    out, path = fulldepth
    rows = load_measured(path.parent / "measured_speedup.json")
    assert {r.method for r in rows} == {"mtp", "dflash2"}
    for method in ("mtp", "dflash2"):
        mine = [r for r in rows if r.method == method]
        warning = slower_warning(method, mine)
        assert (warning is None) == all(r.speedup >= 1 for r in mine)


def _span(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 1, "pid": 1, "args": args}


def test_graph_replay_kernels_take_the_eager_scopes():
    """A replay's kernels (launched by one cudaGraphLaunch) take the family of the eager kernel they
    match in order; GEMMs get their scope, norm kernels count as norms, a kernel only the graph has
    falls back to its name, and one traced to no launch inherits the launch order's scope."""
    sys.path.insert(0, str(BENCHMARKS))
    from kernel_families import attribute, summarise

    events = [
        _span("user_annotation", "phase:eager", 0, 100, **{"External id": 1}),
        _span("user_annotation", "family:MoE", 10, 20, **{"External id": 2}),
        _span("cuda_driver", "cuLaunchKernelEx", 12, 1, correlation=101),
        _span("cuda_runtime", "cudaLaunchKernel", 15, 1, correlation=102),
        _span("user_annotation", "family:GDN", 40, 20, **{"External id": 3}),
        _span("cuda_runtime", "cudaLaunchKernel", 41, 1, correlation=103),
        _span("kernel", "_moe_gate_up_kernel", 200, 5, correlation=101),
        _span("kernel", "sm90_xmma_gemm_f16", 206, 3, correlation=102),
        _span("kernel", "sm90_xmma_gemm_f16", 210, 4, correlation=103),
        _span("kernel", "_gated_rms_norm_kernel", 215, 2, correlation=999, **{"External id": 3}),
        _span("kernel", "elementwise_kernel", 218, 1, correlation=998),
        _span("user_annotation", "phase:replay0", 300, 50, **{"External id": 4}),
        _span("cuda_runtime", "cudaGraphLaunch", 301, 2, correlation=110),
    ] + [_span("kernel", name, ts, dur, correlation=110) for name, ts, dur in (
        ("_moe_gate_up_kernel", 400, 4), ("sm90_xmma_gemm_f16", 405, 2), ("graph_only_copy", 408, 1),
        ("sm90_xmma_gemm_f16", 410, 3), ("_gated_rms_norm_kernel", 414, 1), ("elementwise_kernel", 416, 5))]
    work = attribute(events)
    assert [(w.name, w.phase, w.family) for w in work if w.phase == "eager"] == [
        ("_moe_gate_up_kernel", "eager", "MoE"), ("sm90_xmma_gemm_f16", "eager", "MoE"),
        ("sm90_xmma_gemm_f16", "eager", "GDN"), ("_gated_rms_norm_kernel", "eager", "norms"),
        ("elementwise_kernel", "eager", "GDN")]  # no launch found: the scope of the kernel launched before
    out = summarise(work, replays=1)
    assert out["source"] == "graph replay" and out["items"] == 6
    ms = {f: round(v * 1e3) for f, v in out["family_ms"].items()}  # µs
    assert ms == {"MoE": 6, "GDN": 8, "QSA": 0, "HC": 0, "norms": 1, "lm_head/sampling": 0, "other": 1}
    assert out["matched"] == pytest.approx(5 / 6)


def test_align_skips_what_one_side_lacks():
    sys.path.insert(0, str(BENCHMARKS))
    from kernel_families import align

    assert align(list("abXcd"), list("abcd")) == [0, 1, None, 2, 3]
    assert align(list("abcd"), list("aYbcd")) == [0, 2, 3, 4]
    assert align(list("aQcd"), list("aRcd")) == [0, 1, 2, 3]  # a different kernel at the same place
    assert align(list("abc"), list("ab")) == [0, 1, None]


def test_fulldepth_awq_weights_and_host_ple_table(tmp_path):
    """The --fullsize path at tiny widths: random AWQ weights, the n-gram table as FP8 rows in host memory, and a
    roofline that counts the packed bytes (measured 0.51x of the same model's fp32 weights at these widths, where
    the unquantized routers, norms and HyperConnections weigh more than at the real ones) and one FP8 byte per
    table value."""
    sys.path.insert(0, str(BENCHMARKS))
    import bench_fulldepth
    from standin import WeightBytes, build_model, standin_config

    out = bench_fulldepth.main(["--device", "cpu", "--layers", "4", "--experts", "8", "--prompt-len", "8",
                                "--steps", "2", "--warmup", "0", "--concurrency", "1", "--methods=",
                                "--profile-concurrency=", "--weights", "awq", "--ple", "host", "--strict",
                                "--json", str(tmp_path / "fd.json")])
    assert out["model"]["weights"] == "awq" and out["model"]["ple"].startswith("host (")
    plain = out["decode"][0]
    assert plain["step_ms"] > 0 and plain["roofline_ms"] > 0
    dense32 = WeightBytes.of(build_model(standin_config(4, 8, with_mtp=True, widths="tiny"), "cpu",
                                         __import__("torch").float32, seed=0, with_mtp=True))
    packed = plain["bytes"]["dense_weights"]
    assert packed < 0.6 * dense32.dense, (packed, dense32.dense)
    cfg = standin_config(4, 8, with_mtp=True, widths="tiny").text
    per_token = plain["bytes"]["table_rows"] - cfg.hidden_size * 4  # fp32 embedding row on CPU
    assert per_token == len(cfg.ple_layer_ids) * cfg.num_ngram_heads * cfg.ngram_head_dim  # FP8: one byte each


def test_host_split_places_each_replay_inside_its_step():
    """bench_fulldepth's split of a graph-served step: host time before the replay was called, the replay's GPU
    time, the rest; a replay outside every step (another stage's) is not counted."""
    sys.path.insert(0, str(BENCHMARKS))
    from engine_timing import StepRecord, host_split

    steps = [StepRecord(0.010, 1, 1, True, True, start_s=100.0), StepRecord(0.012, 1, 1, True, True, start_s=200.0)]
    events = [(100.002, 100.008, 100.002), (200.004, 200.010, 200.004), (300.0, 300.001, 300.0)]
    split = host_split(steps, events)
    assert split == pytest.approx({"host_before_ms": 3.0, "replay_gpu_ms": 6.0, "after_replay_ms": 2.0})
    assert host_split(steps, []) == {}


def test_round_split_places_each_call_inside_its_round():
    """bench_fulldepth's split of a speculative round: host time from the round's start to each replay's call,
    between the calls, and after the last; a round missing a call, and calls outside every round, are skipped."""
    sys.path.insert(0, str(BENCHMARKS))
    from engine_timing import StepRecord, round_split

    rounds = [StepRecord(0.020, 3, 1, True, True, start_s=100.0), StepRecord(0.020, 3, 1, True, True, start_s=200.0),
              StepRecord(0.020, 3, 1, True, True, start_s=300.0)]
    parts = {"draft": [(0, 0, 100.001), (0, 0, 200.001), (0, 0, 300.001)],
             "verify": [(0, 0, 100.004), (0, 0, 200.004), (0, 0, 300.004)],
             "commit": [(0, 0, 100.016), (0, 0, 200.016), (0, 0, 400.0)]}  # round 3's commit is elsewhere
    split = round_split(rounds, parts)
    assert split == pytest.approx({"host_start_to_draft_ms": 1.0, "host_draft_to_verify_ms": 3.0,
                                   "host_verify_to_commit_ms": 12.0, "host_commit_to_end_ms": 4.0})
    no_draft = round_split(rounds[:1], {k: v for k, v in parts.items() if k != "draft"})  # DFlash2: no draft graph
    assert no_draft == pytest.approx({"host_start_to_verify_ms": 4.0, "host_verify_to_commit_ms": 12.0,
                                      "host_commit_to_end_ms": 4.0})


def test_host_profile_counts_only_the_kept_calls():
    """bench_fulldepth --host-profile: a call whose result fails `keep` (a ragged or compiling round) is left out of
    the profile, and the times and call counts are per kept call."""
    sys.path.insert(0, str(BENCHMARKS))
    from engine_timing import HostProfile

    def leaf(n):
        return sum(range(n))

    def work(n):
        return [leaf(1000) for _ in range(n)]

    profile = HostProfile()
    for n in (2, 7, 2):  # the 7-call run is not kept
        profile.run(lambda n=n: work(n), keep=lambda result: len(result) == 2)
    assert profile.calls == 2
    leaf_row = next(e for e in profile.top(50) if e["function"].startswith("leaf (test_benchmarks_smoke.py"))
    assert leaf_row["calls"] == 2.0 and leaf_row["cum_ms"] > 0
    assert HostProfile().top() == []


def test_host_phases_smoke():
    """benchmarks/host_phases.py (RESULTS.md H1) runs and times every phase it names."""
    sys.path.insert(0, str(BENCHMARKS))
    import host_phases

    out = host_phases.main(["--concurrency", "2", "--context", "8", "--steps", "3"])
    assert {"model.forward", "pack_step", "scheduler.schedule", "scheduler.update", "sampling", "step",
            "outside the forward"} <= set(out)
    assert all(mean > 0 and median > 0 for mean, median in out.values())


def test_read_ceiling_reads_every_word():
    """benchmarks/read_ceiling.py's read kernel (the GEMV sweep's same-size peer) ORs every packed word: its per-program
    ORs are checked against numpy inside read_us, over a size that leaves a partial last block."""
    sys.path.insert(0, str(BENCHMARKS))
    import torch
    from bench_quant import bench, packed_awq
    from read_ceiling import READ_BLOCK, read_us, read_words

    fmt, t = packed_awq(256, 64, 32, torch.device("cpu"), torch.Generator().manual_seed(0))
    assert read_words(t).numel() % READ_BLOCK != 0  # the masked tail runs
    read_us([t], bench, small=True)
    t["qweight"][-1, -1] = -1  # bits in the last block's last words: a kernel that skipped them fails the check
    read_us([t], bench, small=True)


def test_sweep_nibble_gemv_small(tmp_path):
    """benchmarks/sweep_nibble_gemv.py --small (interpreter): every config it lists runs, is named and matches the
    fp32 reference; the first is the model's default (gemv_config_for: the tile path off sm80+)."""
    sys.path.insert(0, str(BENCHMARKS))
    import sweep_nibble_gemv

    path = tmp_path / "sweep.json"
    assert sweep_nibble_gemv.main(["--small", "--ms", "1", "--json", str(path)]) == 0
    (row,) = json.loads(path.read_text())
    assert row["default"].startswith("tile") and row["worst_err"] < 2e-2 and len(row["all"]) >= 5


def test_quant_moe_bench_names_an_unknown_variant():
    """bench_quant.py --moe-variants: a name that is not in bench_quant_moe.VARIANTS is refused before any work, with
    the known names in the message (a typo would otherwise time nothing beside the default, silently)."""
    sys.path.insert(0, str(BENCHMARKS))
    import bench_quant_moe

    with pytest.raises(AssertionError, match="unknown MoE variants \\['wc-nope'\\]; known: tile, "):
        bench_quant_moe.run(small=True, only=("wc-nope", "tile"))

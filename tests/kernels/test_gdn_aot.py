"""Ahead-of-time builds of the GDN and conv1d kernels for sm_70 (V100) and sm_90 (H200) at the
real model's shapes and the launch configurations the wrappers use (no GPU needed).

Real shapes: H = 16 q/k heads, HV = 48 value heads, K = V = 128, GDN conv C = 10240 (W = 4),
PLE conv C = 10240 (W = 4, dilation 3). sm_70 builds use fp16 activations (no bf16 on V100),
sm_90 builds bf16.

Pointers and strides are compiled as 16-divisible, as the launcher specialises them for real
tensors, so loads are vectorised and loops software-pipelined as at run time (shared memory of
the pipelined state walk is what decides how many of its programs share an SM).

Spill budgets on sm_70 (bytes of spill stores per thread, from ptxas -v): the memory-bound
kernels (conv, recurrent decode/verify, commit) must not spill at all; the chunk kernels run
tl.dot on FMA units on Volta (no tensor cores) and may spill up to SPILL_BUDGET_CHUNK[arch].
"""

import dataclasses
import multiprocessing
import os

import pytest

from revolta.kernels import aot
from revolta.kernels import conv1d as conv
from revolta.kernels.aot import compile_report
from revolta.kernels.gdn import chunk, chunk_index, chunk_intra, chunk_out, chunk_state, recurrent
from revolta.kernels.gdn.chunk_variants import chunk_variants

H, HV, K, V, C_GDN, C_PLE = 16, 48, 128, 128, 10240, 10240
# sm_70: tl.dot is FMA-only (Triton has no Volta MMA) and spills; the V100 fast path for chunked
# prefill is the torch.bmm variant (follow-up). sm_90: wgmma tiles, small spills allowed.
SPILL_BUDGET_CHUNK = {70: 8192, 90: 1024}

ACT = {70: "*fp16", 90: "*bf16"}


def _sig(names, types, act):
    """types: one letter per arg: a = activation pointer, f = fp32 pointer, i = int32 pointer,
    b = bool pointer (as i8), n = int32 scalar, s = fp32 scalar, c = constexpr."""
    table = {"a": act, "f": "*fp32", "i": "*i32", "b": "*i1", "n": "i32", "s": "fp32", "c": "constexpr"}
    names = names.split()
    assert len(names) == len(types), (names, types)
    return {n: table[t] for n, t in zip(names, types)}


def _recurrent(draft_mode, store_output, store_final, limit, raw_gates=False):
    bv, warps = recurrent.recurrent_config(1 * HV, V, K)  # batch 1: the smallest BV, most programs
    names = ("q k v g beta o ssm_state slots draft draft_slots num_steps A_log dt_bias scale T stride_q_b stride_q_t "
             "stride_k_b stride_k_t stride_v_b stride_v_t stride_g_b stride_g_t stride_beta_b stride_beta_t H HV K V BK "
             "BV USE_L2NORM STORE_OUTPUT STORE_FINAL DRAFT_MODE LIMIT_STEPS RAW_GATES")
    consts = dict(H=H, HV=HV, K=K, V=V, BK=K, BV=bv, USE_L2NORM=True, STORE_OUTPUT=store_output,
                  STORE_FINAL=store_final, DRAFT_MODE=draft_mode, LIMIT_STEPS=limit, RAW_GATES=raw_gates)
    gates = "aa" if raw_gates else "ff"  # raw in-projections (decode computes the gates in the kernel) or fp32 gates
    return (recurrent._gdn_recurrent_fwd_kernel, names, "aaa" + gates + "afifiiff" + "s" + "n" * 11 + "c" * 12, consts,
            warps)


WALK_NAMES = ("k w u gcum k_rstd h v_new ssm_state slots has_initial_state h_start cu_seqlens cu_chunks cu_segs "
              "NUM_SEQ SEG_CHUNKS stride_k H HV K V BV DOT_PREC LOG_NUM_SEQ K_HALVES TRANSPOSED PREFETCH STAGE_U")
PRESCAN_NAMES = ("k w u gcum k_rstd hm cu_seqlens cu_chunks cu_segs NUM_SEQ SEG_CHUNKS stride_k "
                 "H HV K V BV DOT_PREC LOG_NUM_SEQ K_HALVES")


def _chunk_builds(cfg, arch, prefix):
    """The chunked-prefill kernels after the index table, at cfg's launch configuration: intra, the
    state walk (serial, split, prescan, merge) and the output."""
    solve_prec, merge_prec = ("tf32", "tf32x3") if arch >= 80 else ("ieee", "ieee")
    yield prefix + "intra", (chunk_intra._gdn_chunk_intra_kernel,
                             "k v g beta cu_seqlens cu_chunks w u gcum k_rstd NUM_SEQ stride_k stride_v stride_g "
                             "stride_beta H HV K V BK BV USE_L2NORM DOT_PREC SOLVE_PREC LOG_NUM_SEQ GROUP_HEADS",
                             "aaffiiaaff" + "n" * 5 + "c" * 11,
                             dict(H=H, HV=HV, K=K, V=V, BK=cfg.intra_bk, BV=cfg.intra_bv, USE_L2NORM=True,
                                  DOT_PREC="ieee", SOLVE_PREC=solve_prec, LOG_NUM_SEQ=3,
                                  GROUP_HEADS=cfg.intra_group_heads), cfg.intra_warps)
    halves = cfg.walk_k_halves
    for name, bv, warps, stages in (("walk", cfg.walk_bv, cfg.walk_warps, cfg.walk_stages),
                                    ("walk_split", cfg.cp_walk_bv, cfg.cp_walk_warps, cfg.cp_stages)):
        yield prefix + name, (chunk_state._gdn_chunk_walk_kernel, WALK_NAMES, "aaaffaafibfiii" + "nnn" + "c" * 11,
                              dict(H=H, HV=HV, K=K, V=V, BV=bv, DOT_PREC="ieee", LOG_NUM_SEQ=3, K_HALVES=halves,
                                   TRANSPOSED=cfg.walk_transposed, PREFETCH=cfg.walk_prefetch,
                                   STAGE_U=cfg.walk_stage_u), warps, stages)
    yield prefix + "prescan", (chunk_state._gdn_chunk_prescan_kernel, PRESCAN_NAMES, "aaafffiii" + "nnn" + "c" * 8,
                               dict(H=H, HV=HV, K=K, V=V, BV=cfg.prescan_bv, DOT_PREC="ieee", LOG_NUM_SEQ=3,
                                    K_HALVES=halves), cfg.prescan_warps, cfg.cp_stages)
    yield prefix + "merge", (chunk_state._gdn_chunk_merge_kernel,
                             "hm h_start ssm_state slots has_initial_state cu_segs HV K V BV MERGE_PREC",
                             "fffibi" + "c" * 5, dict(HV=HV, K=K, V=V, BV=cfg.merge_bv, MERGE_PREC=merge_prec),
                             cfg.merge_warps)
    yield prefix + "o", (chunk_out._gdn_chunk_o_kernel,
                         "q k h v_new gcum k_rstd o cu_seqlens cu_chunks NUM_SEQ scale stride_q stride_k "
                         "H HV K V BK BV VP USE_L2NORM DOT_PREC LOG_NUM_SEQ H_T", "aaaaffaiinsnn" + "c" * 11,
                         dict(H=H, HV=HV, K=K, V=V, BK=cfg.out_bk, BV=cfg.out_bv, VP=cfg.out_vp, USE_L2NORM=True,
                              DOT_PREC="ieee", LOG_NUM_SEQ=3, H_T=cfg.walk_transposed), cfg.out_warps,
                         cfg.out_stages)


def _variant_builds(arch):
    """sm_90: the kernels of every candidate in chunk_variants.py that the default builds do not
    already cover; sm_70: the K-halves and the transposed walks at the sm_70 tiles (the sm_70 default stays as it is;
    this checks the kernel code builds there). Each distinct compile once."""
    default = chunk.chunk_config(K, V, arch)
    if arch < 80:
        candidates = {"sm70_khalves": dataclasses.replace(default, walk_k_halves=True),
                      "sm70_transposed": dataclasses.replace(default, walk_transposed=True),
                      "sm70_prefetch": dataclasses.replace(default, walk_prefetch=True)}
    else:
        candidates = chunk_variants(K, V)
    seen = {_compile_key(b) for _, b in _chunk_builds(default, arch, "")}
    for vname, cfg in candidates.items():
        for name, b in _chunk_builds(cfg, arch, f"{vname}:"):
            if _compile_key(b) not in seen:
                seen.add(_compile_key(b))
                yield name, b


def _compile_key(b):
    kernel, _, _, consts, warps, *stages = b
    return kernel.__name__ if hasattr(kernel, "__name__") else str(kernel), tuple(sorted(consts.items())), warps, \
        tuple(stages)


def _builds(arch):
    cfg = chunk.chunk_config(K, V, arch)
    for name, copy_x in (("conv1d_varlen", False), ("conv1d_verify_copy_x", True)):
        yield name, (conv._causal_conv1d_varlen_fwd_kernel,
                     "x weight conv_state slots cu_seqlens has_initial_state y x_copy T C NUM_SEQ stride_x stride_y "
                     "stride_slot stride_xc W DIL ACT LOG_NUM_SEQ BT BC COPY_X", "aaaiibaannnnnnnccccccc",
                     dict(W=4, DIL=1, ACT=True, LOG_NUM_SEQ=3, BT=16, BC=128, COPY_X=copy_x), 4)
    yield "conv1d_state", (conv._causal_conv1d_state_kernel,
                           "x conv_state slots cu_seqlens has_initial_state num_keep C stride_x stride_slot S BS BC "
                           "USE_INIT_FLAGS USE_NUM_KEEP", "aaiibinnnccccc",
                           dict(S=9, BS=16, BC=256, USE_INIT_FLAGS=True, USE_NUM_KEEP=False), 4)
    yield "conv1d_update_ple", (conv._causal_conv1d_update_kernel,
                                "x weight conv_state slots y C stride_x stride_y stride_slot W DIL ACT BS BC",
                                "aaaiannnnccccc", dict(W=4, DIL=3, ACT=True, BS=8, BC=256), 4)
    yield "gdn_decode", _recurrent(0, True, True, False)
    yield "gdn_decode_raw_gates", _recurrent(0, True, True, False, raw_gates=True)
    yield "gdn_verify_keep", _recurrent(1, True, False, False)
    yield "gdn_replay", _recurrent(0, False, True, True)
    yield "gdn_commit", (recurrent._gdn_commit_kernel,
                         "draft ssm_state slots draft_slots num_accepted T NUMEL DRAFT_MODE BLOCK", "ffiiinccc",
                         dict(NUMEL=HV * K * V, DRAFT_MODE=1, BLOCK=2048), 4)
    yield "chunk_index", (chunk_index._gdn_chunk_index_kernel, "cu_seqlens cu_chunks cu_segs NUM_SEQ SEG_CHUNKS BLOCK",
                          "iiinnc", dict(BLOCK=16), 1)
    yield from _chunk_builds(cfg, arch, "chunk_")


BUILDS = {arch: dict(_builds(arch)) for arch in (70, 90)}
NAMES = list(BUILDS[70])
VARIANTS = {arch: dict(_variant_builds(arch)) for arch in (70, 90)}  # "candidate:kernel" -> build
for _arch in (70, 90):
    BUILDS[_arch].update(VARIANTS[_arch])
VARIANT_JOBS = [(n, a) for a in (70, 90) for n in VARIANTS[a]]
MEMORY_BOUND = {"conv1d_varlen", "conv1d_verify_copy_x", "conv1d_state", "conv1d_update_ple", "gdn_decode",
                "gdn_decode_raw_gates", "gdn_verify_keep", "gdn_replay", "chunk_index", "gdn_commit"}


def build(name, arch):
    kernel, names, types, consts, warps, *stages = BUILDS[arch][name]
    sig = _sig(names, types, ACT[arch])
    # pointers and strides specialised as 16-divisible, as the launcher does for the real tensors
    aligned = tuple(n for n, t in sig.items() if t.startswith("*") or n.startswith("stride"))
    return compile_report(kernel, sig, consts, arch=arch, num_warps=warps, num_stages=stages[0] if stages else 2,
                          aligned=aligned)


def _build_all():
    jobs = [(n, a) for a in (70, 90) for n in NAMES] + VARIANT_JOBS
    # Compiles are CPU-bound and independent: use every core (CI has 2). Fresh worker processes
    # with the interpreter off, so kernels and the @triton.jit helpers they call are JITFunctions
    # (under TRITON_INTERPRET=1 nested helpers cannot be compiled).
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        with multiprocessing.get_context("spawn").Pool(max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
            return dict(zip(jobs, pool.starmap(build, jobs)))
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = saved


@pytest.fixture(scope="module")
def reports():
    return _build_all()


def _budget(name, arch):
    return 0 if name in MEMORY_BOUND else SPILL_BUDGET_CHUNK[arch]


@pytest.mark.parametrize("arch", [70, 90])
@pytest.mark.parametrize("name", NAMES)
def test_builds_within_budget(reports, name, arch):
    report = reports[name, arch]
    shared_limit = aot.V100_SHARED_LIMIT if arch == 70 else 227 * 1024
    report.check(max_spill_bytes=_budget(name, arch), shared_limit=shared_limit)


@pytest.mark.parametrize("name,arch", VARIANT_JOBS)
def test_walk_variants_build_without_spills(reports, name, arch):
    """Every sm_90 walk candidate (chunk_variants.py) builds without spills within the H200's shared
    memory; the K-halves walk builds for sm_70 within the chunk kernels' budget (no Hopper/Ampere-only
    instructions)."""
    report = reports[name, arch]
    if arch >= 90:
        report.check(max_spill_bytes=0, shared_limit=227 * 1024)
    else:
        report.check(max_spill_bytes=SPILL_BUDGET_CHUNK[70], shared_limit=aot.V100_SHARED_LIMIT)


def test_serial_walk_runs_one_sequence_in_one_wave(reports):
    """The serial walk's shared memory lets one sequence's HV * V / BV programs (48 v-heads, 64-column tiles: 96)
    run in one wave on an H200's 132 SMs (228 KiB each, 1 KiB reserved per block)."""
    from revolta.kernels.gdn.chunk import chunk_config

    per_sm = 228 * 1024 // (reports["chunk_walk", 90].shared_bytes + 1024)
    programs = chunk_config(128, 128, 90).serial_walk_programs(1, 48, 128)
    assert per_sm >= 1 and programs <= 132 * per_sm, (programs, per_sm, reports["chunk_walk", 90])


if __name__ == "__main__":  # print the resource table: python tests/kernels/test_gdn_aot.py
    order = NAMES + [n for _, n in sorted((a, n) for n, a in VARIANT_JOBS)]
    for (name, arch), r in sorted(_build_all().items(), key=lambda x: (x[0][1], order.index(x[0][0]))):
        print(f"sm_{arch} {name:30s} shared {r.shared_bytes:6d} B  regs {r.registers:3d}  "
              f"spill st/ld {r.spill_store_bytes:5d}/{r.spill_load_bytes:5d} B  warps {r.num_warps}  "
              f"budget {_budget(name, arch)}  forbidden {list(r.forbidden)}")

"""Candidate launch configurations of the chunked prefill on sm_90, beside the default (issue 19
item 5: GDN prefill >= 1.0x fla at 1 x 8K and 1 x 32K).

benchmarks/bench_gdn.py times every candidate beside `chunk_config` and fla in one H200 run, and
tests/kernels/test_gdn_aot.py builds each candidate's walk kernels for sm_90 without spills, so
the table can pick a winner without another round trip. None of them is the default until a
measured row says so (stage_u_bv64_s3 became it: RESULTS.md K1); sm_70 keeps `chunk_config(K, V, 70)`
whatever wins here.

What they vary, and why (fla 0.6.0's `chunk_gated_delta_rule_fwd_h` walks one program per
(sequence, head, V block) serially over the chunks, as ours does below `cp_min_tokens`):
- the walk's warps: fla autotunes 2 or 4 warps on Hopper; at 2 warps Triton emits mma.sync
  instead of wgmma (no warpgroup, a shorter per-chunk chain). At 2 warps a 32-column tile spills
  (the fp32 state is 64 registers a thread), so those candidates take 16 columns: 384 programs
  of one sequence at 69 KiB of shared memory, three to an SM, one wave on 132 SMs;
- the walk's V tile: fla autotunes 32 or 64 columns; 64 halves the programs (96 for one sequence
  at the real shape) and the redundant W and K̂ reads, at 8 warps to keep registers per thread;
- the state as two K/2-row tiles (`walk_k_halves`), as fla holds it in 64-row tiles;
- the transposed walk (`walk_transposed`): the state as hᵀ [BV, K], so that the per-chunk
  products take the state and F V' as their left operand, which a wgmma reads from registers,
  instead of storing them to shared memory inside the serial chain (chunk_state.py); at 64
  columns (wgmma's 64-row minimum for one warpgroup) it also halves the programs, at 32 and 16
  the products are mma.sync;
- the decay factors loaded a chunk ahead (`walk_prefetch`), like U: Triton pipelines the loads that
  feed a product (W, K̂) but not these three, which otherwise wait between the chunk's two products;
- U and the factors loaded in their own chunk (`walk_stage_u`), so Triton stages them in shared
  memory with W and K̂ as fla's walk stages every per-chunk input, instead of a register prefetch;
- when the walk is split into segments (context parallelism, which fla does not do by default)
  and how (existing knobs of `ChunkConfig`);
- the fully parallel stages' tiles and warps (intra, output), in case the per-stage profile puts
  the gap there rather than in the walk;
- one sequence cut into pieces whose stages overlap on three streams (`pipeline_pieces`): the serial
  walk of one sequence leaves a third of the SMs idle (96 programs, one an SM, on 132), which the
  next piece's intra stage and the previous piece's output stage can use; these override the
  default itself (`_ON_DEFAULT`), not the prefetch walk (since K1b the default pipelines 8K+ tokens
  as 2-3 pieces; pipeN cuts any one sequence into N pieces of >= 2 chunks);
- the intra stage per (chunk, k head) over its value heads (`intra_group_heads`), so the K Kᵀ and
  1/‖k‖ that the HV / H value heads of one k head share are computed once (outputs bitwise those of
  the same warps without it: intra_heads the default's, intra_heads_w8 intra_w8's).
"""

from __future__ import annotations

import dataclasses

from .chunk import ChunkConfig, chunk_config

# name -> overrides of chunk_config(K, V, 90); walk-tile overrides apply to the serial walk and,
# where the batch splits it, to the split walk alike, so a name means one walk shape at every length
_OVERRIDES: tuple[tuple[str, dict], ...] = (
    ("default", {}),
    ("prefetch_walk", {}),
    ("no_split", dict(cp_min_tokens=0)),  # one serial walk per sequence at every length (fla's structure)
    ("split_from_8k", dict(cp_min_tokens=8192)),
    ("bv16_w2", dict(walk_bv=16, walk_warps=2, cp_walk_bv=16, cp_walk_warps=2)),
    ("bv64_w4", dict(walk_bv=64, cp_walk_bv=64)),
    ("bv64_w8", dict(walk_bv=64, walk_warps=8, cp_walk_bv=64, cp_walk_warps=8)),
    ("khalves", dict(walk_k_halves=True)),
    # 8 warps on a 32-column tile: two warpgroups share each chunk's products (a shorter chain per
    # chunk); 3 stages take 113 KiB, one program per SM, so the plain one runs 2 stages
    ("w8_2stages", dict(walk_warps=8, walk_stages=2, cp_walk_warps=8)),
    ("khalves_w8", dict(walk_k_halves=True, walk_warps=8, cp_walk_warps=8)),
    ("khalves_bv16_w2", dict(walk_k_halves=True, walk_bv=16, walk_warps=2, cp_walk_bv=16, cp_walk_warps=2)),
    ("khalves_bv64_w8", dict(walk_k_halves=True, walk_bv=64, walk_warps=8, cp_walk_bv=64, cp_walk_warps=8)),
    ("khalves_no_split", dict(walk_k_halves=True, cp_min_tokens=0)),
    ("bv16_w2_no_split", dict(walk_bv=16, walk_warps=2, cp_min_tokens=0)),
    ("walk_2stages", dict(walk_stages=2)),
    ("t_bv64", dict(walk_transposed=True, walk_bv=64, cp_walk_bv=64)),
    ("t_bv64_no_split", dict(walk_transposed=True, walk_bv=64, cp_min_tokens=0)),
    ("t_bv32", dict(walk_transposed=True)),
    ("t_bv64_2stages", dict(walk_transposed=True, walk_bv=64, walk_stages=2, cp_walk_bv=64)),
    ("t_bv16_w2", dict(walk_transposed=True, walk_bv=16, walk_warps=2, cp_walk_bv=16, cp_walk_warps=2)),
    # two warpgroups: hᵀ split between them (t_bv64 at 4 warps needs 255 registers and spills)
    ("t_bv64_w8", dict(walk_transposed=True, walk_bv=64, walk_warps=8, cp_walk_bv=64, cp_walk_warps=8)),
    ("t_bv128_w8", dict(walk_transposed=True, walk_bv=128, walk_warps=8, walk_stages=2, cp_walk_bv=128,
                        cp_walk_warps=8)),
    # the decay factors a chunk ahead (three loads Triton does not pipeline, otherwise inside the serial chain): the
    # prefetch walk's (the default from K1's H100 run until the staged-U walk); no_pf is the walk before it
    ("no_pf", dict(walk_prefetch=False)),
    ("pf_2stages", dict(walk_prefetch=True, walk_stages=2)),
    # t_bv64_w8 and the 64-column transposed split walk spill a few bytes with it
    ("t_bv32_pf", dict(walk_transposed=True, walk_prefetch=True, cp_walk_bv=32)),
    # U and the factors loaded in their own chunk for Triton's cp.async stages (as fla's walk: no register load in the
    # loop; a static sm_90 comparison put the walk's extra wait there, RESULTS.md K1): at 32 columns 2 stages keep two
    # programs an SM (3 would take one), at 64 columns 3 / 4 stages (140 / 182 KB) run 96 programs in one wave
    ("stage_u_s2", dict(walk_stage_u=True, walk_prefetch=False, walk_stages=2)),
    ("stage_u_bv64_s3", dict(walk_stage_u=True, walk_prefetch=False, walk_bv=64, walk_stages=3)),
    ("stage_u_bv64_s4", dict(walk_stage_u=True, walk_prefetch=False, walk_bv=64, walk_stages=4)),
    ("stage_u_s3", dict(walk_stage_u=True, walk_prefetch=False, walk_stages=3)),
    # the 64-column walk never split: at 1 x 32K its 96 serial programs (< 132 SMs) split under the prefetch walk's
    # rule, 1.74 ms against the prefetch walk's serial 1.22 ms on an H100 (RESULTS.md K1); the default keeps it serial
    ("stage_u_bv64_s3_serial", dict(walk_stage_u=True, walk_prefetch=False, walk_bv=64, walk_stages=3,
                                    cp_min_tokens=0)),
    ("stage_u_bv64_s2_serial", dict(walk_stage_u=True, walk_prefetch=False, walk_bv=64, walk_stages=2,
                                    cp_min_tokens=0)),
    ("split_seg16", dict(cp_min_tokens=8192, seg_chunks=16)),
    ("out_vp64", dict(out_vp=64)),  # two output programs per (chunk, v-head): more programs, Q Kᵀ twice
    ("out_bv32", dict(out_bv=32)),  # 122 registers instead of 146: four output programs to an SM, not three
    ("out_w8", dict(out_warps=8)),
    ("out_bk128_bv128_w8", dict(out_bk=128, out_bv=128, out_warps=8)),  # the first of fla's output configs
    ("intra_w8", dict(intra_warps=8)),
    ("intra_bk32_bv32", dict(intra_bk=32, intra_bv=32)),  # 130 registers: fewer live tiles per program
    # per (chunk, k head) over its 3 value heads: K Kᵀ, 1/‖k‖ once, not three times (sm_90: 244 / 236 registers with
    # Triton 3.6); slower on an H100 (K1: intra 418 / 1,033 against 360 µs at 1 x 8K bf16)
    ("intra_heads", dict(intra_group_heads=True)),
    ("intra_heads_w8", dict(intra_group_heads=True, intra_warps=8)),
)

# name -> overrides of the default itself (chunk_config(K, V, 90)), for candidates timed against today's default
_ON_DEFAULT: tuple[tuple[str, dict], ...] = (
    ("no_pipe", dict(pipeline_pieces=0)),  # the default before pieces (K1b)
    ("pipe2", dict(pipeline_pieces=2, pipeline_min_chunks=2)),
    ("pipe3", dict(pipeline_pieces=3, pipeline_min_chunks=2)),
    ("pipe4", dict(pipeline_pieces=4, pipeline_min_chunks=2)),
    ("pipe8", dict(pipeline_pieces=8, pipeline_min_chunks=2)),
    # the first piece longer (a fluid model of the stages, fitted to K1b's rows, puts 2 pieces split 0.6-0.7 / 0.4-0.3
    # 5-7% below equal halves at 1 x 8K and 1 x 32K)
    ("pipe2_lead60", dict(pipeline_pieces=2, pipeline_min_chunks=2, pipeline_lead=0.6)),
    ("pipe2_lead70", dict(pipeline_pieces=2, pipeline_min_chunks=2, pipeline_lead=0.7)),
    ("pipe3_lead50", dict(pipeline_pieces=3, pipeline_min_chunks=2, pipeline_lead=0.5)),
)


# the sm_90 default walk until the staged-U walk replaced it (32 columns, U and the factors prefetched in registers,
# split below 132 programs): the base every other candidate overrides, so a name keeps the walk it was timed as
PREFETCH_WALK = dict(walk_bv=32, walk_prefetch=True, walk_stage_u=False, serial_min_fill=1.0, pipeline_pieces=0)


def chunk_variants(K: int, V: int) -> dict[str, ChunkConfig]:
    """The sm_90 candidates by name ("default" is `chunk_config(K, V, 90)` itself; "prefetch_walk" the default before
    the staged-U walk, which the others override). The other tilings of the walk (K halves, transposed) run without
    the prefetched factors unless their overrides name it, as they were timed (K halves cannot take it)."""
    default = chunk_config(K, V, 90)
    base = dataclasses.replace(default, **PREFETCH_WALK)
    variants = {name: default if name == "default" else dataclasses.replace(base, **_tiling_base(over), **over)
                for name, over in _OVERRIDES}
    return variants | {name: dataclasses.replace(default, **over) for name, over in _ON_DEFAULT}


def _tiling_base(over: dict) -> dict:
    tiling = over.get("walk_k_halves", False) or over.get("walk_transposed", False)
    return {"walk_prefetch": False} if tiling and "walk_prefetch" not in over else {}


def variant_overrides(name: str) -> dict:
    """The fields a candidate sets over chunk_config(K, V, 90) (for the benchmark's JSON): none for the default, else
    the prefetch walk's and its own."""
    on_default = dict(_ON_DEFAULT)
    if name in on_default:
        return dict(on_default[name])
    found = dict(_OVERRIDES)
    assert name in found, f"unknown chunk variant {name!r}: choose from {list(found) + list(on_default)}"
    over = found[name]
    return {} if name == "default" else {**PREFETCH_WALK, **_tiling_base(over), **over}

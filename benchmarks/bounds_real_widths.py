"""Out-of-bounds sweep of the full-size model's decode / MTP4-verify / MTP-draft Triton kernels at the REAL widths, on
the CPU under the Triton interpreter (benchmarks/RESULTS.md F3: MTP4 at C8 died with a CUDA illegal memory access on
the H200; locate_crash.py --bounds-check ran the stages at tiny widths only).

    TRITON_INTERPRET=1 PYTHONPATH=$PWD/src python benchmarks/bounds_real_widths.py [--only moe,gemv] [--full]

Every case runs its kernel entry point once at the real widths (hidden 2560, 512 experts top-10 + the shared expert,
MoE ffn 640, AWQ int4 group 32, GDN 16 / 48 heads of 128, QSA 24 q / 2 KV heads of 256 with the indexer (4 heads of
128, budget 512 groups), HC 4 streams rank 320, vocab 248,320) with the row counts of MTP4 at C8 (40-row verify of 8
sequences x 5 rows, 8-row draft / decode steps, and 1 and 5 rows), with the launch configs an H200 picks (sm90: arch
90, 132 SMs, passed as explicit configs; so the GPU-only paths run: the nibble GEMV, the HC dot passes at M 4..16),
inside tests/interpreter_bounds.bounds_checked (every masked-on load / store address must lie in one tensor argument
of the launch; interpreter_sweep.py runs the cases). Outputs are NaN-poisoned before the call, and the finished part
of each output is compared with the torch reference (loose tolerance: the point is bounds). One table row per
(kernel, rows, path): shapes, grids, config, OK / OUT OF BOUNDS (first violation), compared entries, seconds.

Grids: a program of the interpreter costs milliseconds per K step, so launches whose grid axes are long run only the
boundary programs of each long axis (first two, middle, last two; `sampled` in the table, and the compared entries are
then the outputs those programs finish): the last N tile, the last K split, the last expert slot, the highest block
ids are where an out-of-bounds access at a real width would be. --full runs every program (hours).

Covered (kernels/ops.py's Triton table plus the packed linears):
  quant_fused_moe (moe_decode.py nibble path: the sm80+/sm90 default with split-K at M = 1; the tile path of
    quant/moe.py), its moe_group and _moe_sum_kernel; moe_route (512 logits + the shared logit);
  awq_gemv on the nibble path (gemv_nibble.py, sm90 config) and the tile path (awq.py, sm90 config) at every packed
    projection of the model (GDN in_proj_qkv / in_proj_z / out_proj, QSA q / k / v / index_qk / o_proj, shared
    expert gate / up / down, MTP fc_embedding / fc_hidden) incl. the split-K reduce;
  gdn_recurrent_update (raw gates), gdn_verify (per-draft slots), gdn_replay_commit, gdn_commit (draft slots) in a
    pool of the engine's size with the slots at its end; causal_conv1d_update / _commit at the GDN conv width;
    gdn_gates;
  store_kv, index_compress, qsa_select_decode, qsa_sparse_decode (8 x 130 tokens and a 40K-token sequence among 7
    short ones; block ids near the end of a 40K-token pool);
  hc_read (rows kernels, sm90 dot passes at M 4..16, tiles above 16), hc_combine, hc_combine_read;
  zc_rms_norm, gated_rms_norm, zc_norm_rope, apply_rope;
  ple_rows (real n-gram sizes, offsets and multipliers), ple_gather (FP8 table of few rows at the real row width,
    row ids at its end);
  sample_from_logits / greedy (vocab 248,320).
Left out: gdn_chunk_prefill, causal_conv1d_varlen, qsa_prefill, qsa_partial (prefill and DCP only, not on the F3
decode / verify / draft path); fused_moe (16-bit experts: the stand-in's path, which works); the dense 16-bit linears
(lm_head, router, HC weights: torch / cuBLAS, no Triton).

int32 offsets, read in the kernels above for the full size (the interpreter computes offsets in numpy int32 like the
GPU and its address is base + offset as uint64, so an overflow shows as an out-of-bounds address, but only where the
shapes reach it; these were read instead): GDN state `slot * (HV*K*V)` and draft states `i_bt * (HV*K*V)` (slot,
i_bt int64; recurrent.py), the commit's `src_pos * NUMEL` (int64); conv state `slot * stride_slot` (int64); MoE expert
bases `i_e * stride_e` (i_e loaded as int64 by moe_grouped._program), pair rows `b_pair * stride` (int64 from
_pairs), split-K partials `(i_k * T + b_pair) * 2I` (int64), `_moe_sum_kernel` rows (int64); GEMV rows
`o_m.to(int64) * stride_xm`, split-K ws `i_split.to(int64) * M * N`, the reduce's rows (int64); QSA pages
`page.to(int64) * stride_kb` in sparse_attn / select / index_compress, store_kv's slot (int64); sample rows
`program_id.to(int64) * stride_l`; PLE gather `row (int64) * D` and `r.to(int64) * D`, ple_rows' slot (int64).
What stays int32 is bounded well below 2^31 at the full size: within-expert / within-weight offsets (at most the
q_proj qweight, 2560 * 1536 words), within-page and within-slot offsets, HC rows (40 * 10240). For scale: the 16 GiB
KV cache of locate_crash.py's 4-layer stand-in (one QSA layer + MTP, ~1.08 MB a page) has ~15K pages of 131,072 K
elements: ~2.0G elements per K cache, 7% below 2^31 (the 48-layer F3 run: ~2.3K pages); an int32 `page * stride_kb`
would overflow from ~17.5 GiB there, which is why it matters that every QSA kernel casts the page id to int64 first.
The sweep itself uses 64 / 200-page pools (highest ids taken): what it checks is the kernels' address pattern.
"""

# ruff: noqa: B023 - case() runs its two callables before the loop that made them moves on
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from interpreter_sweep import Runner, case, short, sweep_main

ARCH, SMS = 90, 132  # the H200
H, E, TOP_K, I_FFN, G = 2560, 512, 10, 640, 32
NS, ROWS_PER_SEQ = 8, 5  # C8, MTP4: 1 + 4 rows per sequence


# ---- packed AWQ weights ------------------------------------------------------------------------------------------


def awq_tensors(lead: tuple[int, ...], N: int, K: int, gen: torch.Generator):
    """Random AWQ int4 (qweight [.., K, N/8], qzeros [.., K/G, N/8], scales fp16 [.., K/G, N]); W ~ N(0, 1/K)."""
    qw = torch.randint(-2**31, 2**31 - 1, (*lead, K, N // 8), dtype=torch.int32, generator=gen)
    qz = torch.randint(-2**31, 2**31 - 1, (*lead, K // G, N // 8), dtype=torch.int32, generator=gen)
    sc = (torch.rand(*lead, K // G, N, generator=gen) * 0.5 + 0.5) / (4.6 * math.sqrt(K))  # codes - zero: sd ~4.6
    return qw, qz, sc.to(torch.float16)


# ---- MoE ---------------------------------------------------------------------------------------------------------


def moe_cases(runner: Runner, gen: torch.Generator, args) -> None:
    from revolta.kernels.moe import moe_route, moe_route_ref
    from revolta.kernels.quant.moe import (
        PackedWeights,
        quant_fused_moe,
        quant_fused_moe_ref,
        quant_grouped_config,
    )

    E_ = args.experts
    gate_up = PackedWeights("awq", awq_tensors((E_,), 2 * I_FFN, H, gen), G)
    down = PackedWeights("awq", awq_tensors((E_,), H, I_FFN, gen), G)
    shared = tuple(PackedWeights("awq", awq_tensors((), n, k, gen), G) for n, k in
                   ((I_FFN, H), (I_FFN, H), (H, I_FFN)))
    for M in (1, 5, 8, 40):
        # distinct logits (fp16 randn ties would let kernel and reference pick different equal experts)
        logits = (torch.stack([torch.randperm(E_, generator=gen) for _ in range(M)]) * (6.0 / E_) - 3).to(torch.float16)
        shared_logit = torch.randn(M, generator=gen).to(torch.float16)
        case(runner, "moe_route", M, "sm90", f"logits [{M}, {E_}] + shared", "top10 renorm",
             lambda: moe_route(logits, TOP_K, True, shared_logits=shared_logit),
             lambda: moe_route_ref(logits, TOP_K, True, shared_logits=shared_logit), tol=(1e-5, 1e-5))
    routings = {}
    for M in (1, 8, 40):  # realistic: each row its own distinct experts, the extremes 0 and E-1 among them
        ids = torch.stack([torch.randperm(E_, generator=gen)[:TOP_K] for _ in range(M)])
        if not (ids[0] == E_ - 1).any():
            ids[0, 0] = E_ - 1
        if not (ids[-1] == 0).any():
            ids[-1, -1] = 0
        routings[(M, "spread")] = ids
    ids = torch.arange(E_ - TOP_K, E_).repeat(40, 1)  # all 40 rows on the same 10 experts (the last ones)
    ids[::3] = torch.arange(TOP_K)  # every third row on experts 0..9
    routings[(40, "same")] = ids
    routings[(8, "same")] = torch.arange(E_ - TOP_K, E_).repeat(8, 1)
    for (M, kind), ids in routings.items():
        ids = torch.cat([ids, torch.full((M, 1), E_)], 1).to(torch.int32)  # the shared expert rides as expert E
        w = torch.rand(M, TOP_K + 1, generator=gen)
        w = w / w.sum(1, keepdim=True)
        x = (torch.randn(M, H, generator=gen)).to(torch.float16)
        distinct = int(ids.unique().numel())
        for path, nibble in (("sm90 nibble", None), ("sm90 tile", False)):
            cfg = quant_grouped_config(M, TOP_K + 1, E_ + 1, ARCH, nibble=nibble)
            # the last non-empty slot and the first empty one are the boundary programs along the slot axis
            slots = sorted({0, 1, distinct // 2, distinct - 2, distinct - 1, distinct, M * (TOP_K + 1) - 1})
            picks = {} if M == 1 or args.full else {(k, 0): slots for k in (
                "_nibble_gate_up_kernel", "_nibble_down_kernel", "_quant_gate_up_kernel", "_quant_down_kernel")}
            keys = ("BLOCK_M", "BLOCK_N_UP", "BLOCK_K_UP", "BLOCK_N_DOWN", "BLOCK_K_DOWN", "SPLIT_UP", "SPLIT_DOWN")
            # one whole run (every program, ~1.5 min) checks the result too: the tile path at M = 1
            case(runner, "quant_fused_moe", M, f"{path} {kind}",
                 f"x [{M}, {H}] E {E_}+1 I {I_FFN} top{TOP_K}+1, {distinct} experts", short(cfg, keys),
                 lambda: quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared, config=cfg),
                 lambda: quant_fused_moe_ref(x, gate_up, down, ids, w, shared_expert=shared), picks=picks,
                 full=M == 1 and nibble is False)


# ---- dense packed GEMV / skinny GEMM -----------------------------------------------------------------------------

PROJECTIONS = {  # (N, K) of every packed projection (random_quantized_model: 16-bit router, b / a, HC, lm_head)
    "gdn in_proj_qkv": (10240, 2560), "gdn in_proj_z": (6144, 2560), "gdn out_proj / qsa o_proj": (2560, 6144),
    "qsa q_proj": (12288, 2560), "qsa k_proj / v_proj": (512, 2560), "qsa index_qk / shared gate, up": (640, 2560),
    "shared down": (2560, 640), "mtp fc_embedding / fc_hidden": (2560, 2560)}


def gemv_cases(runner: Runner, gen: torch.Generator, args) -> None:
    from revolta.kernels.quant.awq import awq_gemv, awq_gemv_ref
    from revolta.kernels.quant.common import gemv_config
    from revolta.kernels.quant.gemv_nibble import nibble_gemv_config

    for what, (N, K) in PROJECTIONS.items():
        qw, qz, sc = awq_tensors((), N, K, gen)
        for M in (1, 5, 8, 40):
            x = torch.randn(M, K, generator=gen).to(torch.float16)
            for path, cfg in (("sm90 nibble", nibble_gemv_config(M, N, K, G, "awq", SMS, ARCH)),
                              ("sm90 tile", gemv_config(M, N, K, G, SMS, 8, ARCH))):
                # every K split of a sampled N tile runs, so its output columns are complete and compared
                picks = {(k, 1): range(64) for k in ("_nibble_gemv_kernel", "_awq_gemv_kernel")}
                case(runner, "awq_gemv", M, path, f"{what} x [{M}, {K}] W [{N}, {K}]",
                     short(cfg, ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "USE_DOT")),
                     lambda: awq_gemv(x, qw, qz, sc, G, config=cfg), lambda: awq_gemv_ref(x, qw, qz, sc, G),
                     tol=(2e-2, 2e-2), picks=picks)


# ---- GDN ---------------------------------------------------------------------------------------------------------

HK, HV, DK, DV, CONV_W = 16, 48, 128, 128, 4
CONV_DIM = 2 * HK * DK + HV * DV  # 10240: q | k | v before the conv


def gdn_inputs(B: int, T: int, gen: torch.Generator):
    """q, k [B, T, 16, 128], v [B, T, 48, 128]: column views of one conv output row (stride 10240), as the layer
    hands them on; raw b, a [B, T, 48]: column views of the merged 16-bit b / a projection."""
    buf = torch.randn(B, T, CONV_DIM, generator=gen).to(torch.float16)
    q = buf[..., : HK * DK].unflatten(-1, (HK, DK))
    k = buf[..., HK * DK: 2 * HK * DK].unflatten(-1, (HK, DK))
    v = buf[..., 2 * HK * DK:].unflatten(-1, (HV, DV))
    ba = torch.randn(B, T, 2 * HV, generator=gen).to(torch.float16)
    return q, k, v, ba[..., :HV], ba[..., HV:]


def gdn_cases(runner: Runner, gen: torch.Generator, args) -> None:
    from revolta.kernels.conv1d import (
        causal_conv1d_commit,
        causal_conv1d_commit_ref,
        causal_conv1d_update,
        causal_conv1d_update_ref,
    )
    from revolta.kernels.gdn.gates import gdn_gates, gdn_gates_ref
    from revolta.kernels.gdn.recurrent import (
        gdn_commit,
        gdn_recurrent_update,
        gdn_replay_commit,
        gdn_verify,
        recurrent_config,
    )
    from revolta.kernels.gdn.ref import (
        gdn_commit_ref,
        gdn_recurrent_update_ref,
        gdn_replay_commit_ref,
        gdn_verify_ref,
    )

    B, T = NS, ROWS_PER_SEQ
    pool = B * (1 + T) + 2  # running + per-draft slots of 8 requests (cache/capacity.py), a spare pair
    state0 = torch.randn(pool, HV, DK, DV, generator=gen) * 0.1
    A_log, dt_bias = torch.rand(HV, generator=gen), torch.rand(HV, generator=gen)
    slots = torch.arange(pool - B, pool, dtype=torch.int32)  # the highest slots: the largest offsets
    draft = torch.arange(B * T, dtype=torch.int32).flip(0).reshape(B, T).contiguous()
    acc = torch.tensor([0, 1, 2, 3, 4, 5, 5, 2], dtype=torch.int32)  # accepted rows (0 = unchanged)
    full = {("_gdn_recurrent_fwd_kernel", a): range(4096) for a in (0, 1)}
    full |= {("_gdn_commit_kernel", a): range(4096) for a in (0, 1)}  # in-place states: compare whole pools
    for M in (1, 8):
        q, k, v, b, a = gdn_inputs(M, 1, gen)
        q, k, v, b, a = (t[:, 0] for t in (q, k, v, b, a))
        st, st_ref = state0.clone(), state0.clone()
        sl = slots[-M:].contiguous()
        bv, _ = recurrent_config(M * HV, DV, DK)
        case(runner, "gdn_recurrent_update", M, "decode raw gates", f"q [{M}, 16, 128] v [{M}, 48, 128] pool {pool}",
             f"BV={bv}", lambda: (gdn_recurrent_update(q, k, v, a, b, st, sl, gates=(A_log, dt_bias)), st),
             lambda: (gdn_recurrent_update_ref(q, k, v, a, b, st_ref, sl, gates=(A_log, dt_bias)), st_ref),
             tol=(1e-3, 1e-3), picks=full)
        g, beta = gdn_gates_ref(a, b, A_log, dt_bias)
        case(runner, "gdn_gates", M, "verify / prefill", f"a, b [{M}, 48] strided", "-",
             lambda: gdn_gates(a, b, A_log, dt_bias), lambda: gdn_gates_ref(a, b, A_log, dt_bias), tol=(1e-5, 1e-5))
    q, k, v, b, a = gdn_inputs(B, T, gen)
    g, beta = gdn_gates_ref(a.reshape(-1, HV), b.reshape(-1, HV), A_log, dt_bias)
    g, beta = g.view(B, T, HV), beta.view(B, T, HV)
    bv, _ = recurrent_config(B * HV, DV, DK)
    shape = f"q [{B}, {T}, 16, 128] (row stride {CONV_DIM}) pool {pool}"
    st, st_ref = state0.clone(), state0.clone()
    case(runner, "gdn_verify", B * T, "per-draft slots", shape, f"BV={bv}",
         lambda: (gdn_verify(q, k, v, g, beta, st, slots, draft_states=draft), st),
         lambda: (gdn_verify_ref(q, k, v, g, beta, st_ref, slots, draft_states=draft), st_ref), tol=(1e-3, 1e-3),
         picks=full)
    case(runner, "gdn_commit", B, "per-draft slots", f"draft slots [{B}, {T}] pool {pool}", "BLOCK=2048",
         lambda: (gdn_commit(draft, st, slots, acc), st)[1:],
         lambda: (gdn_commit_ref(draft, st_ref, slots, acc), st_ref)[1:], tol=(1e-3, 1e-3), picks=full)
    st, st_ref = state0.clone(), state0.clone()
    case(runner, "gdn_verify", B * T, "replay", shape, f"BV={bv}",
         lambda: gdn_verify(q, k, v, g, beta, st, slots), lambda: gdn_verify_ref(q, k, v, g, beta, st_ref, slots),
         tol=(1e-3, 1e-3), picks=full)
    case(runner, "gdn_replay_commit", B * T, "replay", shape, f"BV={bv}",
         lambda: (gdn_replay_commit(q, k, v, g, beta, st, slots, acc), st)[1:],
         lambda: (gdn_replay_commit_ref(q, k, v, g, beta, st_ref, slots, acc), st_ref)[1:], tol=(1e-3, 1e-3),
         picks=full)
    conv_w = torch.randn(CONV_DIM, CONV_W, generator=gen).to(torch.float16) * 0.5
    conv0 = torch.randn(pool, CONV_W - 1, CONV_DIM, generator=gen).to(torch.float16)
    for M in (1, 8):
        x = torch.randn(M, CONV_DIM, generator=gen).to(torch.float16)
        cs, cs_ref = conv0.clone(), conv0.clone()
        sl = slots[-M:].contiguous()
        case(runner, "causal_conv1d_update", M, "decode", f"x [{M}, {CONV_DIM}] pool {pool}", "BC=256",
             lambda: (causal_conv1d_update(x, conv_w, cs, sl), cs), lambda: (causal_conv1d_update_ref(
                 x, conv_w, cs_ref, sl), cs_ref), tol=(2e-3, 2e-3), picks={("_causal_conv1d_update_kernel", a): range(64) for a in (0, 1)})

    x = torch.randn(B * T, CONV_DIM, generator=gen).to(torch.float16)
    cu = torch.arange(0, B * T + 1, T, dtype=torch.int32)
    cs, cs_ref = conv0.clone(), conv0.clone()
    case(runner, "causal_conv1d_commit", B * T, "verify commit", f"x [{B * T}, {CONV_DIM}] pool {pool}", "-",
         lambda: (causal_conv1d_commit(x, cs, slots, cu, acc), cs),
         lambda: (causal_conv1d_commit_ref(x, cs_ref, slots, cu, acc), cs_ref), tol=(0, 0),
         picks={("_causal_conv1d_state_kernel", a): range(4096) for a in (0, 1, 2)})


# ---- QSA ---------------------------------------------------------------------------------------------------------

HQ, KVH, DH, HI, DI, RATIO, BUDGET, PAGE, ROT = 24, 2, 256, 4, 128, 4, 512, 256, 64


def qsa_world(lengths: list[int], width: int, num_blocks: int, gen: torch.Generator):
    """Paged caches (fp16 "auto", 256-token pages) of `num_blocks` pages and a block table [B, width] whose pages are
    distinct and taken from the END of the pool (the largest block ids); random K / V / index keys everywhere."""
    need = [-(-n // PAGE) for n in lengths]
    ids = (num_blocks - 1 - torch.randperm(sum(need), generator=gen)).int()  # never the null block 0
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    used = 0
    for b, k in enumerate(need):
        table[b, :k] = ids[used: used + k]
        used += k
    kc = torch.randn(num_blocks, PAGE, KVH, DH, generator=gen).to(torch.float16)
    vc = torch.randn(num_blocks, PAGE, KVH, DH, generator=gen).to(torch.float16)
    ic = torch.randn(num_blocks, PAGE // RATIO, DI, generator=gen).to(torch.float16)
    return table, kc, vc, ic


def qsa_cases(runner: Runner, gen: torch.Generator, args) -> None:
    from revolta.kernels.qsa.index_compress import index_compress, index_compress_ref
    from revolta.kernels.qsa.select import qsa_select_decode, qsa_select_decode_ref
    from revolta.kernels.qsa.sparse_attn import qsa_sparse_decode, qsa_sparse_decode_ref
    from revolta.kernels.qsa.store_kv import store_kv, store_kv_ref

    worlds = {  # F3's max_model_len (256: one page per request) and a 40K-token request among short ones
        "8 x 130": ([130 + i for i in range(NS)], 1, 64),
        "40K + 7 x 130": ([130 + i for i in range(NS - 1)] + [40_000], 40_960 // PAGE, 200)}
    for name, (lengths, width, nb) in worlds.items():
        table, kc, vc, ic = qsa_world(lengths, width, nb, gen)
        seq = torch.tensor(lengths, dtype=torch.int32)
        for Q in (1, ROWS_PER_SEQ):
            B = len(lengths)
            R = B * Q
            shp = f"{name} tokens, table [{B}, {width}], {nb} pages"
            # the step's rows: K / V stored at their positions (slot_mapping), index keys compressed
            pos = (seq.long()[:, None] - Q + torch.arange(Q)).reshape(-1)
            bidx = torch.arange(B).repeat_interleave(Q)
            slot_mapping = table.long()[bidx, pos // PAGE] * PAGE + pos % PAGE
            k = torch.randn(R, KVH, DH, generator=gen).to(torch.float16)
            v = torch.randn(R, KVH, DH, generator=gen).to(torch.float16)
            kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
            case(runner, "store_kv", R, "auto (fp16)", shp, f"grid T={R}",
                 lambda: (store_kv(k, v, kc1, vc1, slot_mapping, "auto"), kc1, vc1)[1:],
                 lambda: (store_kv_ref(k, v, kc2, vc2, slot_mapping, "auto"), kc2, vc2)[1:], tol=(0, 0), full=True)
            proj = torch.randn(R, HI * DI + DI, generator=gen).to(torch.float16)  # index_qk_proj's output [R, 640]
            raw = proj[:, HI * DI:]  # the raw keys: a column slice (row stride 640)
            cos, sin = torch.rand(R, ROT, generator=gen), torch.rand(R, ROT, generator=gen)
            pend = torch.randn(B * 6 + 2, 8, DI, generator=gen).to(torch.float16)  # ring 8 (MTP4), engine's slots
            pcos, psin = torch.rand(B, ROT, generator=gen), torch.rand(B, ROT, generator=gen)
            nw = torch.randn(DI, generator=gen) * 0.1
            cu = torch.arange(0, R + 1, Q, dtype=torch.int32)
            pslots = torch.arange(pend.shape[0] - B, pend.shape[0], dtype=torch.int32)
            ic1, ic2, p1, p2 = ic.clone(), ic.clone(), pend.clone(), pend.clone()
            case(runner, "index_compress", R, "auto (fp16)", shp + ", ring 8", f"grid ({B}, groups)",
                 lambda: (index_compress(raw, cos, sin, p1, pcos, psin, nw, 1e-6, ic1, table, cu, seq, pslots, Q),
                          ic1, p1)[1:],
                 lambda: (index_compress_ref(raw, cos, sin, p2, pcos, psin, nw, 1e-6, ic2, table, cu, seq, pslots, Q),
                          ic2, p2)[1:], tol=(2e-3, 2e-3), full=True)
            iq = torch.randn(B, Q, HI, DI, generator=gen).to(torch.float16)
            iq = iq[:, 0] if Q == 1 else iq
            # every group split of the score kernel runs, so the sampled rows' selections are complete
            case(runner, "qsa_select_decode", R, "sm90 (132 SMs)", shp + f", budget {BUDGET}", "BN=32 CHUNK=2048",
                 lambda: qsa_select_decode(iq, ic, table, seq, BUDGET),
                 lambda: qsa_select_decode_ref(iq, ic, table, seq, BUDGET), tol=(0, 0),
                 picks={("_index_score_kernel", 1): range(4096)})
            sel = qsa_select_decode_ref(iq, ic, table, seq, BUDGET)
            qg = torch.randn(B, Q, HQ, 2 * DH, generator=gen).to(torch.float16)  # q_proj's [.., 24, query | gate]
            q, gate = qg[..., :DH], qg[..., DH:]
            q = q.contiguous()  # zc_norm_rope's output
            if Q == 1:
                q, gate = q[:, 0], gate[:, 0]
            case(runner, "qsa_sparse_decode", R, "sm90 (132 SMs)", shp + f", q [{R}, 24, 256]", "BN=32 splits auto",
                 lambda: qsa_sparse_decode(q, gate, kc, vc, table, seq, sel, DH ** -0.5),
                 lambda: qsa_sparse_decode_ref(q, gate, kc, vc, table, seq, sel, DH ** -0.5), tol=(2e-3, 2e-3),
                 picks={("_qsa_attn_kernel", a): range(4096) for a in (1, 2)})


# ---- HyperConnections and norms -----------------------------------------------------------------------------------

HC, RANK = 4, 320


def hc_cases(runner: Runner, gen: torch.Generator, args) -> None:
    from revolta.kernels.hc import (
        hc_combine,
        hc_combine_read,
        hc_combine_read_ref,
        hc_config,
        hc_read,
        hc_read_ref,
    )
    from revolta.kernels.hc_combine import hc_combine_ref
    from revolta.kernels.norm import (
        gated_rms_norm,
        gated_rms_norm_ref,
        zc_rms_norm,
        zc_rms_norm_ref,
    )
    from revolta.kernels.norm_rope import zc_norm_rope, zc_norm_rope_ref
    from revolta.kernels.rope import apply_rope, apply_rope_ref

    wide = HC * H
    norm_w = (torch.randn(wide, generator=gen) * 0.1).to(torch.float16)
    w_down = (torch.randn(RANK, wide, generator=gen) * wide ** -0.5).to(torch.float16)
    w_up = (torch.randn(wide, RANK, generator=gen) * RANK ** -0.5).to(torch.float16)
    w_inj = (torch.randn(HC, wide, generator=gen) * wide ** -0.5).to(torch.float16)
    for M in (1, 5, 8, 16, 40):
        x = torch.randn(M, wide, generator=gen).to(torch.float16)
        inject = torch.rand(M, HC, generator=gen).to(torch.float16) * 2
        u = torch.randn(M, H, generator=gen).to(torch.float16)
        cfg = hc_config(M, H, RANK, HC, ARCH)  # sm90: the dot passes at M 4..16 (hc_dot_default ENABLED)
        keys = ("KIND", "DOWN", "UP", "BLOCK_M", "BLOCK_R", "BLOCK_K", "BLOCK_C", "SPLITS_PER_BRANCH")
        path = "sm90 " + ("dot" if cfg.get("DOWN") == "dot" else cfg["KIND"])
        for inj in (w_inj, None):
            case(runner, "hc_read", M, path + (" +inject" if inj is not None else ""),
                 f"x [{M}, {wide}] r {RANK}", short(cfg, keys),
                 lambda: hc_read(x, norm_w, w_down, w_up, inj, HC, 1e-6, config=cfg),
                 lambda: hc_read_ref(x, norm_w, w_down, w_up, inj, HC, 1e-6), tol=(2e-2, 2e-2), full=True)
        case(runner, "hc_combine_read", M, path, f"x [{M}, {wide}] inject [{M}, 4] u [{M}, {H}]", short(cfg, keys),
             lambda: hc_combine_read(x, inject, u, norm_w, w_down, w_up, w_inj, HC, 1e-6, config=cfg),
             lambda: hc_combine_read_ref(x, inject, u, norm_w, w_down, w_up, w_inj, HC, 1e-6), tol=(2e-2, 2e-2),
             full=True)
        case(runner, "hc_combine", M, "-", f"x [{M}, {wide}]", "-", lambda: hc_combine(x, inject, u),
             lambda: hc_combine_ref(x, inject, u), tol=(1e-3, 1e-3), full=True)
        case(runner, "zc_rms_norm", M, "HC norm (group 2560)", f"x [{M}, {wide}]", "-",
             lambda: zc_rms_norm(x, norm_w, 1e-6, H), lambda: zc_rms_norm_ref(x, norm_w, 1e-6, H), tol=(2e-3, 2e-3),
             full=True)
        o = torch.randn(M, HV, DV, generator=gen).to(torch.float16)
        z = torch.randn(M, HV * DV, generator=gen).to(torch.float16).view(M, HV, DV)
        gw = torch.randn(DV, generator=gen).to(torch.float16)
        case(runner, "gated_rms_norm", M, "GDN out", f"o, z [{M}, 48, 128]", "-",
             lambda: gated_rms_norm(o, gw, z, 1e-6), lambda: gated_rms_norm_ref(o, gw, z, 1e-6), tol=(2e-3, 2e-3),
             full=True)
        qg = torch.randn(M, HQ, 2 * DH, generator=gen).to(torch.float16)
        q = qg[..., :DH]  # a head-strided view of q_proj's output, as the layer passes it
        cos, sin = torch.rand(M, ROT, generator=gen), torch.rand(M, ROT, generator=gen)
        qw = torch.randn(DH, generator=gen).to(torch.float16) * 0.1
        case(runner, "zc_norm_rope", M, "QSA q", f"q [{M}, 24, 256] (head stride 512) rot {ROT}", "-",
             lambda: zc_norm_rope(q, qw, 1e-6, cos, sin), lambda: zc_norm_rope_ref(q, qw, 1e-6, cos, sin),
             tol=(2e-3, 2e-3), full=True)
        case(runner, "apply_rope", M, "QSA q", f"q [{M}, 24, 256] (head stride 512) rot {ROT}", "-",
             lambda: apply_rope(q, cos, sin), lambda: apply_rope_ref(q, cos, sin), tol=(2e-3, 2e-3), full=True)


# ---- PLE and sampling -----------------------------------------------------------------------------------------------

VOCAB = 248_320


def ple_cases(runner: Runner, gen: torch.Generator, args) -> None:
    from revolta.kernels.ple_gather import FP8, ple_gather, ple_gather_ref
    from revolta.kernels.ple_rows import ple_rows, ple_rows_ref
    from revolta.layers.ngram import hash_multipliers, head_table_sizes

    heads, per, order, row_w = 16, 8, 3, 160  # (ngram 3 - 1) x 8 heads of 2560 / 16 values
    sizes = head_table_sizes(20_000_000, heads, 0)  # the real table: 20M-row heads, ~320M rows
    offsets = torch.tensor([sum(sizes[:i]) for i in range(heads)], dtype=torch.int64)
    sizes_t = torch.tensor(sizes, dtype=torch.int64)
    mult = torch.tensor(hash_multipliers(VOCAB, order, 0, 1234), dtype=torch.int64)
    B, T = NS, ROWS_PER_SEQ
    pool = B * (1 + T) + 2
    for rows_per_seq in (1, T):
        R = B * rows_per_seq
        ids = torch.randint(VOCAB - 1000, VOCAB, (R,), generator=gen)  # near the vocabulary's end
        cu = torch.arange(0, R + 1, rows_per_seq, dtype=torch.int32)
        ctx = torch.randint(VOCAB - 1000, VOCAB, (pool, order - 1), generator=gen)
        slots = torch.arange(pool - B, pool, dtype=torch.int32)
        init = torch.ones(B, dtype=torch.bool)
        store = rows_per_seq == 1  # a verify step does not store
        c1, c2 = ctx.clone(), ctx.clone()
        case(runner, "ple_rows", R, "decode" if store else "verify", f"ids [{R}], {heads} heads of ~20M rows",
             f"BLOCK_T={rows_per_seq}",
             lambda: (*ple_rows(ids, cu, c1, slots, init, mult, sizes_t, offsets, per, VOCAB - 276, rows_per_seq,
                                store=store), c1),
             lambda: (*ple_rows_ref(ids, cu, c2, slots, init, mult, sizes_t, offsets, per, VOCAB - 276, rows_per_seq,
                                    store=store), c2), tol=(0, 0), full=True)
    table_rows = 4096  # few rows, the real width; the looked-up rows at the table's end
    table = torch.randint(0, 120, (table_rows, row_w), dtype=torch.uint8, generator=gen).view(FP8)
    scale = torch.tensor([0.01])
    for R in (1, 8, 40):
        rows = torch.randint(table_rows - 64, table_rows, (R, heads), generator=gen)
        rows[-1, -1] = table_rows - 1
        o1, o2 = torch.empty(R, heads * row_w, dtype=torch.float16), torch.zeros(R, heads * row_w, dtype=torch.float16)
        case(runner, "ple_gather", R, "FP8 table", f"table [{table_rows}, {row_w}] rows [{R}, 16]", "-",
             lambda: ple_gather(table, rows, scale, o1.fill_(float("nan"))), lambda: ple_gather_ref(table, rows, scale, o2),
             tol=(1e-3, 1e-3), full=True)


def sample_cases(runner: Runner, gen: torch.Generator, args) -> None:
    from revolta.kernels.sample import (
        greedy,
        greedy_ref,
        sample_from_logits,
        sample_from_logits_ref,
    )

    for N in (8, 40):
        logits = torch.randn(N, VOCAB, generator=gen) * 3
        logits[-1, -1] = 50.0  # the last row's maximum at the last id
        case(runner, "greedy", N, "argmax", f"logits [{N}, {VOCAB}] fp32", "BLOCK_V=4096",
             lambda: greedy(logits), lambda: greedy_ref(logits), tol=(0, 0))
        temp = torch.full((N,), 0.8)
        top_k = torch.full((N,), 50, dtype=torch.int32)
        top_p, min_p = torch.full((N,), 0.9), torch.zeros(N)
        seeds, offs = torch.arange(N, dtype=torch.int64) + 7, torch.arange(N, dtype=torch.int64) * 1000
        case(runner, "sample_from_logits", N, "T 0.8 top-k 50 top-p 0.9", f"logits [{N}, {VOCAB}] fp32",
             "BLOCK_V=4096", lambda: sample_from_logits(logits, temp, top_k, top_p, min_p, seeds, offs),
             lambda: sample_from_logits_ref(logits, temp, top_k, top_p, min_p, seeds, offs), tol=(0, 0))


# ---- main --------------------------------------------------------------------------------------------------------

SECTIONS = {"moe": moe_cases, "gemv": gemv_cases, "gdn": gdn_cases, "qsa": qsa_cases, "hc": hc_cases, "ple": ple_cases,
            "sample": sample_cases}


def _args(ap) -> None:
    ap.add_argument("--experts", type=int, default=E, help="routed experts of the MoE cases (512: the real count)")


def main(argv=None) -> int:
    return sweep_main(__doc__, SECTIONS, _args, "every program of every grid (hours on 2 cores)", argv)


if __name__ == "__main__":
    sys.exit(main())

"""Out-of-bounds sweep of the full-size model's PREFILL Triton kernels at the real widths and long contexts, on the CPU
under the Triton interpreter (the prefill sibling of bounds_real_widths.py, which covered decode / verify / draft;
benchmarks/RESULTS.md K1: a GDN variant run on the H200 died with a CUDA illegal memory access among the 1 x 32K
candidates).

    TRITON_INTERPRET=1 PYTHONPATH=$PWD/src python benchmarks/bounds_prefill.py [--only gdn,qsa,moe,quant,misc]
        [--gdn-shapes 8x1K,1x8K,1x32K] [--experts 512] [--full]

Runs each kernel entry point once with the H200's configs (sm90, 132 SMs) inside
tests/interpreter_bounds.bounds_checked, outputs NaN-poisoned, long grid axes sampled to their boundary programs
(interpreter_sweep.Runner; `~n` in the grid column: programs run), finished outputs compared with the torch
reference where the reference is affordable on 2 cores (else `-`: bounds only). Real widths (config.py / standin.py):
hidden 2560; GDN 16 k-heads / 48 v-heads of 128, conv width 4 (q | k | v = 10240 conv channels, q / k / v passed as
column views of the conv output, as the layer does); QSA 24 q / 2 KV heads of 256, indexer 4 x 128, ratio 4, budget
512, 256-token pages (AUTO_BLOCK_SIZE); MoE 512 experts + shared, top-10, ffn 640; AWQ int4 group 32.

Cases:
  gdn: causal_conv1d_varlen (+ its state update) and gdn_chunk_prefill (index, intra, walk / prescan + merge + split
    walk, output) at 8 x 1K, 1 x 8K, 1 x 32K tokens, fp16 and bf16 (bf16 dots are wrong in the interpreter: its
    rows are bounds only), with and without initial states from a slot pool (slots at the pool's end), for the
    default config and every candidate of kernels/gdn/chunk_variants.py (bench_gdn's k1_variants order). Candidates
    that differ only in warps / stages have the same address pattern in the interpreter, so candidates are grouped
    by what changes addresses (tile sizes, K halves, whether and how the walk splits at that length): one row per
    group, its names listed.
  qsa: one 8,192-token prefill chunk of a request whose context already holds 499,712 tokens (the pool holds its
    1,984 pages, table width 2,048 = a 512K max_model_len, pages taken in reverse order so the highest block ids
    hold the oldest tokens) in fp16 ("auto"), fp8_e4m3 and int8 KV: store_kv, index_compress, the prefill rows'
    selection (select_step_rows: score + top-k, 512 rows a launch; the index cache is 16-bit in every format, so it
    runs once) and qsa_prefill's attention given that selection; and a short 8 x 1K prefill (8 fresh requests).
    The same global rows (first two, middle, last two) run in every kernel; bounds only (no reference rows).
  moe: moe_route, fused_moe (16-bit, the pairs path at M = 8192: moe_align + gate_up / down + sum) and
    quant_fused_moe (packed AWQ) at M = 8192: 90,112 pairs take its large-M path (awq_dequantize per touched
    expert + torch matmuls, quant/moe.py `_expert_loop`), not the grouped kernels (<= 1,024 pairs).
  quant: awq_dequantize (the large-M path's Triton kernel: dequant_matmul slices of <= 64 MiB then F.linear) at every
    packed projection.
  misc: zc_rms_norm, gated_rms_norm, zc_norm_rope, apply_rope, hc_read / hc_combine, gdn_gates, ple_gather (FP8
    table rows) at M = 8192; sample_from_logits / greedy over the last rows of a prefill step (8 rows).

int32 offsets read for prefill and long contexts (the interpreter computes int32 offsets like the GPU, but only the
shapes it runs can show an overflow):
  GDN chunk state h [NT, HV, K, V]: at 1 x 32K NT <= 513, 513 * 48 * 128 * 128 = 403M elements (0.81 GB in 16 bit);
    the walk's and the output's h offsets are `(chunk.to(int64) * HV + hv) * (K * V)` (int64). The split walk's
    hm [S, HV, K, V + K] fp32 and h_start [S, HV, K, V] fp32 (S <= 18 at 32K) use `i_s.to(int64)`. Token-major
    tensors w, u, v_new, o [T, HV, 128] at 32K: 201M elements, offsets from `o_t` (int64: `_chunk_rows`, `_load_u`,
    `_walk_chunk`), gcum / k_rstd `o_t * HV` int64; k / q rows `o_t * stride` int64 (stride 10240: 335M at 32K).
    The slot pool `slot.to(int64) * (HV * K * V)`. Within-head offsets (K * V = 16K) int32.
  conv1d varlen: token rows `src.to(int64) * stride_x`, `o_t.to(int64) * stride_y`, the state `slot (int64) *
    stride_slot`; T * 10240 = 335M at 32K, 5.4G at 512K in one step would need int64 (it has it).
  QSA at ~508K context: paged K / V `page.to(int64) * stride_kb` (pool of 2K pages x 131,072 elements = 268M per
    cache: below 2^31 here, but the engine's multi-layer pools are larger; int64 regardless); FP8 / int8 scales
    `(page * (BLOCK // DCP) + off) * KVH + kvh` with page int64; the block table `b.to(int64) * stride_btb + tok //
    BLOCK`; the token index tok <= 512K and group ids <= 128K (int32, fine); score workspace `r.to(int64) *
    stride_sr + j` ([rows, 131,072] fp32: select_step_rows cuts it to 256 MiB = 512 rows at a time); top-k rows
    `r.to(int64)`; attention partials `(r64 * KVH * G + heads) * splits + s` int64; store_kv's slot int64;
    index_compress's page ids int64.
  MoE pairs at M = 8192: T = M * 11 = 90,112 slots; `b_sid.to(int64) * stride_am`, `b_tok (int64) * stride_xm`,
    expert bases `i_e (int64) * stride_we` (512 x 1280 x 2560 = 1.68G elements for gate_up: int64 needed, had);
    packed tile path likewise int64 (bounds_real_widths.py). awq_dequantize writes at most [N, K] = 12288 x 2560.
  HC / norms at M = 8192: rows `m * 10240` = 84M (int32, fine; 2^31 would need M > 209K rows in one step).
Left out: qsa_partial (DCP only), the multimodal kernels; the PLE row ids are no Triton launch in prefill (ple_rows
takes its torch path above MAX_BLOCK_T = 16 new tokens a sequence).
"""

# ruff: noqa: B023 - case() runs its two callables before the loop that made them moves on
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from bounds_real_widths import (
    ARCH,
    CONV_DIM,
    DH,
    DI,
    DK,
    DV,
    HC,
    HI,
    HK,
    HQ,
    HV,
    I_FFN,
    KVH,
    PAGE,
    PROJECTIONS,
    RANK,
    RATIO,
    ROT,
    TOP_K,
    VOCAB,
    E,
    G,
    H,
    awq_tensors,
)
from interpreter_sweep import Runner, case, short, sweep_main

BUDGET = 512
CONV_W = 4
GDN_SHAPES = {"8x1K": [1024] * 8, "1x8K": [8192], "1x32K": [32768]}


# ---- GDN chunked prefill --------------------------------------------------------------------------------------------


def gdn_groups(T: int, B: int) -> dict:
    """Candidates of chunk_variants.py grouped by the launch parameters that change addresses at this batch, under
    the walk-split rule of today and the one of the K1 crash run (tree 9a3e24b, before 64a7bcd: split at
    cp_min_tokens whatever the serial walk's program count): key -> [(name, config, segment chunks, rule)]. The key
    holds every field that moves a load or store (tiles, the intra grid, the walk's tiling and load placement)."""
    from revolta.kernels.gdn.chunk_variants import chunk_variants

    groups: dict = {}
    for name, cfg in chunk_variants(DK, DV).items():
        for rule, programs in (("now", cfg.serial_walk_programs(B, HV, DV)), ("9a3e24b", 0)):
            seg = cfg.segment_chunks(T, HV, 132, programs)
            key = (cfg.intra_bk, cfg.intra_bv, cfg.intra_group_heads, cfg.out_bk, cfg.out_bv, cfg.out_vp,
                   cfg.walk_k_halves, cfg.walk_transposed, cfg.walk_prefetch, cfg.walk_stage_u, seg,
                   (cfg.cp_walk_bv, cfg.prescan_bv, cfg.merge_bv) if seg else cfg.walk_bv)
            if all(n != name for n, *_ in groups.get(key, [])):
                groups.setdefault(key, []).append((name, cfg, seg, rule))
    return groups


@dataclasses.dataclass(frozen=True)
class _SplitAsBefore64a7bcd:
    """A ChunkConfig whose walk splits from cp_min_tokens on whatever the serial walk's programs (the rule of the
    K1 crash run's tree), so the launcher takes the path that run took."""
    cfg: object

    def __getattr__(self, name):
        return getattr(self.cfg, name)

    def segment_chunks(self, num_tokens, num_v_heads, num_sms, walk_programs=0):
        return self.cfg.segment_chunks(num_tokens, num_v_heads, num_sms, 0)


def gdn_cases(runner: Runner, gen: torch.Generator, args) -> None:
    from revolta.kernels.conv1d import causal_conv1d_varlen, causal_conv1d_varlen_ref
    from revolta.kernels.gdn.chunk import gdn_chunk_prefill
    from revolta.kernels.gdn.ref import gdn_chunk_prefill_ref

    for shape in args.gdn_shapes.split(","):
        lens = GDN_SHAPES[shape]
        B, T = len(lens), sum(lens)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        pool = B + 4  # the sequences' slots at the pool's end
        slots = torch.arange(pool - B, pool, dtype=torch.int32).flip(0).contiguous()
        x = (torch.randn(T, CONV_DIM, generator=gen) * 0.5).to(torch.float16)
        cw = (torch.randn(CONV_DIM, CONV_W, generator=gen) * 0.5).to(torch.float16)
        cs0 = torch.randn(pool, CONV_W - 1, CONV_DIM, generator=gen).to(torch.float16)
        for init_kind in ("init", "zeros"):
            init = torch.ones(B, dtype=torch.bool) if init_kind == "init" else torch.zeros(B, dtype=torch.bool)
            if B > 1 and init_kind == "init":
                init[::2] = False  # mixed: every other sequence starts fresh
            c1, c2 = cs0.clone(), cs0.clone()
            case(runner, "causal_conv1d_varlen", T, f"silu, {init_kind}", f"x [{T}, {CONV_DIM}] pool {pool}",
                 "BT=16 BC=128",
                 lambda: (causal_conv1d_varlen(x, cw, c1, slots, cu, init, "silu"), c1),
                 lambda: (causal_conv1d_varlen_ref(x, cw, c2, slots, cu, init, "silu"), c2), tol=(2e-2, 2e-2),
                 picks={("_causal_conv1d_state_kernel", a): range(4096) for a in (0, 1)})
        groups = gdn_groups(T, B)
        for dtype in (torch.float16, torch.bfloat16):
            buf = torch.randn(T, CONV_DIM, generator=gen).to(dtype)  # the conv output: q | k | v columns
            q = buf[:, : HK * DK].unflatten(-1, (HK, DK))
            k = buf[:, HK * DK: 2 * HK * DK].unflatten(-1, (HK, DK))
            v = buf[:, 2 * HK * DK:].unflatten(-1, (HV, DV))
            g = -torch.rand(T, HV, generator=gen) * 0.1
            beta = torch.rand(T, HV, generator=gen)
            state0 = torch.randn(pool, HV, DK, DV, generator=gen) * 0.1
            dt = str(dtype).split(".")[-1]
            refs: dict = {}  # the reference output per initial-state kind, shared by the candidates
            ref_o = lambda kind, fn: refs[kind] if kind in refs else refs.setdefault(kind, fn())
            for init_kind in ("init", "zeros"):
                init = torch.ones(B, dtype=torch.bool) if init_kind == "init" else torch.zeros(B, dtype=torch.bool)
                if B > 1 and init_kind == "init":
                    init[::2] = False
                for members in groups.values():
                    names = ",".join(n + ("" if r == "now" else "@9a3e24b") for n, _, _, r in members)
                    _, cfg, seg, rule = members[0]
                    run_cfg = cfg if rule == "now" else _SplitAsBefore64a7bcd(cfg)
                    default = members[0][0] == "default"
                    if not default and (dtype != torch.float16 or init_kind != "init"):
                        continue  # candidates: fp16 with initial states (addresses do not depend on the dtype)
                    # picks: every chunk / segment of the first and last v-head, every V tile; others sampled.
                    # The reference (serial over T per sequence) is affordable at 8 x 1K fp16 only; there every
                    # candidate runs every chunk of those heads and is compared (v-head 47's k-head norms come
                    # from v-head 45, which does not run: head 0 is the compared one).
                    compare = shape == "8x1K" and dtype == torch.float16 and init_kind == "init"
                    heads = [0, HV - 1]
                    chunks = range(1 << 20) if compare else None
                    intra_heads = [0, HK - 1] if cfg.intra_group_heads else heads  # its grid: (chunk, k head)
                    picks = {("_gdn_chunk_intra_kernel", 1): intra_heads, ("_gdn_chunk_walk_kernel", 2): heads,
                             ("_gdn_chunk_prescan_kernel", 2): heads, ("_gdn_chunk_merge_kernel", 2): heads,
                             ("_gdn_chunk_o_kernel", 2): heads}
                    if compare:
                        picks |= {("_gdn_chunk_intra_kernel", 0): chunks, ("_gdn_chunk_o_kernel", 1): chunks,
                                  ("_gdn_chunk_walk_kernel", 1): chunks, ("_gdn_chunk_prescan_kernel", 1): chunks}
                    st1, st2 = state0.clone(), state0.clone()
                    keys = ("walk_bv", "cp_walk_bv", "walk_k_halves", "walk_transposed", "walk_prefetch",
                            "walk_stage_u", "out_vp", "out_bv", "intra_bk", "intra_group_heads")
                    cfgtxt = short(dataclasses.asdict(cfg), keys) + (f" split seg={seg}" if seg else " serial")
                    case(runner, "gdn_chunk_prefill", T, f"{shape} {dt} {init_kind}",
                         f"q,k [{T}, 16, 128] v [{T}, 48, 128] (stride {CONV_DIM}) pool {pool}",
                         f"[{names}] {cfgtxt}",
                         lambda: gdn_chunk_prefill(q, k, v, g, beta, cu, st1, slots, init, config=run_cfg),
                         (lambda: ref_o(init_kind, lambda: gdn_chunk_prefill_ref(q, k, v, g, beta, cu, st2, slots,
                                                                                   init))) if compare else None,
                         tol=(2e-2, 2e-2), picks=picks)


# ---- QSA prefill at a long context ----------------------------------------------------------------------------------


def qsa_cases(runner: Runner, gen: torch.Generator, args) -> None:
    from revolta.kernels.qsa.common import varlen_rows
    from revolta.kernels.qsa.index_compress import index_compress
    from revolta.kernels.qsa.prefill import (
        SELECT_WORKSPACE_BYTES,
        qsa_prefill,
        select_step_rows,
    )
    from revolta.kernels.qsa.store_kv import store_kv

    worlds = {"508K (499,712 + 8,192)": ([499_712], 8192, 2048), "8 x 1K": ([0] * 8, 1024, 8)}
    for name, (ctx, new, width) in worlds.items():
        B = len(ctx)
        lens = [c + new for c in ctx]
        need = [-(-n // PAGE) for n in lens]
        nb = sum(need) + 2  # block 0 is the null block
        table = torch.zeros(B, width, dtype=torch.int32)
        ids = torch.arange(nb - 1, 0, -1, dtype=torch.int32)  # reverse: the newest tokens on the highest ids
        used = 0
        for b, n in enumerate(need):
            table[b, :n] = ids[used: used + n]
            used += n
        seq = torch.tensor(lens, dtype=torch.int32)
        cu = torch.arange(0, B * new + 1, new, dtype=torch.int32)
        T = B * new
        pos = torch.cat([torch.arange(c, c + new) for c in ctx])
        bidx = torch.arange(B).repeat_interleave(new)
        slot_mapping = table.long()[bidx, pos // PAGE] * PAGE + pos % PAGE
        shp = f"{name}: {T} rows, table [{B}, {width}], {nb} pages"
        ic = torch.randn(nb, PAGE // RATIO, DI, generator=gen).to(torch.float16)
        q = torch.randn(T, HQ, DH, generator=gen).to(torch.float16)
        gate = torch.randn(T, HQ, DH, generator=gen).to(torch.float16)
        iq = torch.randn(T, HI, DI, generator=gen).to(torch.float16)
        for kv in ("auto", "fp8_e4m3", "int8"):
            k = torch.randn(T, KVH, DH, generator=gen).to(torch.float16)
            v = torch.randn(T, KVH, DH, generator=gen).to(torch.float16)
            if kv == "auto":
                kc = torch.randn(nb, PAGE, KVH, DH, generator=gen).to(torch.float16)
                vc = torch.randn(nb, PAGE, KVH, DH, generator=gen).to(torch.float16)
                ks = vs = None
            elif kv == "fp8_e4m3":
                ks, vs = torch.tensor([0.05]), torch.tensor([0.05])
                kc = torch.randint(0, 120, (nb, PAGE, KVH, DH), dtype=torch.uint8, generator=gen)
                vc = torch.randint(0, 120, (nb, PAGE, KVH, DH), dtype=torch.uint8, generator=gen)
            else:
                kc = torch.randint(-100, 100, (nb, PAGE, KVH, DH), dtype=torch.int8, generator=gen)
                vc = torch.randint(-100, 100, (nb, PAGE, KVH, DH), dtype=torch.int8, generator=gen)
                ks = torch.rand(nb, PAGE, KVH, generator=gen) * 0.02
                vs = torch.rand(nb, PAGE, KVH, generator=gen) * 0.02
            rows = [0, 1, T // 2, T - 2, T - 1]
            case(runner, "store_kv", T, kv, shp, f"grid T={T} (~5 rows)",
                 lambda: store_kv(k, v, kc, vc, slot_mapping, kv, ks, vs), None,
                 picks={("_store_kv_kernel", 0): rows})
            if kv == "auto":
                proj = torch.randn(T, HI * DI + DI, generator=gen).to(torch.float16)
                raw = proj[:, HI * DI:]
                cos, sin = torch.rand(T, ROT, generator=gen), torch.rand(T, ROT, generator=gen)
                pend = torch.randn(B + 2, 8, DI, generator=gen).to(torch.float16)
                pcos, psin = torch.rand(B, ROT, generator=gen), torch.rand(B, ROT, generator=gen)
                nw = torch.randn(DI, generator=gen) * 0.1
                pslots = torch.arange(2, B + 2, dtype=torch.int32)
                case(runner, "index_compress", T, "auto (fp16)", shp, "grid (B, groups) sampled",
                     lambda: index_compress(raw, cos, sin, pend, pcos, psin, nw, 1e-6, ic, table, cu, seq, pslots,
                                            new), None)
            # select_step_rows scores and selects `per` rows a launch; the same global rows run in every kernel
            # (first, middle, last), so the attention reads only selections that were made. The index cache is
            # 16-bit in every KV format: the selection runs once, the attention once per format.
            per = max(1, SELECT_WORKSPACE_BYTES // (4 * width * (PAGE // RATIO)))
            sliced = lambda n, launch: [r - launch * per for r in rows]
            if kv == "auto":
                row_req, row_pos = varlen_rows(cu, seq, T)
                sel = [None]
                case(runner, "qsa select (prefill rows)", T, "select_step_rows", shp + f", budget {BUDGET}",
                     f"{per} rows a launch, BN=32 CHUNK=2048",
                     lambda: sel.__setitem__(0, select_step_rows(iq, ic, table, seq, row_req, row_pos, BUDGET, RATIO)),
                     None, picks={("_index_score_kernel", 0): sliced, ("_topk_kernel", 0): sliced,
                                  ("_index_score_kernel", 1): range(4096)})
            case(runner, "qsa_prefill (attend)", T, kv, shp + f", q [{T}, 24, 256]", "attend_rows BN=32",
                 lambda: qsa_prefill(q, gate, kc, vc, table, cu, seq, DH ** -0.5, BUDGET, selected=sel[0],
                                     kv_dtype=kv, k_scale=ks, v_scale=vs, ratio=RATIO), None,
                 picks={("_qsa_attn_kernel", 0): rows, ("_combine_kernel", 0): rows})


# ---- MoE and packed linears at M = 8192 -----------------------------------------------------------------------------


def moe_cases(runner: Runner, gen: torch.Generator, args) -> None:
    from revolta.kernels.moe import fused_moe, moe_config, moe_route
    from revolta.kernels.quant.moe import (
        PackedWeights,
        quant_fused_moe,
    )

    M, E_ = 8192, args.experts
    logits = (torch.rand(M, E_, generator=gen) * 6 - 3).to(torch.float16)
    shared_logit = torch.randn(M, generator=gen).to(torch.float16)
    case(runner, "moe_route", M, "sm90", f"logits [{M}, {E_}] + shared", "top10 renorm",
         lambda: moe_route(logits, TOP_K, True, shared_logits=shared_logit),
         None)
    ids = torch.stack([torch.randperm(E_, generator=gen)[:TOP_K] for _ in range(M)])
    ids[0, 0], ids[-1, -1] = E_ - 1, 0
    ids = torch.cat([ids, torch.full((M, 1), E_)], 1).to(torch.int32)
    w = torch.rand(M, TOP_K + 1, generator=gen)
    w = (w / w.sum(1, keepdim=True)).float()
    x = torch.randn(M, H, generator=gen).to(torch.float16)
    gate_up = torch.empty(E_, 2 * I_FFN, H, dtype=torch.float16).normal_(0, H ** -0.5, generator=gen)
    down = torch.empty(E_, H, I_FFN, dtype=torch.float16).normal_(0, I_FFN ** -0.5, generator=gen)
    shared = (gate_up[0, :I_FFN].clone(), gate_up[0, I_FFN:].clone(), down[0].clone())
    cfg = moe_config(M, TOP_K + 1, E_ + 1, ARCH)
    # moe_align runs whole (its outputs address everything after); of the expert blocks, the boundary ones run:
    # the first, the middle, the last non-empty (the shared expert's last rows) and the first padding block
    counts = torch.bincount(ids.flatten().long(), minlength=E_ + 1)
    used = int((-(-counts // cfg["BLOCK_M"])).sum())
    blocks = [0, 1, used // 2, used - 2, used - 1, used, used + 1, 1 << 30]
    picks = {(kn, 0): range(1 << 20) for kn in ("_moe_count_kernel", "_moe_prefix_kernel", "_moe_scatter_kernel")}
    picks |= {(kn, 0): (lambda n, _: [b if b < n else n - 1 for b in blocks])
              for kn in ("_moe_gate_up_kernel", "_moe_down_kernel")}
    case(runner, "fused_moe", M, "16-bit pairs" if not cfg.get("GROUPED") else "16-bit grouped",
         f"x [{M}, {H}] E {E_}+1 I {I_FFN} top{TOP_K}+1, {used} expert blocks",
         short(cfg, ("BLOCK_M", "BLOCK_N_UP", "BLOCK_N_DOWN")),
         lambda: fused_moe(x, gate_up, down, ids, w, shared_expert=shared, config=cfg), None, picks=picks)
    gate_up = down = shared = None  # 5 GB of 16-bit experts
    pg = PackedWeights("awq", awq_tensors((E_,), 2 * I_FFN, H, gen), G)
    pd = PackedWeights("awq", awq_tensors((E_,), H, I_FFN, gen), G)
    pshared = tuple(PackedWeights("awq", awq_tensors((), n, kk, gen), G) for n, kk in
                    ((I_FFN, H), (I_FFN, H), (H, I_FFN)))
    # M * 11 pairs > GROUPED_MAX_PAIRS: the packed experts' prefill path dequantizes each touched expert (Triton)
    # and multiplies in torch (quant/moe.py `_expert_loop`)
    case(runner, "quant_fused_moe", M, "packed AWQ, large M", f"x [{M}, {H}] E {E_}+1 I {I_FFN} top{TOP_K}+1",
         "expert loop: awq_dequantize + torch", lambda: quant_fused_moe(x, pg, pd, ids, w, shared_expert=pshared),
         None)


def quant_cases(runner: Runner, gen: torch.Generator, args) -> None:
    from revolta.kernels.quant.awq import awq_dequantize, awq_dequantize_ref
    from revolta.kernels.quant.common import DEQUANT_CHUNK_BYTES

    for what, (N, K) in PROJECTIONS.items():
        qw, qz, sc = awq_tensors((), N, K, gen)
        rows = max(64, DEQUANT_CHUNK_BYTES // (K * 2) // 64 * 64)  # dequant_matmul's slice at M = 8192, fp16
        n0 = (N - 1) // rows * rows  # the last slice: the highest rows
        case(runner, "awq_dequantize", 8192, "large-M slice", f"{what} W [{N}, {K}] rows {n0}:{N}", "BK=32 BN=64",
             lambda: awq_dequantize(qw, qz, sc, G, torch.float16, (n0, N)),
             lambda: awq_dequantize_ref(qw, qz, sc, G, torch.float16)[n0:N], tol=(1e-3, 1e-3))


# ---- norms, RoPE, HC, gates, sampling at M = 8192 -------------------------------------------------------------------


def misc_cases(runner: Runner, gen: torch.Generator, args) -> None:
    from revolta.kernels.gdn.gates import gdn_gates, gdn_gates_ref
    from revolta.kernels.hc import hc_config, hc_read, hc_read_ref
    from revolta.kernels.hc_combine import hc_combine, hc_combine_ref
    from revolta.kernels.norm import (
        gated_rms_norm,
        gated_rms_norm_ref,
        zc_rms_norm,
        zc_rms_norm_ref,
    )
    from revolta.kernels.norm_rope import zc_norm_rope, zc_norm_rope_ref
    from revolta.kernels.ple_gather import FP8, ple_gather, ple_gather_ref
    from revolta.kernels.rope import apply_rope, apply_rope_ref
    from revolta.kernels.sample import (
        greedy,
        greedy_ref,
        sample_from_logits,
        sample_from_logits_ref,
    )

    M = 8192
    wide = HC * H
    x = torch.randn(M, wide, generator=gen).to(torch.float16)
    norm_w = (torch.randn(wide, generator=gen) * 0.1).to(torch.float16)
    w_down = (torch.randn(RANK, wide, generator=gen) * wide ** -0.5).to(torch.float16)
    w_up = (torch.randn(wide, RANK, generator=gen) * RANK ** -0.5).to(torch.float16)
    w_inj = (torch.randn(HC, wide, generator=gen) * wide ** -0.5).to(torch.float16)
    cfg = hc_config(M, H, RANK, HC, ARCH)
    case(runner, "hc_read", M, "sm90 " + str(cfg.get("KIND")), f"x [{M}, {wide}] r {RANK}",
         short(cfg, ("KIND", "BLOCK_M", "BLOCK_R", "BLOCK_K", "BLOCK_C")),
         lambda: hc_read(x, norm_w, w_down, w_up, w_inj, HC, 1e-6, config=cfg),
         lambda: hc_read_ref(x, norm_w, w_down, w_up, w_inj, HC, 1e-6), tol=(2e-2, 2e-2))
    inject = torch.rand(M, HC, generator=gen).to(torch.float16) * 2
    u = torch.randn(M, H, generator=gen).to(torch.float16)
    case(runner, "hc_combine", M, "-", f"x [{M}, {wide}]", "-", lambda: hc_combine(x, inject, u),
         lambda: hc_combine_ref(x, inject, u), tol=(1e-3, 1e-3))
    case(runner, "zc_rms_norm", M, "HC norm (group 2560)", f"x [{M}, {wide}]", "-",
         lambda: zc_rms_norm(x, norm_w, 1e-6, H), lambda: zc_rms_norm_ref(x, norm_w, 1e-6, H), tol=(2e-3, 2e-3))
    o = torch.randn(M, HV, DV, generator=gen).to(torch.float16)
    z = torch.randn(M, HV * DV, generator=gen).to(torch.float16).view(M, HV, DV)
    gw = torch.randn(DV, generator=gen).to(torch.float16)
    case(runner, "gated_rms_norm", M, "GDN out", f"o, z [{M}, 48, 128]", "-",
         lambda: gated_rms_norm(o, gw, z, 1e-6), lambda: gated_rms_norm_ref(o, gw, z, 1e-6), tol=(2e-3, 2e-3))
    qg = torch.randn(M, HQ, 2 * DH, generator=gen).to(torch.float16)
    q = qg[..., :DH]
    cos, sin = torch.rand(M, ROT, generator=gen), torch.rand(M, ROT, generator=gen)
    qw = torch.randn(DH, generator=gen).to(torch.float16) * 0.1
    case(runner, "zc_norm_rope", M, "QSA q", f"q [{M}, 24, 256] (head stride 512) rot {ROT}", "-",
         lambda: zc_norm_rope(q, qw, 1e-6, cos, sin), lambda: zc_norm_rope_ref(q, qw, 1e-6, cos, sin),
         tol=(2e-3, 2e-3))
    case(runner, "apply_rope", M, "QSA q", f"q [{M}, 24, 256] (head stride 512) rot {ROT}", "-",
         lambda: apply_rope(q, cos, sin), lambda: apply_rope_ref(q, cos, sin), tol=(2e-3, 2e-3))
    ba = torch.randn(M, 2 * HV, generator=gen).to(torch.float16)
    a, b = ba[:, :HV], ba[:, HV:]
    A_log, dt_bias = torch.rand(HV, generator=gen), torch.rand(HV, generator=gen)
    case(runner, "gdn_gates", M, "prefill", f"a, b [{M}, 48] strided", "-",
         lambda: gdn_gates(a, b, A_log, dt_bias), lambda: gdn_gates_ref(a, b, A_log, dt_bias), tol=(1e-5, 1e-5))
    table_rows, row_w, heads = 4096, 160, 16  # few rows of the real FP8 row width; looked-up rows at the table's end
    table = torch.randint(0, 120, (table_rows, row_w), dtype=torch.uint8, generator=gen).view(FP8)
    rows = torch.randint(table_rows - 64, table_rows, (M, heads), generator=gen)
    rows[-1, -1] = table_rows - 1
    scale = torch.tensor([0.01])
    out1, out2 = torch.empty(M, heads * row_w, dtype=torch.float16), torch.zeros(M, heads * row_w, dtype=torch.float16)
    case(runner, "ple_gather", M, "FP8 table", f"table [{table_rows}, {row_w}] rows [{M}, 16]", "-",
         lambda: ple_gather(table, rows, scale, out1.fill_(float("nan"))), lambda: ple_gather_ref(table, rows, scale, out2),
         tol=(1e-3, 1e-3))
    N = 8  # the last row of each of 8 prefill requests
    logits = torch.randn(N, VOCAB, generator=gen) * 3
    logits[-1, -1] = 50.0
    case(runner, "greedy", N, "last rows", f"logits [{N}, {VOCAB}] fp32", "BLOCK_V=4096",
         lambda: greedy(logits), lambda: greedy_ref(logits), tol=(0, 0))
    temp, top_k = torch.full((N,), 0.8), torch.full((N,), 50, dtype=torch.int32)
    top_p, min_p = torch.full((N,), 0.9), torch.zeros(N)
    seeds, offs = torch.arange(N, dtype=torch.int64) + 7, torch.arange(N, dtype=torch.int64) * 1000
    case(runner, "sample_from_logits", N, "last rows", f"logits [{N}, {VOCAB}] fp32", "BLOCK_V=4096",
         lambda: sample_from_logits(logits, temp, top_k, top_p, min_p, seeds, offs),
         lambda: sample_from_logits_ref(logits, temp, top_k, top_p, min_p, seeds, offs), tol=(0, 0))


SECTIONS = {"gdn": gdn_cases, "qsa": qsa_cases, "moe": moe_cases, "quant": quant_cases, "misc": misc_cases}


def _args(ap) -> None:
    ap.add_argument("--gdn-shapes", default=",".join(GDN_SHAPES), help=f"of {list(GDN_SHAPES)}")
    ap.add_argument("--experts", type=int, default=E, help="routed experts of the MoE cases (512: the real count)")


def main(argv=None) -> int:
    return sweep_main(__doc__, SECTIONS, _args, "every program of every grid (days on 2 cores)", argv)


if __name__ == "__main__":
    sys.exit(main())

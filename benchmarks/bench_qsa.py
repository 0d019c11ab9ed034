"""K4 (spec/performance.md §6.2): QSA sparse decode = indexer score -> top-k -> 2,048-token attention.

One script, one GPU: correctness vs the torch refs first (small shapes), then timing with
triton.testing.do_bench over rotating input sets (> 60 MB of KV + index keys in total, so L2 is cold).
Shapes: Hq = 24, KVH = 2, D = 256, 4 index heads x 128, c = 4, budget 512 groups, page 64; contexts
8K / 32K / 128K; batch 1 / 8 / 64; q-rows 1 (and 5 at batch 8); fp16 and E4M3-as-uint8 KV.
Peers in the same run: torch gather + SDPA over the selected tokens, flex_attention with a block mask
(if it runs), dense SDPA over the whole context, torch.topk for the selection stage.
Reports µs per layer, stage split (select vs attend), GB/s of selected KV + compressed keys.
JSON to $OUT (default ./bench_out)/bench_qsa.json; the table prints last.

Usage: python benchmarks/bench_qsa.py [--quick] [--long-max-model-len 262144]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time

import torch
import triton
from triton.testing import do_bench

from revolta.kernels.qsa import (qsa_select_decode, qsa_select_decode_ref, qsa_sparse_decode, qsa_sparse_decode_ref,
                                 store_kv)
from revolta.kernels.qsa.select import _score  # the scoring stage alone, for the stage split

HQ, KVH, D, HI, DI, C, BUDGET, PAGE = 24, 2, 256, 4, 128, 4, 512, 64
COPY_BW = 4.3e12
L2_BYTES = 60 << 20


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        return "?"


def make_world(B, ctx, kv_dtype, rows, dev, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    pages = triton.cdiv(ctx, PAGE)
    nb = B * pages + 1
    table = (torch.randperm(nb - 1, device=dev, generator=g)[: B * pages] + 1).view(B, pages).int()
    if kv_dtype == "fp8_e4m3":
        kc = torch.randint(0, 256, (nb, PAGE, KVH, D), dtype=torch.uint8, device=dev, generator=g)
        kc[(kc & 0x7F) == 0x7F] = 0  # no NaN codes
        vc = kc.flip(0).clone()
        ks, vs = torch.tensor([0.01], device=dev), torch.tensor([0.01], device=dev)
    else:
        kc = torch.randn(nb, PAGE, KVH, D, dtype=torch.float16, device=dev, generator=g)
        vc = torch.randn(nb, PAGE, KVH, D, dtype=torch.float16, device=dev, generator=g)
        ks = vs = None
    icache = torch.randn(nb, PAGE // C, DI, dtype=torch.float16, device=dev, generator=g)
    seq = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    shape = (B, rows) if rows > 1 else (B,)
    q = torch.randn(*shape, HQ, D, dtype=torch.float16, device=dev, generator=g)
    gate = torch.randn(*shape, HQ, D, dtype=torch.float16, device=dev, generator=g)
    iq = torch.randn(*shape, HI, DI, dtype=torch.float16, device=dev, generator=g)
    return dict(ctx=ctx, kc=kc, vc=vc, ks=ks, vs=vs, icache=icache, table=table, seq=seq, q=q, gate=gate, iq=iq,
                kv_dtype=kv_dtype, bytes=kc.numel() * kc.element_size() * 2 + icache.numel() * 2)


def ours_select(w):
    return qsa_select_decode(w["iq"], w["icache"], w["table"], w["seq"], BUDGET)


def scores_only(w):
    """The index scoring alone (select = scoring + the radix top-k), in the [B, Q] form qsa_select_decode takes."""
    q = w["iq"].shape[1] if w["iq"].dim() == 4 else 1
    return _score(w["iq"].reshape(-1, HI, DI), w["icache"], w["table"], w["seq"], None, None, BUDGET, C, q, False,
                  None)


def ours_attend(w, sel):
    return qsa_sparse_decode(w["q"], w["gate"], w["kc"], w["vc"], w["table"], w["seq"], sel, 1 / math.sqrt(D),
                             w["kv_dtype"], w["ks"], w["vs"])


def torch_select(w):
    """Peer: dense scores in torch + torch.topk (ties undefined), single row per request."""
    B = w["table"].shape[0]
    n = w["ctx"] // C
    j = torch.arange(n, device=w["seq"].device)
    pages = w["table"].long()[:, (j * C) // PAGE]  # [B, n]
    keys = w["icache"][pages, (j * C % PAGE) // C]  # [B, n, Di]
    iq = w["iq"].reshape(B, -1, HI, DI)[:, -1]
    s = torch.einsum("bhd,bnd->bhn", iq.float(), keys.float()).relu().sum(1)
    return torch.topk(s, min(BUDGET, n), dim=-1).indices


def _dequant(x, scale):
    if x.dtype == torch.uint8:
        return (x.view(torch.float8_e4m3fn).to(torch.float16) * scale.half())
    return x


def gather_sdpa(w, sel):
    """Peer: gather the selected tokens (+ tail) with torch, then SDPA (GQA expanded)."""
    B = w["table"].shape[0]
    ctx = w["ctx"]
    n = ctx // C
    groups = sel.reshape(B, -1, sel.shape[-1])[:, -1].long()
    toks = (groups[:, :, None] * C + torch.arange(C, device=groups.device)).flatten(1)
    tail = torch.arange(n * C, ctx, device=groups.device).expand(B, -1)
    toks = torch.cat([toks, tail], 1)
    pages = torch.gather(w["table"].long(), 1, toks // PAGE)
    k = _dequant(w["kc"][pages, toks % PAGE], w["ks"])  # [B, L, KVH, D]
    v = _dequant(w["vc"][pages, toks % PAGE], w["vs"])
    q = w["q"].reshape(B, -1, HQ, D)[:, -1:].transpose(1, 2)  # [B, HQ, 1, D]
    k = k.transpose(1, 2).repeat_interleave(HQ // KVH, 1)
    v = v.transpose(1, 2).repeat_interleave(HQ // KVH, 1)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return o


def dense_sdpa(w):
    """Peer: dense SDPA over the whole (contiguous, pre-laid-out) context: what QSA saves."""
    return torch.nn.functional.scaled_dot_product_attention(w["dq"], w["dk"], w["dv"], enable_gqa=True)


def check_correctness(dev):
    torch.manual_seed(0)
    out = []
    for kv_dtype in ("auto", "fp8_e4m3"):
        for rows in (1, 5):
            w = make_world(3, 3000, kv_dtype, rows, dev, 1)
            if kv_dtype == "fp8_e4m3":
                k16 = torch.randn(w["kc"].shape, device=dev).half()
                w["ks"] = (k16.float().abs().max() / 448).reshape(1)
                w["vs"] = w["ks"].clone()
                store_kv(k16.flatten(0, 1), k16.flatten(0, 1).flip(0), w["kc"], w["vc"],
                         torch.arange(k16.shape[0] * PAGE, device=dev), kv_dtype, w["ks"], w["vs"])
            sel = ours_select(w)
            ref_sel = qsa_select_decode_ref(w["iq"], w["icache"], w["table"], w["seq"], BUDGET)
            same = (sel == ref_sel).float().mean().item()
            o = ours_attend(w, sel)
            r = qsa_sparse_decode_ref(w["q"], w["gate"], w["kc"], w["vc"], w["table"], w["seq"], sel,
                                      1 / math.sqrt(D), kv_dtype, w["ks"], w["vs"])
            err = (o.float() - r.float()).abs().max().item()
            ok = err < 2e-2 and same > 0.99
            out.append(dict(kv_dtype=kv_dtype, rows=rows, max_abs_err=err, selection_agreement=same, ok=ok))
            print(f"correctness {kv_dtype} rows={rows}: max|err| {err:.2e}, selection agreement {same:.4f}",
                  "OK" if ok else "FAIL", flush=True)
    return out


def bench(fn, sets):
    """µs per call over rotating input sets (each call uses the next set): CUDA-graph replay of many calls
    (no launch gaps, as decode runs graph-captured), falling back to do_bench if capture fails."""
    i = [0]

    def call():
        fn(sets[i[0] % len(sets)])
        i[0] += 1

    call()
    torch.cuda.synchronize()
    try:
        return triton.testing.do_bench_cudagraph(call, rep=50, return_mode="median") * 1e3
    except Exception as e:  # noqa: BLE001
        print(f"  (graph capture failed: {type(e).__name__}; eager do_bench)", flush=True)
        torch.cuda.synchronize()
        return do_bench(call, warmup=25, rep=100, return_mode="median") * 1e3


def widen(w, max_model_len):
    """The world's block table widened to max_model_len (null page 0 past the context), as the engine's graphs
    capture it: the selection grid is sized by the width, the work should follow the context."""
    B, pages = w["table"].shape
    extra = max(0, triton.cdiv(max_model_len, PAGE) - pages)
    w["table"] = torch.cat([w["table"], w["table"].new_zeros(B, extra)], 1)
    return w


def long_context_rows(dev, max_model_len, args):
    """Selection (index scoring + top-k) and attention of decode rows and MTP4 verify rows at a long
    max_model_len and growing contexts. Checks on the GPU: every verify row's scores and selection are bitwise
    its decode row's, and its attention output too at an equal split count (the engine's spec == no spec)."""
    out = []
    ctxs = (4096, 32768) if args.quick else (4096, 32768, 131072, max_model_len - 8)
    for ctx in ctxs:
        for B in (1, 8):
            w = widen(make_world(B, ctx, "auto", 5, dev, 0), max_model_len)
            groups = w["table"].shape[1] * (PAGE // C)
            ws5 = torch.full((B * 5, groups), float("nan"), device=dev)
            sel5 = qsa_select_decode(w["iq"], w["icache"], w["table"], w["seq"], BUDGET, workspace=ws5).view(B, 5, -1)
            att5 = qsa_sparse_decode(w["q"], w["gate"], w["kc"], w["vc"], w["table"], w["seq"], sel5,
                                     1 / math.sqrt(D), num_splits=8)
            same = True
            for i in range(5):  # row i of each request = a decode at seq_len - 4 + i
                seq1 = w["seq"] - (4 - i)
                ws1 = torch.full((B, groups), float("nan"), device=dev)
                sel1 = qsa_select_decode(w["iq"][:, i].contiguous(), w["icache"], w["table"], seq1, BUDGET,
                                         workspace=ws1)
                att1 = qsa_sparse_decode(w["q"][:, i].contiguous(), w["gate"][:, i].contiguous(), w["kc"], w["vc"],
                                         w["table"], seq1, sel1, 1 / math.sqrt(D), num_splits=8)
                same &= bool(torch.equal(sel5[:, i], sel1)) and bool(torch.equal(att5[:, i], att1)) and bool(
                    torch.equal(ws5.view(B, 5, -1)[:, i].nan_to_num(-1.0), ws1.nan_to_num(-1.0)))
            for q in (1, 5):
                v = dict(w)
                if q == 1:
                    v.update(iq=w["iq"][:, -1].contiguous(), q=w["q"][:, -1].contiguous(),
                             gate=w["gate"][:, -1].contiguous())
                v["sel"] = ours_select(v)
                t_sel = bench(ours_select, [v])
                t_score = bench(scores_only, [v])
                t_att = bench(lambda x: ours_attend(x, x["sel"]), [v])
                idx_bytes = B * (ctx // C) * DI * 2  # each request's compressed keys, read once for all its rows
                row = dict(max_model_len=max_model_len, ctx=ctx, batch=B, q_rows=q, select_us=t_sel, score_us=t_score,
                           topk_us=t_sel - t_score, attend_us=t_att, index_key_gbps=idx_bytes / (t_score * 1e-6) / 1e9,
                           verify_rows_bitwise_decode=same)
                out.append(row)
                print(json.dumps(row), flush=True)
            del w
            torch.cuda.empty_cache()
    print(f"\nQSA selection at max_model_len {max_model_len} (decode q=1, MTP4 verify q=5; µs per layer, CUDA-graph "
          "replay; key GB/s: each request's compressed keys once)")
    print(f"{'ctx':>7} {'B':>3} {'q':>2} {'select':>8} {'(score':>8} {'+ topk)':>8} {'attend':>8} {'key GB/s':>8} "
          f"{'verify==decode':>14}")
    for r in out:
        print(f"{r['ctx']:>7} {r['batch']:>3} {r['q_rows']:>2} {r['select_us']:8.1f} {r['score_us']:8.1f} "
              f"{r['topk_us']:8.1f} {r['attend_us']:8.1f} {r['index_key_gbps']:8.0f} "
              f"{str(r['verify_rows_bitwise_decode']):>14}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--long-max-model-len", type=int, default=0,
                    help="only the long-max_model_len table (e.g. 262144): selection and attention of decode and "
                         "verify rows at growing contexts, verify rows checked bitwise against decode rows")
    args = ap.parse_args()
    dev = "cuda"
    outdir = os.environ.get("OUT", "./bench_out")
    os.makedirs(outdir, exist_ok=True)
    if args.long_max_model_len:
        rows = long_context_rows(dev, args.long_max_model_len, args)
        with open(os.path.join(outdir, "bench_qsa_long.json"), "w") as f:
            json.dump(dict(commit=_commit(), device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
        return 0 if all(r["verify_rows_bitwise_decode"] for r in rows) else 1
    t_start = time.time()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                commit=_commit(), date=datetime.datetime.now().isoformat(timespec="seconds"),
                shapes=dict(Hq=HQ, KVH=KVH, D=D, Hi=HI, Di=DI, c=C, budget_groups=BUDGET, page=PAGE))
    correctness = check_correctness(dev)
    rows_out = []
    ctxs = (8192, 32768) if args.quick else (8192, 32768, 131072)
    for kv_dtype in ("auto", "fp8_e4m3"):
        for ctx in ctxs:
            for B, qrows in ((1, 1), (8, 1), (64, 1), (8, 5)):
                if ctx * B > 131072 * 64 // (2 if kv_dtype == "auto" else 1) or time.time() - t_start > 200:
                    continue
                one = make_world(B, ctx, kv_dtype, qrows, dev, 0)
                nsets = max(1, min(4, triton.cdiv(2 * L2_BYTES, one["bytes"])))
                sets = [one] + [make_world(B, ctx, kv_dtype, qrows, dev, s) for s in range(1, nsets)]
                sels = [ours_select(w) for w in sets]
                for w, s in zip(sets, sels):
                    w["sel"] = s
                t_sel = bench(ours_select, sets)
                t_att = bench(lambda w: ours_attend(w, w["sel"]), sets)
                L = min(ctx // C, BUDGET) * C + ctx % C
                kv_bytes = B * qrows * L * KVH * D * (2 if kv_dtype == "auto" else 1) * 2
                idx_bytes = B * qrows * (ctx // C) * DI * 2
                row = dict(kv_dtype=kv_dtype, ctx=ctx, batch=B, q_rows=qrows, select_us=t_sel, attend_us=t_att,
                           total_us=t_sel + t_att, select_frac=t_sel / (t_sel + t_att),
                           gbps=(kv_bytes + idx_bytes) / ((t_sel + t_att) * 1e-6) / 1e9,
                           roofline_frac=(kv_bytes + idx_bytes) / ((t_sel + t_att) * 1e-6) / COPY_BW,
                           input_sets=nsets)
                if qrows == 1:
                    try:
                        row["peer_topk_us"] = bench(torch_select, sets)
                    except Exception as e:  # noqa: BLE001
                        row["peer_topk_us"] = f"error: {e}"[:200]
                    try:
                        row["peer_gather_sdpa_us"] = bench(lambda w: gather_sdpa(w, w["sel"]), sets)
                    except Exception as e:  # noqa: BLE001
                        row["peer_gather_sdpa_us"] = f"error: {e}"[:200]
                    if kv_dtype == "auto" and B * ctx <= 32768 * 8:
                        try:
                            for w in sets[:2]:
                                w["dq"] = w["q"].view(B, HQ, 1, D)
                                w["dk"] = torch.randn(B, KVH, ctx, D, dtype=torch.float16, device=dev)
                                w["dv"] = torch.randn(B, KVH, ctx, D, dtype=torch.float16, device=dev)
                            row["peer_dense_sdpa_us"] = bench(dense_sdpa, sets[:2])
                            for w in sets[:2]:
                                del w["dq"], w["dk"], w["dv"]
                        except Exception as e:  # noqa: BLE001
                            row["peer_dense_sdpa_us"] = f"error: {e}"[:200]
                        row["peer_flex_us"] = flex_peer(sets[0], B, ctx, dev)
                rows_out.append(row)
                print(json.dumps(row), flush=True)
                del sets, sels
                torch.cuda.empty_cache()
    result = dict(meta=meta, correctness=correctness, rows=rows_out)
    with open(os.path.join(outdir, "bench_qsa.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nK4 QSA decode ({meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta['commit']})")
    hdr = (f"{'kv':>8} {'ctx':>7} {'B':>3} {'q':>2} {'select':>8} {'attend':>8} {'total':>8} {'sel%':>5} "
           f"{'GB/s':>7} {'%4.3T':>6} {'topk':>8} {'gath+sdpa':>9} {'flex':>8} {'dense':>8}")
    print(hdr)

    def f(x):
        return f"{x:8.1f}" if isinstance(x, float) else f"{'-':>8}"

    for r in rows_out:
        print(f"{r['kv_dtype']:>8} {r['ctx']:>7} {r['batch']:>3} {r['q_rows']:>2} {r['select_us']:8.1f} "
              f"{r['attend_us']:8.1f} {r['total_us']:8.1f} {100 * r['select_frac']:5.1f} {r['gbps']:7.0f} "
              f"{100 * r['roofline_frac']:6.1f} {f(r.get('peer_topk_us'))} {f(r.get('peer_gather_sdpa_us')):>9} "
              f"{f(r.get('peer_flex_us'))} {f(r.get('peer_dense_sdpa_us'))}")
    print("times in µs per layer (median, CUDA-graph replay, rotating inputs); GB/s counts selected KV + compressed keys;"
          " peers: torch.topk selection, torch gather+SDPA attend, flex_attention block-sparse, dense SDPA")


def flex_peer(w, B, ctx, dev):
    """flex_attention over the whole (contiguous) context with a block mask of the selected groups."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception as e:  # noqa: BLE001
        return f"error: {e}"[:200]
    try:
        n = ctx // C
        sel = w["sel"].reshape(B, -1, BUDGET)[:, -1].long()
        keep = torch.zeros(B, ctx, dtype=torch.bool, device=dev)
        tok = (sel.clamp_min(0)[:, :, None] * C + torch.arange(C, device=dev)).flatten(1)
        keep.scatter_(1, tok, True)
        keep[:, n * C:] = True

        def mask_mod(b, h, q_idx, kv_idx):
            return keep[b, kv_idx]

        bm = create_block_mask(mask_mod, B, None, 1, ctx, device=dev, BLOCK_SIZE=128)
        q = w["q"].reshape(B, -1, HQ, D)[:, -1:].transpose(1, 2).contiguous()
        k = torch.randn(B, KVH, ctx, D, dtype=torch.float16, device=dev)
        v = torch.randn(B, KVH, ctx, D, dtype=torch.float16, device=dev)
        fa = torch.compile(flex_attention)
        fa(q, k, v, block_mask=bm, enable_gqa=True)
        return do_bench(lambda: fa(q, k, v, block_mask=bm, enable_gqa=True), warmup=10, rep=50,
                        return_mode="median") * 1e3
    except Exception as e:  # noqa: BLE001
        return f"error: {type(e).__name__}: {e}"[:200]


if __name__ == "__main__":
    sys.exit(main())

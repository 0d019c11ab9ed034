"""qsa_sparse_decode (decode + verify rows) and qsa_prefill vs refs, and the whole kernel chain
(store_kv -> index_compress -> select -> attend) vs QSAttention._attend on the same tiny state."""

import pytest
import torch

from revolta.kernels.qsa import (index_compress, qsa_prefill, qsa_prefill_ref, qsa_select_decode, qsa_sparse_decode,
                                 qsa_sparse_decode_ref, store_kv, store_kv_ref)
from test_qsa_helpers import (C, D, DI, HI, HQ, KVH, SCALE, assert_close, block_table_for, nan_poison,  # noqa: F401
                              rope_tables, slots_for, tiny_layer)

CONTEXTS = [1, 5, 11, 12, 63, 130]
NB = 64
TOL = {"auto": 2e-3, "fp8_e4m3": 2e-3, "int8": 4e-3}  # kernel vs ref (ref decodes the same bytes)
TOL_VS_FP16 = {"fp8_e4m3": 0.15, "int8": 0.03}  # quantised kernel vs the fp16 ref, unit-variance data


def _paged(kv_dtype, block_size, lengths, seed, rows=1):
    g = torch.Generator().manual_seed(seed)
    table = block_table_for(lengths, block_size, NB, g)
    k = torch.randn(NB * block_size, KVH, D, generator=g).half()
    v = torch.randn(NB * block_size, KVH, D, generator=g).half()
    dt = {"auto": torch.float16, "fp8_e4m3": torch.uint8, "int8": torch.int8}[kv_dtype]
    kc = torch.zeros(NB, block_size, KVH, D, dtype=dt)
    vc = kc.clone()
    if kv_dtype == "fp8_e4m3":
        ks, vs = k.float().abs().max().reshape(1) / 448, v.float().abs().max().reshape(1) / 448
    elif kv_dtype == "int8":
        ks, vs = torch.zeros(NB, block_size, KVH), torch.zeros(NB, block_size, KVH)
    else:
        ks = vs = None
    store_kv_ref(k, v, kc, vc, torch.arange(NB * block_size), kv_dtype, ks, vs)  # store_kv is tested bit-exact
    ref16 = (k.view(NB, block_size, KVH, D), v.view(NB, block_size, KVH, D))
    shape = (len(lengths), rows, HQ, D) if rows > 1 else (len(lengths), HQ, D)
    q, gate = torch.randn(shape, generator=g).half(), torch.randn(shape, generator=g).half()
    return kc, vc, ks, vs, table, torch.tensor(lengths, dtype=torch.int32), q, gate, ref16


def _selection(lengths, budget, seed, rows=1):
    """A random valid selection (ascending ids, -1 padded) per row."""
    g = torch.Generator().manual_seed(seed + 1)
    sel = torch.full((len(lengths), rows, budget), -1, dtype=torch.int32)
    for b, L in enumerate(lengths):
        for i in range(rows):
            n = (L - rows + i + 1) // C
            k = min(n, budget)
            sel[b, i, :k] = torch.randperm(max(n, 1), generator=g)[:k].sort().values.int() if n else sel[b, i, :k]
    return sel if rows > 1 else sel[:, 0]


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3", "int8"])
@pytest.mark.parametrize("block_size,budget,splits", [(8, 2, 1), (16, 3, 3), (8, 3, None)])
def test_sparse_decode_matches_ref(kv_dtype, block_size, budget, splits, nan_poison):
    kc, vc, ks, vs, table, seq, q, gate, (k16, v16) = _paged(kv_dtype, block_size, CONTEXTS, budget)
    sel = _selection(CONTEXTS, budget, budget)
    out = qsa_sparse_decode(q, gate, kc, vc, table, seq, sel, SCALE, kv_dtype, ks, vs, num_splits=splits)
    ref = qsa_sparse_decode_ref(q, gate, kc, vc, table, seq, sel, SCALE, kv_dtype, ks, vs)
    assert_close("kernel vs ref", ref, out, TOL[kv_dtype])
    if kv_dtype != "auto":
        fp16 = qsa_sparse_decode_ref(q, gate, k16, v16, table, seq, sel, SCALE)
        assert_close("quantised vs fp16", fp16, out, TOL_VS_FP16[kv_dtype])


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_verify_rows(kv_dtype, nan_poison):
    lengths, rows, budget = [11, 63, 130], 5, 2
    kc, vc, ks, vs, table, seq, q, gate, _ = _paged(kv_dtype, 8, lengths, 5, rows=rows)
    sel = _selection(lengths, budget, 5, rows=rows)
    out = qsa_sparse_decode(q, gate, kc, vc, table, seq, sel, SCALE, kv_dtype, ks, vs, num_splits=2)
    ref = qsa_sparse_decode_ref(q, gate, kc, vc, table, seq, sel, SCALE, kv_dtype, ks, vs)
    assert out.shape == q.shape
    assert_close("verify rows", ref, out, TOL[kv_dtype])


def test_decode_rejects_bad_inputs():
    kc, vc, ks, vs, table, seq, q, gate, _ = _paged("auto", 8, [11, 63], 0)
    sel = _selection([11, 63], 2, 0)
    with pytest.raises(ValueError, match="selected"):
        qsa_sparse_decode(q, gate, kc, vc, table, seq, sel.long(), SCALE)
    with pytest.raises(ValueError, match="KVH"):
        qsa_sparse_decode(q[:, :3], gate[:, :3], kc, vc, table, seq, sel, SCALE)
    with pytest.raises(ValueError, match="fp8_e4m3"):
        qsa_sparse_decode(q, gate, kc, vc, table, seq, sel, SCALE, "fp8_e4m3")


def _chain(layer, lengths, steps, block_size, budget, seed):
    """Run every request through the layer's state and through the kernel chain, step by step.

    Returns per request: (layer state, kernel caches, table, seq index) plus the kernel outputs of each step's rows.
    """
    g = torch.Generator().manual_seed(seed)
    B, n = len(lengths), max(lengths)
    cos, sin = rope_tables(n, budget)
    toks = [dict(k=torch.randn(L, KVH, D, generator=g).half(), v=torch.randn(L, KVH, D, generator=g).half(),
                 ik=torch.randn(L, DI, generator=g).half(), iq=torch.randn(L, HI, DI, generator=g).half(),
                 q=torch.randn(L, HQ, D, generator=g).half(), gate=torch.randn(L, HQ, D, generator=g).half())
            for L in lengths]
    table = block_table_for(lengths, block_size, NB, g)
    kc = torch.zeros(NB, block_size, KVH, D, dtype=torch.float16)
    vc = kc.clone()
    icache = torch.zeros(NB, block_size // C, DI, dtype=torch.float16)
    ring = torch.zeros(B, 2 * C, DI, dtype=torch.float16)
    w, eps = layer.indexer.k_layernorm.weight.detach(), layer.indexer.k_layernorm.eps
    states = [layer.new_state(toks[0]["k"], cos.shape[-1]) for _ in range(B)]
    done = [0] * B
    results = []
    for step in steps:
        sizes = [min(s, lengths[b] - done[b]) for b, s in enumerate(step)]
        rows = [torch.arange(done[b], done[b] + sizes[b]) for b in range(B)]
        cat = lambda key: torch.cat([toks[b][key][rows[b]] for b in range(B)])  # noqa: E731
        slots = torch.cat([slots_for(table, b, rows[b], block_size) for b in range(B)])
        cu = torch.tensor([0] + sizes).cumsum(0).int()
        seq = torch.tensor([done[b] + sizes[b] for b in range(B)], dtype=torch.int32)
        store_kv(cat("k"), cat("v"), kc, vc, slots, "auto")
        first = torch.tensor([(done[b] // C) * C for b in range(B)])
        pos = torch.cat(rows)
        index_compress(cat("ik"), cos[pos], sin[pos], ring, cos[first], sin[first], w, eps, icache, table, cu, seq)
        want = []
        for b in range(B):
            r = rows[b]
            layer._append(states[b], toks[b]["k"][r], toks[b]["v"][r], toks[b]["ik"][r], cos[r], sin[r])
            att = layer._attend(states[b], toks[b]["q"][r], toks[b]["iq"][r])
            want.append((att.float() * torch.sigmoid(toks[b]["gate"][r].float())))
        if all(s == 1 for s in sizes):
            sel = qsa_select_decode(cat("iq"), icache, table, seq, budget)
            got = qsa_sparse_decode(cat("q"), cat("gate"), kc, vc, table, seq, sel, SCALE)
        else:
            got = qsa_prefill(cat("q"), cat("gate"), kc, vc, table, cu, seq, SCALE, budget, index_q=cat("iq"),
                              index_cache=icache)
        results.append((torch.cat(want), got))
        done = [done[b] + sizes[b] for b in range(B)]
    return results


@pytest.mark.parametrize("steps,block_size,budget", [
    ([[63, 30, 5]], 8, 3),  # one prefill step, sparse rows after the onset (t >= 15)
    ([[8, 126, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]], 16, 2),  # then decode across groups, up to 130
    ([[20, 7, 3], [9, 30, 8]], 8, 2),  # chunked prefill, groups straddling chunks
], ids=["prefill", "decode", "chunked"])
def test_kernel_chain_matches_layer(steps, block_size, budget, nan_poison):
    layer = tiny_layer(budget)
    lengths = [sum(s[b] for s in steps) for b in range(3)]
    for want, got in _chain(layer, lengths, steps, block_size, budget, seed=budget + block_size):
        assert_close("kernel chain vs QSAttention._attend", want, got, atol=3e-3, rtol=3e-3)


def test_prefill_matches_ref_fp8(nan_poison):
    lengths, budget = [12, 63, 130], 3
    kc, vc, ks, vs, table, seq, _, _, _ = _paged("fp8_e4m3", 16, lengths, 9)
    g = torch.Generator().manual_seed(9)
    qlens = [12, 20, 33]  # the last qlen tokens of each request are this step's rows
    T = sum(qlens)
    q, gate = torch.randn(T, HQ, D, generator=g).half(), torch.randn(T, HQ, D, generator=g).half()
    iq = torch.randn(T, HI, DI, generator=g).half()
    icache = torch.randn(NB, 16 // C, DI, generator=g).half()
    cu = torch.tensor([0] + qlens).cumsum(0).int()
    args = (q, gate, kc, vc, table, cu, seq, SCALE, budget)
    out = qsa_prefill(*args, index_q=iq, index_cache=icache, kv_dtype="fp8_e4m3", k_scale=ks, v_scale=vs)
    ref = qsa_prefill_ref(*args, index_q=iq, index_cache=icache, kv_dtype="fp8_e4m3", k_scale=ks, v_scale=vs)
    assert_close("prefill fp8", ref, out, TOL["fp8_e4m3"])

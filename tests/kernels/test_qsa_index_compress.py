"""index_compress: pooled + normed + RoPEd group keys from raw keys split across steps and the pending ring."""

import pytest
import torch

from revolta.kernels.qsa import index_compress, index_compress_ref
from interpreter_bounds import bounds_checked
from test_qsa_helpers import C, DI, assert_close, block_table_for, nan_poison, rope_tables, tiny_layer  # noqa: F401

BS, NB, P = 8, 48, 2 * C


def _run(fn, steps, lengths, raw, cos, sin, table, weight, eps, slots):
    """Feed each request its tokens in the given step sizes; return index_cache and the final ring."""
    B = len(lengths)
    cache = torch.full((NB, BS // C, DI), float("nan"), dtype=torch.float16)
    ring = torch.full((B + 1, P, DI), float("nan"), dtype=torch.float16)
    done = [0] * B
    for step in steps:
        sizes = [min(s, lengths[b] - done[b]) for b, s in enumerate(step)]
        rows = [torch.arange(done[b], done[b] + sizes[b]) for b in range(B)]
        cu = torch.tensor([0] + sizes).cumsum(0).int()
        seq = torch.tensor([done[b] + sizes[b] for b in range(B)], dtype=torch.int32)
        raw_s = torch.cat([raw[b][rows[b]] for b in range(B)])
        cos_s = torch.cat([cos[rows[b]] for b in range(B)])
        sin_s = torch.cat([sin[rows[b]] for b in range(B)])
        first = torch.tensor([(done[b] // C) * C for b in range(B)])
        fn(raw_s, cos_s, sin_s, ring, cos[first].contiguous(), sin[first].contiguous(), weight, eps, cache, table, cu,
           seq, pending_slots=slots, max_new_tokens=max(sizes) if max(sizes) else None)
        done = [done[b] + sizes[b] for b in range(B)]
    return cache, ring


@pytest.mark.parametrize("steps", [
    [[5, 1]] + [[1, 1]] * 8,  # prefill then decode
    [[3, 12], [2, 1], [7, 5], [1, 1], [6, 3]],  # chunked, groups straddling steps
    [[12, 130]],  # one step
], ids=["decode", "chunks", "whole"])
def test_index_compress_matches_ref_and_layer(steps, nan_poison):
    lengths = [12, 130] if steps[0] == [12, 130] else [sum(s[0] for s in steps), sum(s[1] for s in steps)]
    g = torch.Generator().manual_seed(3)
    layer = tiny_layer(2)
    weight = layer.indexer.k_layernorm.weight.detach()
    eps = layer.indexer.k_layernorm.eps
    n = max(lengths)
    cos, sin = rope_tables(n)
    raw = [torch.randn(L, DI, generator=g).half() for L in lengths]
    table = block_table_for(lengths, BS, NB, g)
    slots = torch.tensor([2, 0], dtype=torch.int32)  # ring rows are not batch rows
    out, ring = _run(index_compress, steps, lengths, raw, cos, sin, table, weight, eps, slots)
    ref, ring_ref = _run(index_compress_ref, steps, lengths, raw, cos, sin, table, weight, eps, slots)
    for b, L in enumerate(lengths):
        j = torch.arange(L // C)
        got = out[table[b].long()[j * C // BS], (j * C % BS) // C]
        want = ref[table[b].long()[j * C // BS], (j * C % BS) // C]
        assert_close(f"request {b} vs ref", want, got, atol=2e-3, rtol=2e-3)
        # the layer's own compression of the same raw keys
        first = j * C
        layer_keys = layer.indexer.block_keys(raw[b][: (L // C) * C].view(-1, C, DI), cos[first], sin[first])
        assert_close(f"request {b} vs QSAIndexer.block_keys", layer_keys, got, atol=2e-3, rtol=2e-3)
        # the ring holds the last P raw keys of each request at slot token % P
        row = int(slots[b])
        last = torch.arange(max(0, L - P), L)
        assert torch.equal(ring[row, last % P], raw[b][last])
        assert torch.equal(ring[row].nan_to_num(), ring_ref[row].nan_to_num())


def test_index_compress_rejects_bad_ring():
    z = torch.zeros
    with pytest.raises(ValueError, match="pending"):
        index_compress(z(4, DI).half(), z(4, 8), z(4, 8), z(1, 6, DI).half(), z(1, 8), z(1, 8), z(DI), 1e-6,
                       z(4, 2, DI).half(), z(1, 2, dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32),
                       torch.tensor([4], dtype=torch.int32))


@pytest.mark.parametrize("lengths", [[8], [5, 12]], ids=["one", "two"])
def test_index_compress_reads_nothing_past_the_step(lengths):
    """A prefill that ends on a group boundary: the program of the group after its last token completes nothing and
    must read no cos/sin row (the row it would rotate with is past the step's [T, R] tables; on the GPU that read
    faults when the tables end an allocator segment: an illegal memory access; every 128-token prefill did it, and the
    MTP seed over one). Every access is checked against the launch's tensors (tests/interpreter_bounds.py)."""
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(DI, generator=g) * 0.1
    cos, sin = rope_tables(max(lengths))
    raw = [torch.randn(L, DI, generator=g).half() for L in lengths]
    table = block_table_for(lengths, BS, NB, g)
    slots = torch.arange(len(lengths), dtype=torch.int32)
    with bounds_checked():
        out, _ = _run(index_compress, [lengths], lengths, raw, cos, sin, table, weight, 1e-6, slots)
    ref, _ = _run(index_compress_ref, [lengths], lengths, raw, cos, sin, table, weight, 1e-6, slots)
    assert torch.equal(out.nan_to_num(), ref.nan_to_num())

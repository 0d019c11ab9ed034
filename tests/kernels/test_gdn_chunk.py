"""GDN chunked prefill kernels vs the chunked and recurrent torch references (interpreter on CPU).

Outputs and intermediates are NaN-poisoned (tests/kernels/conftest.py), so a kernel that leaves a
row, a chunk state or a segment summary unwritten fails. The split walk (context parallelism) is
forced with one- and two-chunk segments so that small batches cross segment boundaries.

bf16 is not tested against the references here: Triton's interpreter computes bf16 tl.dot wrongly
(triton#11584); the H200 benchmark checks bf16 against the reference instead. Bitwise comparisons of two
launch configurations run bf16 under the `bf16_dots` fixture (tests/kernels/conftest.py).
"""

import dataclasses

import pytest
import torch

from revolta.kernels.gdn.chunk import ChunkConfig, chunk_config, gdn_chunk_prefill
from revolta.kernels.gdn.chunk_variants import chunk_variants
from revolta.kernels.gdn.ref import _prepare_qk, gdn_chunk_prefill_ref, recurrent_gated_delta_rule_ref

pytestmark = pytest.mark.usefixtures("poison")  # tests/kernels/conftest.py

# fp16 intermediates (W, U, h, V') as in fla; the state itself is accumulated in fp32
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=5e-3, atol=5e-3)}
NUM_SLOTS = 6


def make(lens, H, HV, K, V, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = torch.randn(T, H, K, generator=gen).to(dtype)
    k = torch.randn(T, H, K, generator=gen).to(dtype)
    v = torch.randn(T, HV, V, generator=gen).to(dtype)
    g = -torch.rand(T, HV, generator=gen) * 0.7
    beta = torch.rand(T, HV, generator=gen)
    pool = torch.randn(NUM_SLOTS, HV, K, V, generator=gen) * 0.5
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, g, beta, pool, cu


def split_walk(K, V, seg_chunks):
    """The default launch configuration with the walk split into segments of seg_chunks chunks."""
    return dataclasses.replace(chunk_config(K, V), cp_min_tokens=1, seg_chunks=seg_chunks)


# (lengths, shape, dtype, chunks per walk segment: 0 = one segment per sequence)
CASES = [
    ([1, 63, 2], dict(H=2, HV=4, K=16, V=32), torch.float32, 0),
    ([1, 63, 2], dict(H=2, HV=4, K=16, V=32), torch.float16, 0),
    ([65, 0, 130], dict(H=2, HV=4, K=32, V=16), torch.float32, 1),
    ([130, 64, 3], dict(H=1, HV=3, K=32, V=32), torch.float16, 2),
]


@pytest.mark.parametrize("lens,shape,dtype,seg", CASES, ids=lambda x: str(x).replace(" ", ""))
def test_chunk_prefill(lens, shape, dtype, seg):
    q, k, v, g, beta, pool0, cu = make(lens, dtype=dtype, seed=len(lens) + seg, **shape)
    B = len(lens)
    slots = torch.tensor([4, 1, 5][:B], dtype=torch.int32)
    has_init = torch.tensor([True, False, True][:B])
    pool, pool_ref = pool0.clone(), pool0.clone()
    config = split_walk(shape["K"], shape["V"], seg) if seg else None
    o = gdn_chunk_prefill(q, k, v, g, beta, cu, pool, slots, has_init, config=config)
    o_ref = gdn_chunk_prefill_ref(q, k, v, g, beta, cu, pool_ref, slots, has_init)
    assert not o.isnan().any() and not pool.isnan().any()
    torch.testing.assert_close(o, o_ref, **TOL[dtype])
    torch.testing.assert_close(pool, pool_ref, **TOL[dtype])
    written = [int(slots[b]) for b in range(B) if lens[b] > 0]
    others = [s for s in range(NUM_SLOTS) if s not in written]
    assert torch.equal(pool[others], pool0[others]), "only the addressed slots of non-empty sequences change"

    # the definition: token-by-token recurrence from the pool's initial states
    HV = v.shape[1]
    qe, ke = _prepare_qk(q, k, HV, None, True)
    for b in range(B):
        bos, eos = int(cu[b]), int(cu[b + 1])
        if eos == bos:
            continue
        s0 = pool0[slots[b]] if has_init[b] else torch.zeros_like(pool0[0])
        o_r, s_r = recurrent_gated_delta_rule_ref(qe[bos:eos], ke[bos:eos], v[bos:eos], g[bos:eos], beta[bos:eos], s0)
        torch.testing.assert_close(o[bos:eos].float(), o_r, **TOL[dtype])
        torch.testing.assert_close(pool[slots[b]], s_r, **TOL[dtype])


# the sm_90 candidates (chunk_variants.py) that change what the kernels compute under the
# interpreter: the K-halves state tiles, 64-wide walk tiles and 32-wide output tiles, serial and
# split, the transposed walk (its hᵀ from slots and h_start, h_c read transposed by the output),
# several sequences (a 1-token one, one ending mid-chunk, an empty one), initial states in
# (and one from zeros), final states out
VARIANT_CASES = [
    ("khalves", [1, 63, 70], dict(H=2, HV=4, K=32, V=32), torch.float16, 0),
    ("khalves", [65, 0, 130], dict(H=1, HV=2, K=64, V=16), torch.float32, 1),
    ("khalves_bv64_w8", [130, 64, 3], dict(H=1, HV=2, K=32, V=64), torch.float16, 2),
    ("bv64_w8", [70, 1, 129], dict(H=2, HV=4, K=16, V=64), torch.float16, 1),
    ("t_bv64", [1, 63, 70], dict(H=2, HV=4, K=32, V=64), torch.float16, 0),  # the transposed walk, serial
    ("t_bv32", [65, 0, 130], dict(H=1, HV=2, K=64, V=64), torch.float32, 1),  # split: hᵀ from h_start
    ("t_bv16_w2", [130, 64, 3], dict(H=1, HV=2, K=16, V=32), torch.float16, 2),
    ("no_pf", [1, 63, 70], dict(H=2, HV=4, K=32, V=32), torch.float16, 0),  # factors loaded in the chain, serial
    ("no_pf", [65, 0, 130], dict(H=1, HV=2, K=64, V=16), torch.float32, 1),  # and split (segments of one chunk)
    ("t_bv32_pf", [130, 64, 3], dict(H=1, HV=2, K=32, V=64), torch.float16, 2),
    ("out_bv32", [1, 63, 70], dict(H=1, HV=2, K=16, V=64), torch.float16, 0),  # two 32-wide tiles per program
    ("intra_bk32_bv32", [65, 0, 130], dict(H=1, HV=2, K=64, V=64), torch.float16, 1),  # two K and two V slices
    ("out_bk128_bv128_w8", [70, 1, 0], dict(H=1, HV=1, K=128, V=128), torch.float16, 0),  # whole K, V per product
]


@pytest.mark.parametrize("name,lens,shape,dtype,seg", VARIANT_CASES, ids=lambda x: str(x).replace(" ", ""))
def test_chunk_prefill_variants(name, lens, shape, dtype, seg):
    q, k, v, g, beta, pool0, cu = make(lens, dtype=dtype, seed=7 + seg, **shape)
    slots = torch.tensor([2, 0, 5], dtype=torch.int32)
    has_init = torch.tensor([True, True, False])
    config = chunk_variants(shape["K"], shape["V"])[name]
    if seg:
        config = dataclasses.replace(config, cp_min_tokens=1, seg_chunks=seg)
    pool, pool_ref = pool0.clone(), pool0.clone()
    o = gdn_chunk_prefill(q, k, v, g, beta, cu, pool, slots, has_init, config=config)
    o_ref = gdn_chunk_prefill_ref(q, k, v, g, beta, cu, pool_ref, slots, has_init)
    assert not o.isnan().any() and not pool.isnan().any()
    torch.testing.assert_close(o, o_ref, **TOL[dtype])
    torch.testing.assert_close(pool, pool_ref, **TOL[dtype])
    # slots of empty sequences and unaddressed slots are untouched
    untouched = [s for s in range(NUM_SLOTS) if s not in [int(slots[b]) for b in range(3) if lens[b] > 0]]
    assert torch.equal(pool[untouched], pool0[untouched])


@pytest.mark.parametrize("field,base,seg,refused", [
    ("walk_prefetch", "default", 0, "khalves"), ("walk_prefetch", "t_bv32", 1, "khalves"),
    ("walk_stage_u", "no_pf", 0, "t_bv32"), ("walk_stage_u", "no_pf", 1, "khalves")])
def test_walk_load_placements_are_bitwise_the_walk(field, base, seg, refused):
    """walk_prefetch loads the decay factors a chunk earlier; walk_stage_u loads U and the factors in their own chunk
    (for the pipeliner's stages) instead of a chunk ahead in registers: the same values into the same arithmetic, so
    outputs and states equal the walk without them, serial and split into 1-chunk segments; the tilings they are not
    written for are refused by name."""
    q, k, v, g, beta, pool0, cu = make([1, 63, 130], dtype=torch.float16, seed=3, H=1, HV=2, K=32, V=32)
    slots = torch.tensor([2, 0, 5], dtype=torch.int32)
    has_init = torch.tensor([True, False, True])
    outs = []
    for on in (False, True):
        config = dataclasses.replace(chunk_variants(32, 32)[base], **{field: on})
        if seg:
            config = dataclasses.replace(config, cp_min_tokens=1, seg_chunks=seg)
        pool = pool0.clone()
        outs.append((gdn_chunk_prefill(q, k, v, g, beta, cu, pool, slots, has_init, config=config), pool))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    with pytest.raises(AssertionError, match=f"{field} is a variant of the one-tile"):
        gdn_chunk_prefill(q, k, v, g, beta, cu, pool0.clone(), slots, has_init,
                          config=dataclasses.replace(chunk_variants(32, 32)[refused], **{field: True}))


@pytest.mark.parametrize("dtype,l2norm", [(torch.float32, True), (torch.float16, True), (torch.bfloat16, True),
                                          (torch.float32, False)])
def test_intra_group_heads_is_bitwise_the_default(request, dtype, l2norm):
    """intra_group_heads computes each k head's K Kᵀ and 1/‖k‖ once for its HV / H value heads: outputs and final
    states equal the per-value-head launch bitwise (3 value heads per k head; a sequence ending mid-chunk)."""
    if dtype == torch.bfloat16:
        request.getfixturevalue("bf16_dots")  # tests/kernels/conftest.py: bf16 products as on the GPU
    q, k, v, g, beta, pool0, cu = make([1, 63, 70], dtype=dtype, seed=11, H=2, HV=6, K=32, V=32)
    slots = torch.tensor([2, 0, 5], dtype=torch.int32)
    has_init = torch.tensor([True, False, True])
    outs = []
    for group in (False, True):
        config = dataclasses.replace(chunk_config(32, 32), intra_group_heads=group)
        pool = pool0.clone()
        o = gdn_chunk_prefill(q, k, v, g, beta, cu, pool, slots, has_init, use_qk_l2norm=l2norm, config=config)
        outs.append((o, pool))
    assert not outs[1][0].isnan().any() and not outs[1][1].isnan().any()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert chunk_variants(32, 32)["intra_heads"].intra_group_heads and not chunk_config(32, 32, 70).intra_group_heads


@pytest.mark.parametrize("T,pieces,has_init,lead", [(520, 4, True, 0.0), (333, 2, False, 0.0), (333, 8, True, 0.0),
                                                    (520, 2, True, 0.7), (520, 3, False, 0.5)])
def test_pipelined_pieces_are_bitwise_one_piece(T, pieces, has_init, lead):
    """pipeline_pieces cuts one sequence into chunk-aligned pieces (the last one partial at T = 333), each walk starting
    from the slot state the previous one wrote: outputs and the final state equal the one-piece call bitwise (under
    the interpreter the pieces run in order; tests/gpu runs them on their streams). q, k, v as views of one fused
    buffer, as the layer passes them."""
    H, HV, K, V = 1, 2, 32, 32
    gen = torch.Generator().manual_seed(T + pieces)
    mixed = (torch.randn(T, 2 * H * K + HV * V, generator=gen) * 0.5).half()
    q, k, v = (t.unflatten(-1, (-1, d)) for t, d in zip(mixed.split([H * K, H * K, HV * V], -1), (K, K, V)))
    g = -torch.rand(T, HV, generator=gen) * 0.7
    beta = torch.rand(T, HV, generator=gen)
    pool0 = torch.randn(NUM_SLOTS, HV, K, V, generator=gen) * 0.5
    cu, slots = torch.tensor([0, T], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    init = torch.tensor([has_init])
    outs = []
    for n in (0, pieces):
        config = dataclasses.replace(chunk_config(K, V), pipeline_pieces=n, pipeline_min_chunks=2, pipeline_lead=lead)
        assert config.pipeline_pieces_for(T, config.serial_walk_programs(1, HV, V), 132) == min(max(n, 1), T // 128)
        pool = pool0.clone()
        outs.append((gdn_chunk_prefill(q, k, v, g, beta, cu, pool, slots, init, config=config), pool))
    assert not outs[1][0].isnan().any() and not outs[1][1].isnan().any()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert torch.equal(outs[1][1][:3], pool0[:3]), "only the sequence's slot changes"
    config = chunk_variants(K, V)["pipe4"]
    assert config.pipeline_pieces_for(T, 132, 132) == 1, "a walk that fills the SMs runs as one piece"
    cuts = lambda lead, n: dataclasses.replace(config, pipeline_lead=lead).pipeline_cuts(128, n)  # noqa: E731
    assert cuts(0.0, 2) == [0, 64, 128] and cuts(0.0, 3) == [0, 43, 86, 128]
    assert cuts(0.0, 5) == [0, 26, 52, 78, 104, 128]
    assert cuts(0.65, 2) == [0, 83, 128] and cuts(0.5, 3) == [0, 64, 96, 128] and cuts(1.0, 2) == [0, 64, 128]
    default = chunk_config(128, 128, 90)  # the real shape's 96 walk programs: 8K tokens as 2 pieces, 32K as 3
    assert [default.pipeline_pieces_for(t, 96, 132) for t in (4096, 8191, 8192, 12288, 32768)] == [1, 1, 2, 3, 3]
    assert chunk_config(128, 128, 70).pipeline_pieces_for(32768, 8, 80) == 1, "sm_70 keeps one piece (not timed)"


@pytest.mark.parametrize("lens", [[1, 3, 400, 1, 2], [330, 1, 0, 2], [1, 2, 333]])
def test_pipelined_mixed_batch_is_bitwise_one_piece(lens):
    """A long prompt beside decode rows / short prompts (the engine's mixed steps) with the host's cu_seqlens: the long
    sequence is cut into pieces, the others walk whole in the first or the last piece; outputs and every slot equal
    the one-piece call bitwise, and without the host copy the batch runs as one piece."""
    H, HV, K, V = 1, 2, 32, 32
    q, k, v, g, beta, pool0, cu = make(lens, H, HV, K, V, torch.float16, seed=sum(lens))
    B = len(lens)
    slots = torch.tensor([5, 0, 3, 1, 4][:B], dtype=torch.int32)
    init = torch.tensor([True, False, True, True, False][:B])
    host = cu.tolist()
    config = dataclasses.replace(chunk_config(K, V), pipeline_pieces=3, pipeline_min_chunks=2)
    plan = config.pipeline_plan(host, HV, 132)
    long = lens.index(max(lens))
    assert plan is not None and plan.seq == long and len(plan.pieces()) == min(3, max(lens) // 128)
    assert plan.pieces()[0] == (0, plan.cuts[0], 0, long + 1) and plan.pieces()[-1][1:] == (sum(lens), long, B)
    assert all((c - host[long]) % 64 == 0 for c in plan.cuts)
    outs = []
    for cfg, hint in ((dataclasses.replace(config, pipeline_pieces=0), None), (config, host), (config, None)):
        pool = pool0.clone()
        outs.append((gdn_chunk_prefill(q, k, v, g, beta, cu, pool, slots, init, config=cfg, host_cu_seqlens=hint),
                     pool))
    assert not outs[1][0].isnan().any() and not outs[1][1].isnan().any()
    for o, pool in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(pool, outs[0][1])
    o_ref = gdn_chunk_prefill_ref(q, k, v, g, beta, cu, pool0.clone(), slots, init)
    torch.testing.assert_close(outs[1][0], o_ref, **TOL[torch.float16])
    assert config.pipeline_plan([0, 200, 400], HV, 132) is None, "no sequence holds 7/8 of the tokens"
    assert config.pipeline_plan([0, 1, 2], HV, 132) is None, "too short to cut"


def test_k_halves_needs_two_dot_tiles():
    q, k, v, g, beta, pool, cu = make([3], 2, 4, 16, 16, torch.float32, 0)
    config = chunk_variants(16, 16)["khalves"]
    with pytest.raises(AssertionError, match="walk_k_halves needs K >= 32"):
        gdn_chunk_prefill(q, k, v, g, beta, cu, pool, torch.tensor([1], dtype=torch.int32), torch.tensor([True]),
                          config=config)


def test_chunk_prefill_strided_views_no_l2norm():
    """q, k, v as head-contiguous column slices of one fused buffer; no in-kernel normalisation; split walk."""
    lens, H, HV, K, V = [70, 5], 2, 4, 16, 16
    T = sum(lens)
    gen = torch.Generator().manual_seed(9)
    mixed = torch.randn(T, 2 * H * K + HV * V, generator=gen) * 0.25
    q, k, v = (t.unflatten(-1, (-1, d)) for t, d in zip(mixed.split([H * K, H * K, HV * V], -1), (K, K, V)))
    g = -torch.rand(T, HV, generator=gen)
    beta = torch.rand(T, HV, generator=gen)
    pool = torch.randn(3, HV, K, V, generator=gen)
    pool_ref = pool.clone()
    cu = torch.tensor([0, 70, 75], dtype=torch.int32)
    slots = torch.tensor([2, 1], dtype=torch.int32)
    has_init = torch.tensor([True, True])
    o = gdn_chunk_prefill(q, k, v, g, beta, cu, pool, slots, has_init, scale=0.5, use_qk_l2norm=False,
                          config=split_walk(K, V, 1))
    o_ref = gdn_chunk_prefill_ref(q, k, v, g, beta, cu, pool_ref, slots, has_init, scale=0.5, use_qk_l2norm=False)
    torch.testing.assert_close(o, o_ref, **TOL[torch.float32])
    torch.testing.assert_close(pool, pool_ref, **TOL[torch.float32])


def test_segment_choice():
    """The walk splits only from cp_min_tokens on, with segments that grow with the sequence, and only where the serial
    walk's programs would leave more than half the SMs idle."""
    cfg = dataclasses.replace(chunk_config(128, 128), cp_min_tokens=16384, seg_chunks=0)
    assert cfg.segment_chunks(8192, 48, 132) == 0
    seg_16k, seg_32k = cfg.segment_chunks(16384, 48, 132), cfg.segment_chunks(32768, 48, 132)
    assert 8 <= seg_16k <= seg_32k <= 64 and 32768 // 64 // seg_32k >= 8, (seg_16k, seg_32k)
    assert dataclasses.replace(cfg, seg_chunks=4).segment_chunks(16384, 48, 132) == 4
    assert dataclasses.replace(cfg, cp_min_tokens=0).segment_chunks(1 << 20, 48, 132) == 0
    # a serial walk that fills every SM is not split (192 programs at 48 v-heads x 4 tiles); 12 v-heads (TP4) are
    assert cfg.segment_chunks(32768, 48, 132, walk_programs=192) == 0
    assert cfg.segment_chunks(32768, 12, 132, walk_programs=48) > 0
    # the sm_90 default's 64-column walk: 96 programs of one sequence stay serial from half the SMs on (not below)
    assert cfg.serial_min_fill == 0.5 and cfg.serial_walk_programs(1, 48, 128) == 96
    assert cfg.segment_chunks(32768, 48, 132, walk_programs=96) == 0
    assert dataclasses.replace(cfg, serial_min_fill=1.0).segment_chunks(32768, 48, 132, walk_programs=96) > 0
    assert cfg.segment_chunks(32768, 24, 132, walk_programs=48) > 0
    assert isinstance(chunk_config(128, 128, 70), ChunkConfig)


def test_wrapper_messages():
    q, k, v, g, beta, pool, cu = make([3], 2, 4, 16, 16, torch.float32, 0)
    slots = torch.tensor([1], dtype=torch.int32)
    with pytest.raises(AssertionError, match="has_initial_state must be bool"):
        gdn_chunk_prefill(q, k, v, g, beta, cu, pool, slots, torch.tensor([1]))
    with pytest.raises(AssertionError, match="cu_seqlens must be int32"):
        gdn_chunk_prefill(q, k, v, g, beta, cu.long(), pool, slots, torch.tensor([True]))
    with pytest.raises(AssertionError, match="multiple of q/k heads"):
        gdn_chunk_prefill(q, k, v[:, :3], g[:, :3], beta[:, :3], cu, pool[:, :3], slots, torch.tensor([True]))

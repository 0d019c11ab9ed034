"""sharded_selector_codebook (spec/engine.md §2.7): vocabulary-row shards of both selector codebooks,
combined by one all-reduce, are bitwise the replicated lookup except that -0 becomes +0. Two CPU
processes over gloo; the vocabulary does not divide evenly, so the last shard is shorter. A rank's
drafter (rank_drafter.py) holds only its rows of the books and its part of the layers (split like a
decoder layer), and drafts what the whole drafter drafts."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file

from revolta.parallel.context import ParallelContext
from revolta.spec.dflash2.sharded_codebook import (ShardedCodebooks, check_codebook_shape, load_codebook_shards,
                                                   vocab_shard)

VOCAB, RANK, TOP_K, DRAFTS = 1001, 16, 4, 7


def tables(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Both codebooks, with exact zeros, negative zeros and extreme finite values planted."""
    g = torch.Generator().manual_seed(3)
    pred, succ = (torch.randn(VOCAB, RANK, generator=g).to(dtype) for _ in range(2))
    big = torch.finfo(dtype).max
    tiny = torch.finfo(dtype).tiny
    for t in (pred, succ):
        t[::7, 0] = -0.0
        t[3::11, 1] = 0.0
        t[5::13, 2] = big
        t[6::17, 3] = -tiny / 2  # subnormal
    return pred, succ


def ids(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Predecessors [B, 1 + 6K] (anchor + 6 positions' candidates), successors [B, 7, K], over both
    shards including their edges."""
    start1 = vocab_shard(VOCAB, 1, 2)[0]
    pred = torch.randint(0, VOCAB, (3, 1 + (DRAFTS - 1) * TOP_K), generator=generator)
    succ = torch.randint(0, VOCAB, (3, DRAFTS, TOP_K), generator=generator)
    pred[0, :4] = torch.tensor([0, start1 - 1, start1, VOCAB - 1])
    succ[0, 0] = torch.tensor([0, 7, start1, 7 * 100])  # rows 0, 7 and 700 hold -0 in column 0
    return pred, succ


def assert_bitwise_but_negative_zero(got: torch.Tensor, want: torch.Tensor) -> int:
    """Every element bitwise equal, except want == -0 where got must be +0; returns how many -0 there were."""
    ints = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[want.dtype]
    neg_zero = (want == 0) & torch.signbit(want)
    assert torch.equal(got.view(ints)[~neg_zero], want.view(ints)[~neg_zero])
    assert not torch.signbit(got[neg_zero]).any() and (got[neg_zero] == 0).all()
    return int(neg_zero.sum())


def drafter_dir(path) -> str:
    """A small DFlash2 drafter checkpoint over VOCAB ids (random weights, codebooks of std 1)."""
    import json

    from revolta.presets.default_drafter import init_drafter_weights
    from revolta.spec.dflash2.checkpoint import save_draft_model
    from revolta.spec.dflash2.draft_config import DFlash2DraftConfig
    from revolta.spec.dflash2.model import DFlash2DraftModel

    raw = {"architectures": ["DFlash2DraftModel"], "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "rms_norm_eps": 1e-6, "num_target_layers": 4, "attention_bias": True,
           "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8, "use_sliding_window": True,
           "dflash_config": {"block_size": DRAFTS + 1, "mask_token_id": 3, "selector_rank": RANK,
                             "selector_top_k": TOP_K, "conv_kernel_size": 2, "conv_group_size": 16,
                             "target_layer_ids": [0, 3]}}
    model = DFlash2DraftModel(DFlash2DraftConfig.from_dict(json.loads(json.dumps(raw)), source="test drafter"))
    init_drafter_weights(model, seed=2)
    with torch.no_grad():
        model.candidate_selector.predecessor_codebook.weight.normal_()
        model.candidate_selector.successor_codebook.weight.normal_()
        for name, p in model.named_parameters():
            if name.endswith("bias"):  # o_proj's bias must be added once, not once per rank
                p.normal_()
    return str(save_draft_model(model, path))


def check_rank_drafter(rank: int, world: int, path: str) -> None:
    """Rank `rank`'s drafter: its heads / MLP channels and its rows of both books; the whole drafter's drafts."""
    from revolta.spec.dflash2.checkpoint import load_draft_model
    from revolta.spec.dflash2.model import DraftKVCache
    from revolta.spec.dflash2.rank_drafter import load_rank_drafter

    whole = load_draft_model(path)
    mine = load_rank_drafter(path, ParallelContext.from_group(dist.group.WORLD))
    full, sharded = whole.candidate_selector, mine.candidate_selector
    start, end = vocab_shard(VOCAB, rank, world)
    books = sharded.codebook_shards
    assert books.predecessor_codebook.shape == books.successor_codebook.shape == (end - start, RANK)
    assert end - start == (501 if rank == 0 else 500)
    assert torch.equal(books.successor_codebook, full.successor_codebook.weight[start:end])
    assert not hasattr(sharded, "successor_codebook")  # the whole table is not held
    attn, mlp = mine.layers[1].self_attn, mine.layers[1].mlp
    assert attn.q_proj.weight.shape == (2 * 16, 32) and attn.k_proj.weight.shape == (16, 32)  # 2 of 4 heads, 1 of 2
    assert torch.equal(attn.k_proj.weight, whole.layers[1].self_attn.k_proj.weight[rank * 16:(rank + 1) * 16])
    assert attn.o_proj.weight.shape == (32, 32) and mlp.down_proj.weight.shape == (32, 32)  # 64 -> 32 channels
    gen = torch.Generator().manual_seed(4)  # the same inputs on both ranks
    hidden = torch.randn(3, DRAFTS, 32, generator=gen)
    unary, candidates = torch.randn(3, DRAFTS, VOCAB, generator=gen).topk(TOP_K, dim=-1)
    anchors = torch.tensor([500, 501, VOCAB - 1])  # rank 0's last row, rank 1's first and last
    for got, want in zip(sharded.lattice(hidden, unary, candidates, anchors),
                         full.lattice(hidden, unary, candidates, anchors)):
        assert torch.equal(got, want)
    embed, head = torch.randn(VOCAB, 32, generator=gen), torch.randn(VOCAB, 32, generator=gen)
    context = [torch.randn(n, 64, generator=gen) for n in (5, 12, 1)]
    out = [drafter(context, [DraftKVCache() for _ in context], anchors, lambda ids: embed[ids],
                   lambda h: h @ head.T) for drafter in (mine, whole)]
    assert torch.equal(out[0].tokens, out[1].tokens)
    hidden = []
    for drafter in (mine, whole):  # the split layers' output (their all-reduces) is the whole layers', to rounding
        caches = [DraftKVCache() for _ in context]
        for cache, rows in zip(caches, context):
            drafter.extend_context(cache, rows)
        hidden.append(drafter.block_hidden(embed[drafter.block_ids(anchors)], caches))
    torch.testing.assert_close(hidden[0], hidden[1], rtol=1e-5, atol=1e-5)


def _worker(rank: int, world: int, rendezvous: str, drafter: str) -> None:
    torch.set_num_threads(1)  # 2 shared cores: ranks must not oversubscribe them
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    try:
        check_rank_drafter(rank, world, drafter)
        for dtype in (torch.float32, torch.float16):
            pred, succ = tables(dtype)
            books = ShardedCodebooks.from_full(pred, succ, ParallelContext.from_group(dist.group.WORLD))
            assert books.predecessor_codebook.shape[0] == (501 if rank == 0 else 500)
            gen = torch.Generator().manual_seed(9)  # same ids on both ranks, as the selector's are
            for _ in range(3):
                p_ids, s_ids = ids(gen)
                got_p, got_s = books.lookup(p_ids, s_ids)
                assert got_p.shape == (*p_ids.shape, RANK) and got_s.shape == (*s_ids.shape, RANK)
                n = assert_bitwise_but_negative_zero(got_p, pred[p_ids])
                n += assert_bitwise_but_negative_zero(got_s, succ[s_ids])
                assert n > 0  # the -0 exception is exercised, not only claimed
        # every rank done before any tears gloo down: rank 0 died once in teardown with "terminate called without
        # an active exception" (SIGABRT) after its checks passed, as tests/parallel/tp_run.py's ranks did
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_sharded_lookup_matches_replicated_on_two_gloo_ranks(tmp_path):
    ranks = mp.spawn(_worker, args=(2, str(tmp_path / "rendezvous"), drafter_dir(tmp_path / "drafter")), nprocs=2,
                     join=False)
    deadline = time.monotonic() + 120  # a hung rank fails the test instead of hanging it
    while not ranks.join(timeout=max(0.0, deadline - time.monotonic())):  # raises when a rank failed
        if time.monotonic() >= deadline:
            for process in ranks.processes:
                process.kill()
            raise AssertionError("the two gloo ranks were still running after 120 s")


def test_shards_cover_every_row_once():
    for vocab, world in [(1001, 2), (248320, 4), (10, 3), (7, 7)]:
        ranges = [vocab_shard(vocab, r, world) for r in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == vocab
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert vocab_shard(248320, 1, 4) == (62080, 124160)
    with pytest.raises(ValueError, match="fewer rows"):
        vocab_shard(3, 0, 4)


def test_single_rank_is_the_replicated_lookup():
    pred, succ = tables(torch.float32)
    books = ShardedCodebooks.from_full(pred, succ, ParallelContext())
    p_ids, s_ids = ids(torch.Generator().manual_seed(1))
    got_p, got_s = books.lookup(p_ids, s_ids)
    assert torch.equal(got_p.view(torch.int32), pred[p_ids].view(torch.int32))  # no collective: even -0 survives
    assert torch.equal(got_s.view(torch.int32), succ[s_ids].view(torch.int32))


def test_checkpoint_shapes_are_checked_before_slicing(tmp_path):
    pred, succ = tables(torch.float16)
    save_file({"candidate_selector.predecessor_codebook": pred, "candidate_selector.successor_codebook": succ,
               "fc.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    for rank in range(2):
        start, end = vocab_shard(VOCAB, rank, 2)
        got = load_codebook_shards(tmp_path, VOCAB, RANK, rank, 2)
        assert torch.equal(got["predecessor_codebook"], pred[start:end])
        assert torch.equal(got["successor_codebook"], succ[start:end])
    with pytest.raises(ValueError, match=r"shape \[1001, 16\], expected \[vocab_size=1000, selector_rank=16\]"):
        load_codebook_shards(tmp_path, 1000, RANK, 0, 2)
    with pytest.raises(ValueError, match="selector_rank=32"):
        load_codebook_shards(tmp_path, VOCAB, 32, 1, 2)
    save_file({"candidate_selector.predecessor_codebook": pred}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="successor_codebook"):
        load_codebook_shards(tmp_path, VOCAB, RANK, 0, 2)
    with pytest.raises(ValueError, match="expected"):
        check_codebook_shape("x", (VOCAB, RANK + 1), VOCAB, RANK)
    with pytest.raises(ValueError, match="expected"):
        ShardedCodebooks.from_full(pred, succ[:, :8], ParallelContext())


def test_rank_drafter_checks_every_name_and_shape_first(tmp_path):
    from safetensors.torch import load_file

    from revolta.spec.dflash2.rank_drafter import load_rank_drafter
    from revolta.weights import CheckpointError

    path = Path(drafter_dir(tmp_path / "drafter"))
    (file,) = path.glob("*.safetensors")
    state = load_file(str(file))
    state["layers.0.self_attn.k_proj.weight"] = state["layers.0.self_attn.k_proj.weight"][:16]
    state["layers.9.mlp.up_proj.weight"] = state.pop("layers.1.mlp.up_proj.weight")
    save_file(state, str(file))
    with pytest.raises(CheckpointError) as e:
        load_rank_drafter(path, ParallelContext(), shard_codebooks=False)
    for what in ("unexpected tensor layers.9.mlp.up_proj.weight", "missing tensor layers.1.mlp.up_proj.weight",
                 "layers.0.self_attn.k_proj.weight: shape [16, 32] in the file, [32, 32] in the model"):
        assert what in str(e.value)


def test_a_rank_past_the_vocabularys_end_looks_up_zeros():
    """5 rows over 4 ranks split 2, 2, 1, 0: the last rank owns no row, so its part of every lookup is zero (it
    indexed its empty shard before)."""
    pred, succ = torch.randn(5, 3), torch.randn(5, 3)
    ctx = ParallelContext(rank=3, size=4, group=object())  # no collective runs: only the local part is checked
    books = ShardedCodebooks.from_full(pred, succ, ctx)
    assert (books.start, books.end) == (5, 5)
    part = books._owned(books.predecessor_codebook, torch.tensor([[0, 4], [2, 3]]))
    assert torch.equal(part, torch.zeros(4, 3))

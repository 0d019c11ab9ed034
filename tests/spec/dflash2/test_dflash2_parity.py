"""Parity of revolta's DFlash2 drafter with `dflash` 0.1.0 (fp32, tiny random config, same weights)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dflash.model import _crop_to, _make_cache
from dflash2_oracle import Pair, V

from revolta.spec.dflash2 import DraftKVCache

# fp32 through 3 layers in a different summation order gives ~1e-5 on values ~4; wrong math gives >1e-2
TOL = dict(atol=1e-4, rtol=1e-5)


def oracle_block(pair: Pair, cache, tapped: torch.Tensor, block_ids: torch.Tensor, start: int) -> torch.Tensor:
    """One oracle draft forward (as dflash_generate runs it): new context rows + the block at `start`."""
    noise = F.embedding(block_ids, pair.embed.weight) * pair.cfg.input_embedding_scale
    s = block_ids.shape[1]
    pos = torch.arange(start - tapped.shape[1], start + s)[None].expand(block_ids.shape[0], -1)
    out = pair.oracle(target_hidden=tapped, noise_embedding=noise, position_ids=pos, past_key_values=cache,
                      use_cache=True)
    _crop_to(cache, start)  # keep the context K/V only, as dflash_generate does
    return out


def mine_block(pair: Pair, caches, tapped: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    for c, rows in zip(caches, tapped):
        pair.model.extend_context(c, rows)
    return pair.model.block_hidden(pair.embed(block_ids) * pair.cfg.input_embedding_scale, caches)


@pytest.mark.parametrize("variant", [
    {},  # sliding layers causal with window 6, the full layer non-causal
    {"is_causal": False, "sliding_window": 3},  # every layer non-causal: the window cuts on both sides
    {"is_causal": True, "sliding_window": 3},
    {"output_multiplier": 0.7, "final_logit_softcapping": 5.0, "input_embedding_scale": 1.5},
])
@torch.no_grad()
def test_block_hidden_and_logits_match_over_rounds(variant):
    pair = Pair(seed=3, **variant)
    g = torch.Generator().manual_seed(11)
    B, S, taps = 2, pair.cfg.block_size, pair.cfg.num_taps * pair.cfg.hidden_size
    cache = _make_cache(pair.oracle.config)
    caches = [DraftKVCache() for _ in range(B)]
    start = 0
    for new in (5, 3, 4):  # prompt context, then two rounds of accepted rows
        tapped = torch.randn(B, new, taps, generator=g)
        start += new
        ids = torch.full((B, S), pair.cfg.mask_token_id)
        ids[:, 0] = torch.randint(0, V, (B,), generator=g)
        want = oracle_block(pair, cache, tapped, ids, start)
        got = mine_block(pair, caches, tapped, ids)
        torch.testing.assert_close(got, want, **TOL)
        assert [c.length for c in caches] == [start] * B
        want_logits = pair.oracle.compute_logits(want[:, 1:], pair.head)
        got_logits = pair.model.compute_logits(got[:, 1:], pair.head)
        torch.testing.assert_close(got_logits, want_logits, **TOL)


@torch.no_grad()
def test_requests_with_different_context_lengths_batch_like_alone():
    """Padding each request's context to the longest must not change its block (oracle run per request)."""
    pair = Pair(seed=5)
    g = torch.Generator().manual_seed(2)
    taps = pair.cfg.num_taps * pair.cfg.hidden_size
    lens = [9, 4, 13]  # 13 > window + block: the sliding window cuts the context
    tapped = [torch.randn(n, taps, generator=g) for n in lens]
    ids = pair.model.block_ids(torch.randint(0, V, (len(lens),), generator=g))
    caches = [DraftKVCache() for _ in lens]
    for c, rows in zip(caches, tapped):
        pair.model.extend_context(c, rows)
    got = pair.model.block_hidden(pair.embed(ids), caches)
    for b, n in enumerate(lens):
        want = oracle_block(pair, _make_cache(pair.oracle.config), tapped[b][None], ids[b:b + 1], n)
        torch.testing.assert_close(got[b:b + 1], want, **TOL)


@torch.no_grad()
def test_convolutions_match():
    pair = Pair(seed=7)
    x = torch.randn(3, pair.cfg.block_size, pair.cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    y = torch.randn_like(x)
    for ours, theirs in ((pair.model.layers[1].attention_conv, pair.oracle.layers[1].attention_conv),
                         (pair.model.layers[2].mlp_conv, pair.oracle.layers[2].mlp_conv)):
        got, got_post = ours.prepare(x)
        want, want_post = theirs.prepare(x)
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(got_post, want_post, **TOL)
        torch.testing.assert_close(ours.finish(y, got_post), theirs.finish(y, want_post), **TOL)
        # no tap reaches across the block start: position 0 sees only itself
        shifted = torch.cat([torch.randn_like(x[:, :1]), x[:, 1:]], 1)
        torch.testing.assert_close(ours.prepare(shifted)[0][:, 2:], got[:, 2:], **TOL)


def _walk_inputs(pair: Pair, B: int = 4):
    g = torch.Generator().manual_seed(9)
    D = pair.cfg.num_drafts
    hidden = torch.randn(B, D, pair.cfg.hidden_size, generator=g)
    logits = pair.model.compute_logits(hidden, pair.head)
    anchor = torch.randint(0, V, (B,), generator=g)
    return hidden, logits, anchor


@torch.no_grad()
def test_greedy_walk_matches():
    pair = Pair(seed=1)
    hidden, logits, anchor = _walk_inputs(pair, B=16)
    want_tokens, want_cands, want_q = pair.oracle.candidate_selector.select(hidden, logits, anchor, 0.0)
    got = pair.model.candidate_selector(hidden, logits, anchor)
    assert want_q is None and got.q is None
    assert torch.equal(got.tokens, want_tokens)
    assert torch.equal(got.candidates.sort(-1).values, want_cands.sort(-1).values)
    # the pairwise term matters here: the walk is not just each position's argmax
    assert not torch.equal(got.tokens, logits.argmax(-1))


@torch.no_grad()
def test_sampled_walk_q_matches_along_the_oracle_path():
    pair = Pair(seed=2)
    hidden, logits, anchor = _walk_inputs(pair)
    T = 0.8
    torch.manual_seed(0)
    path, cands, q = pair.oracle.candidate_selector.select(hidden, logits, anchor, T)
    sel = pair.model.candidate_selector
    _, mine_cands = torch.topk(logits, sel.top_k, dim=-1)
    first, rest = sel.lattice(hidden, torch.gather(logits, -1, mine_cands), mine_cands, anchor)
    for b in range(hidden.shape[0]):
        for t in range(hidden.shape[1]):
            row = first[b] if t == 0 else rest[b, t - 1, (mine_cands[b, t - 1] == path[b, t - 1]).nonzero()[0, 0]]
            mine = dict(zip(mine_cands[b, t].tolist(), torch.softmax(row / T, -1).tolist()))
            theirs = dict(zip(cands[b, t].tolist(), q[b, t].tolist()))
            assert mine.keys() == theirs.keys()
            assert max(abs(mine[k] - theirs[k]) for k in mine) < 1e-6


@torch.no_grad()
def test_sampled_walk_draws_from_q():
    """Many identical requests: the first draft's frequencies follow q; q rows sum to 1 over the candidates."""
    pair = Pair(seed=2)
    hidden, logits, anchor = _walk_inputs(pair, B=1)
    n = 20000
    sel = pair.model.candidate_selector(hidden.expand(n, -1, -1), logits.expand(n, -1, -1), anchor.expand(n), 1.5,
                                        torch.Generator().manual_seed(0))
    torch.testing.assert_close(sel.q.sum(-1), torch.ones(n, hidden.shape[1]))
    q0 = sel.q[0, 0]
    freq = (sel.tokens[:, :1] == sel.candidates[0, 0][None]).float().mean(0)
    assert (freq - q0).abs().max() < 4 * (q0 * (1 - q0) / n).sqrt().max() + 1e-3
    assert torch.isin(sel.tokens, sel.candidates.flatten(1)).all()


@torch.no_grad()
def test_forward_drafts_the_oracle_block():
    """The engine call (context, caches, anchor -> drafts) equals the oracle's model + propose."""
    pair = Pair(seed=4)
    g = torch.Generator().manual_seed(6)
    B, taps = 3, pair.cfg.num_taps * pair.cfg.hidden_size
    tapped = torch.randn(B, 7, taps, generator=g)
    anchor = torch.randint(0, V, (B,), generator=g)
    caches = [DraftKVCache() for _ in range(B)]
    got = pair.model(list(tapped), caches, anchor, pair.embed, pair.head)
    ids = pair.model.block_ids(anchor)
    hidden = oracle_block(pair, _make_cache(pair.oracle.config), tapped, ids, 7)[:, 1:]
    tokens, _, _ = pair.oracle.propose(hidden, anchor, pair.head, 0.0)
    assert got.tokens.shape == (B, pair.cfg.num_drafts)
    assert torch.equal(got.tokens, tokens)

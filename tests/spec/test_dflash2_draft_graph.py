"""The DFlash2 drafter forward in one CUDA graph per batch size (spec/dflash2/draft_graph.py), without a GPU.

`static_draft` reads only device values (slot indices, anchors, the store's starts / ends) at shapes fixed by the
batch size (whole-ring views); run eagerly it must be bitwise the eager drafter on a static-view store, padding
rows included, over rounds whose contexts wrap the sliding rings. `DraftGraphs.capture(graphs=False)` runs the
captured function eagerly on the static buffers, so an engine run through it proposes exactly what the eager
drafter proposes, round for round.
"""

from __future__ import annotations

import pytest
import torch

from revolta.spec.dflash2.context_store import DraftContextStore
from revolta.spec.dflash2.draft_graph import DraftGraphs, static_draft
from revolta.spec.dflash2.model import DFlash2DraftModel
from test_dflash2_engine import dflash2, drafter_dir, model  # noqa: F401
from test_engine import Req, assert_clean, ids
from test_spec_engine import make_engine, run


@torch.no_grad()
def test_static_draft_is_bitwise_the_eager_block_on_whole_rings(model, drafter_dir):  # noqa: F811
    engine = make_engine(model, dflash2(drafter_dir))
    draft: DFlash2DraftModel = engine.drafter.drafter
    embed, head = engine.drafter.text.embed_tokens, model.compute_logits
    store = DraftContextStore(draft.cfg, 6, 256, "cpu", torch.float32, static_view=True,
                              num_kv_heads=draft.num_kv_heads)
    g = torch.Generator().manual_seed(0)
    for slot, (start, n) in enumerate([(0, 5), (3, 70), (0, 130), (40, 1)]):  # 70, 130: past the 64-row window
        store.reset(slot, start)
        draft.extend_slots(store, [(slot, torch.randn(n, draft.fc.in_features, generator=g))])
    slots, anchors = [2, 0, 3, 1], torch.tensor([11, 7, model.cfg.text.vocab_size - 1, 3])
    eager = draft.block_hidden_slots(draft.block_embeds(anchors, embed), store, slots)
    static = draft.block_hidden_batch(draft.block_embeds(anchors, embed), store, store.ring_batch(torch.tensor(slots)))
    assert torch.equal(eager, static)
    want = draft.select(eager, anchors, head).tokens
    assert torch.equal(static_draft(draft, store, embed, head, torch.tensor(slots), anchors), want)
    graphs = DraftGraphs(draft, store, embed, head, [2, 8])
    graphs.capture(graphs=False)
    assert torch.equal(graphs.run(slots, anchors), want)  # padded to 8 rows: the real rows are unchanged
    assert torch.equal(graphs.run(slots[:2], anchors[:2]), want[:2])
    assert graphs.slots[:2].tolist() == slots[:2] and graphs.num_replays == 2
    with pytest.raises(ValueError, match="no drafter context yet"):
        graphs.run([5], anchors[:1])
    with pytest.raises(ValueError, match="static_view=True"):
        DraftGraphs(draft, DraftContextStore(draft.cfg, 2, 64, "cpu", torch.float32), embed, head, [1])


@torch.no_grad()
def test_engine_drafts_through_the_drafter_graph_buffers_equal_the_eager_drafter(model, drafter_dir):  # noqa: F811
    """Three requests (padded to the size-4 graph, then the size-2 one as they finish, the last one alone padded
    again): every round's drafts and the greedy output equal the eager drafter's on a static-view store (whose
    output equals the no-spec run's: test_dflash2_engine.py)."""
    prompts = [ids(73, seed=60), ids(5, seed=61), ids(22, seed=62)]  # 73 tokens: the sliding rings wrap
    logs, outs = {}, {}
    for mode in ("eager", "graphs"):
        engine = make_engine(model, dflash2(drafter_dir))
        engine.drafter.store.static_view = True  # what the executor builds with dflash2_draft_graph on a GPU
        if mode == "graphs":
            engine.drafter.capture_graphs([2, 4], graphs=False)
        log, propose = logs.setdefault(mode, []), engine.drafter.propose

        def spy(items, propose=propose, log=log):
            out = propose(items)
            log.append([list(d) for d in out])
            return out

        engine.drafter.propose = spy
        reqs = [Req(f"r{i}", p, max_tokens=m) for i, (p, m) in enumerate(zip(prompts, (12, 6, 9)))]
        run(engine, reqs)
        outs[mode] = [r.token_ids for r in reqs]
        assert_clean(engine)
        if mode == "graphs":
            assert engine.drafter.graphs.num_replays >= 6
            assert {len(row) for row in log} >= {1, 2, 3}  # rounds of 3 (size 4), 2 and 1 (size 2) requests
    assert logs["graphs"] == logs["eager"] and any(any(d) for d in logs["eager"])
    assert outs["graphs"] == outs["eager"] and all(len(t) == m for t, m in zip(outs["eager"], (12, 6, 9)))


def test_sampled_walks_stay_eager(model, drafter_dir):  # noqa: F811
    engine = make_engine(model, dflash2(drafter_dir, draft_sample_method="probabilistic"))
    with pytest.raises(ValueError, match="greedy walk"):
        engine.drafter.capture_graphs([1])

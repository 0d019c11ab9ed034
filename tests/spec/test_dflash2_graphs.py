"""DFlash2 rounds through the speculative verify and commit graphs' static buffers, without a GPU (issue 19 item 6).

`SpecGraphs(draft_graph=False).capture(graphs=False)` runs the code the graphs capture eagerly on the same static
buffers, at DFlash2's 1 + 7 = 8 rows per request (MTP's tests run 1 + 4). On the CPU torch path every index op is
bound-checked, and each replay's static inputs are checked against the cache they address (slots, pages, page
slots, positions, kept slots and row counts), so an out-of-range index the GPU would read silently fails here.
Greedy tokens equal the run without speculation bitwise; which steps take the graph (steady-state rounds that fit a
captured size) and which run eagerly (a prefill in the step, more requests than the largest size) is checked too.
"""

from __future__ import annotations

import pytest
import torch

from revolta.engine.executor import round_graphs
from revolta.engine.runner import StepInputs
from revolta.spec.graphs import SpecGraphs
from revolta.spec.verify import DraftTokens
from test_dflash2_engine import dflash2, drafter_dir, force_wrong_at_request_index, model  # noqa: F401
from test_engine import Req, assert_clean, ids
from test_spec_engine import assert_same_tokens, make_engine, run


def check_static_inputs(g: SpecGraphs, B: int) -> None:
    """The verify / commit graph of size B reads only rows of the cache that exist, padding on slot 0 / block 0."""
    R, W = g.rows, g.width
    layout = g.runner.storage.layout
    inputs = StepInputs.unpack(g.verify_in, B, B * R, W)
    slots, table = inputs.slots.long(), inputs.block_table.long()
    assert slots.min() >= 0 and slots.max() < layout.num_slots, slots
    assert table.min() >= 0 and table.max() < layout.num_blocks, table
    assert inputs.slot_mapping.min() >= 0 and inputs.slot_mapping.max() < layout.num_blocks * layout.block_size
    assert inputs.cu_seqlens.tolist() == [b * R for b in range(B + 1)]  # exactly R rows per request
    seq_lens = inputs.seq_lens.long()
    assert seq_lens.min() >= R and seq_lens.max() <= W * layout.block_size, seq_lens
    rows = torch.arange(R).repeat(B)
    assert torch.equal(inputs.positions[0], seq_lens.repeat_interleave(R) - R + rows)  # rows end at seq_len - 1
    page = table.gather(1, (inputs.positions[0].view(B, R) // layout.block_size))  # each row's page
    want = page * layout.block_size + inputs.positions[0].view(B, R) % layout.block_size
    assert torch.equal(inputs.slot_mapping.view(B, R), want)  # K/V go to the row's own page (or the null block)
    assert table[slots == 0].eq(0).all()  # padding requests: the null block only
    if not g.replay:
        assert g.draft_table[:B].min() >= 0 and g.draft_table[:B].max() < layout.num_slots
    assert g.keep[:B].min() >= 0 and g.keep[:B].max() < layout.num_slots
    assert g.num_kept[:B].min() >= 1 and g.num_kept[:B].max() <= R


def with_round_buffers(engine, sizes=(1, 2, 4, 8)):
    """The engine's DFlash2 rounds through the verify and commit graphs' static buffers, as on a GPU (no draft
    graph: the drafter drafts eagerly into them), each replay's static inputs checked first."""
    k, bs = engine.spec.num_speculative_tokens, engine.plan.layout.block_size
    width = -(-(engine.config.max_model_len + k) // bs)
    g = SpecGraphs(engine.runner, list(sizes), k, engine.spec.spec_state_replay, width, draft_graph=False)
    g.capture(graphs=False)
    for B, rnd in g.graphs.items():
        assert rnd.draft is None
        verify, commit = rnd.verify, rnd.commit
        rnd.verify = lambda B=B, verify=verify: (check_static_inputs(g, B), verify())
        rnd.commit = lambda B=B, commit=commit: (check_static_inputs(g, B), commit())
    engine.executor.spec_graphs = g
    return engine


def test_round_graphs_are_mtps_or_opted_in_dflash2():
    assert round_graphs("mtp", False) and round_graphs("mtp", True)
    assert not round_graphs("dflash2", False) and round_graphs("dflash2", True)
    assert not round_graphs(None, True)


def test_a_round_without_a_draft_graph_holds_no_draft_buffers(model, drafter_dir):  # noqa: F811
    engine = make_engine(model, dflash2(drafter_dir))
    g = SpecGraphs(engine.runner, [1, 2], 7, False, 4, draft_graph=False)
    assert g.rows == 8 and g.seed_hidden.numel() == g.seed_in.numel() == g.draft_in.numel() == 0
    assert not g.can_seed([])  # no MTP seed graph for this drafter


@pytest.mark.parametrize("replay", [False, True], ids=["per-draft-slots", "replay"])
@torch.no_grad()
def test_rounds_through_the_verify_and_commit_graph_buffers_equal_no_spec(model, drafter_dir, replay):  # noqa: F811
    """6 concurrent requests padded to the size-8 round (then smaller sizes), forced drafts with request i's
    draft i % 8 wrong (7: all right), so every accept length runs through the static buffers at 8 rows."""
    prompts = [ids(5 + 7 * i, seed=30 + i) for i in range(6)]
    plain = [Req(f"r{i}", p, max_tokens=8 + i) for i, p in enumerate(prompts)]  # r0: 8 rounds of one token
    run(make_engine(model, {"method": None}, max_num_seqs=1), plain)
    engine = with_round_buffers(make_engine(model, dflash2(drafter_dir, spec_state_replay=replay)))
    assert engine.spec_graphs.rows == 8
    force_wrong_at_request_index(engine, plain)
    reqs = [Req(r.request_id, r.prompt_token_ids, r.max_tokens) for r in plain]
    run(engine, reqs)
    assert engine.spec_graphs.num_replays > 0 and engine.spec_stats.num_accepted_tokens > 0
    assert_clean(engine)
    assert not engine.drafter.caches
    assert_same_tokens(reqs, plain)


@torch.no_grad()
def test_which_steps_take_the_graph(model, drafter_dir):  # noqa: F811
    """Graphs of sizes 1 and 2, three requests: a step with a prefill in it, or with all three verifying, runs
    eagerly (its own verify forward); a round of one or two verifying requests replays the graph, padded to 2."""
    engine = with_round_buffers(make_engine(model, dflash2(drafter_dir)), sizes=(1, 2))
    g, runner = engine.spec_graphs, engine.runner
    log = []
    graph_verify, eager_verify = g.verify, runner.verify
    g.verify = lambda steps, *a: (log.append(("graph", len(steps))), graph_verify(steps, *a))[1]
    runner.verify = lambda seqs, *a: (log.append(("eager", len(seqs))), eager_verify(seqs, *a))[1]
    steps = []
    reqs = [Req("a", ids(9, seed=1), 6), Req("b", ids(40, seed=2), 14), Req("c", ids(20, seed=3), 22)]

    def on_step(eng):
        steps.append(log[:])
        log.clear()

    run(engine, reqs, on_step)
    kinds = [s[0] for s in steps if s]
    assert ("eager", 3) in kinds and ("graph", 2) in kinds and ("graph", 1) in kinds
    assert all(n <= 2 for kind, n in kinds if kind == "graph")
    assert g.num_replays == sum(kind == "graph" for kind, _ in kinds)
    assert_clean(engine)


@torch.no_grad()
def test_probabilistic_drafts_keep_their_q_through_the_verify_graph(model, drafter_dir):  # noqa: F811
    """The verify graph returns host drafts cut to their counts; the engine must still sample with the
    drafts the drafter proposed (DraftTokens with their proposal distribution), not those copies."""
    engine = with_round_buffers(make_engine(model, dflash2(drafter_dir, draft_sample_method="probabilistic")))
    seen, verify = [], engine.sampler.verify

    def spy(requests, logits, drafts):
        seen.extend(d for d in drafts if d)
        return verify(requests, logits, drafts)

    engine.sampler.verify = spy
    run(engine, [Req("a", ids(20, seed=1), 12), Req("b", ids(9, seed=2), 12)])
    assert engine.spec_graphs.num_replays > 0 and seen
    assert all(isinstance(d, DraftTokens) and d.probs is not None for d in seen)
    assert_clean(engine)

"""Speculative-round graphs without a GPU (spec/graphs.py): padding, which rounds may replay, the
vectorised commit against the per-request loop it replaced, and whole runs through the graphs'
static buffers (`capture(graphs=False)` runs the captured code eagerly on them), greedy tokens and
committed states bitwise equal to the run without speculation on the torch path."""

from __future__ import annotations

import pytest
import torch

from revolta.engine.runner import StepInputs, StepSequence
from revolta.forward import GDNRecord
from revolta.spec.commit import _advance_context, check_replay_slots
from revolta.spec.graphs import SpecGraphs, pad_rows, pad_verify, padding_sequence
from forced_drafts import force_drafts, wrong_at
from test_engine import Req, assert_clean, ids
from test_spec_engine import assert_same_tokens, make_engine, model, recurrent_state, run, state_trace  # noqa: F401

K = 4


def graph_engine(model, replay=False, sizes=(1, 2, 4, 8), **kw):  # noqa: F811
    engine = make_engine(model, {"method": "mtp", "num_speculative_tokens": K, "spec_state_replay": replay}, **kw)
    bs = engine.plan.layout.block_size
    width = -(-(engine.config.max_model_len + K) // bs)
    engine.executor.spec_graphs = SpecGraphs(engine.runner, list(sizes), K, replay, width)
    engine.spec_graphs.capture(graphs=False)
    return engine


def force(engine, refs, wrong=None):
    """Forced drafts (the run without speculation's tokens), request rid's draft wrong(rid) altered."""
    vocab = engine.model.cfg.text.vocab_size
    force_drafts(engine, refs, None if wrong is None else lambda rid, d: wrong_at(d, wrong(rid), vocab))


def test_padding_rows_sit_on_the_dummy_slot_and_null_block(model):  # noqa: F811
    engine = make_engine(model, {"method": "mtp", "num_speculative_tokens": K})
    runner, bs = engine.runner, engine.plan.layout.block_size
    steps = [StepSequence([7], 40, [3, 5, 9], slot=4), StepSequence([8], 14, [6], slot=2)]
    seqs = pad_verify(steps, [[1, 2, 3, 4], [5, 6]], 4, K + 1, bs)
    # request 1 verifies 2 drafts: its two extra rows are zeros, their positions 17, 18 on the null block
    assert [s.token_ids for s in seqs] == [[7, 1, 2, 3, 4], [8, 5, 6, 0, 0], [0] * 5, [0] * 5]
    assert [s.block_ids for s in seqs] == [[3, 5, 9], [6, 0], [0], [0]]
    assert padding_sequence(K + 1, 2).block_ids == [0, 0, 0]
    inputs = StepInputs.unpack(runner.pack_step(seqs, width=6), 4, 4 * (K + 1), 6)
    assert inputs.cu_seqlens.tolist() == [0, 5, 10, 15, 20]  # exactly R rows per request, padding included
    assert inputs.slots.tolist() == [4, 2, 0, 0]
    assert inputs.block_table[2:].eq(0).all() and inputs.slot_mapping[10:].lt(bs).all()  # null block 0 only
    assert inputs.slot_mapping[:5].tolist() == [9 * bs + (40 + j) % bs for j in range(5)]  # positions 40.. in page 2
    assert inputs.slot_mapping[5:10].tolist() == [6 * bs + 14, 6 * bs + 15, 0, 1, 2]
    with pytest.raises(ValueError, match="at most 4 drafts"):
        pad_verify(steps, [[1, 2, 3, 4, 5], [5, 6]], 4, K + 1, bs)
    assert pad_rows([[4, 11, 12], [2]], 3, 3) == [[4, 11, 12], [2, 0, 0], [0, 0, 0]]


def test_which_rounds_replay_a_graph(model):  # noqa: F811
    engine = make_engine(model, {"method": "mtp", "num_speculative_tokens": K})
    g = SpecGraphs(engine.runner, [1, 2, 4], K, False, max_blocks_per_seq=4)
    one = StepSequence([7], 40, [3, 5, 9], slot=4)
    assert g.can_run([one] * 3, [K] * 3)
    assert not g.can_run([], [])
    assert not g.can_run([one] * 5, [K] * 5)  # above the largest size
    assert g.can_run([one, one], [K, 1])  # fewer drafts near max_model_len / max_tokens: the rows are kept
    assert g.can_run([one, one], [K, 0])  # a request at its last token: its one row, the rest as rejected drafts
    assert g.can_run([one], [0])
    assert not g.can_run([StepSequence([7, 8], 40, [3, 5, 9], slot=4)], [K])  # not one definite token
    assert not g.can_run([StepSequence([7], 40, [1, 2, 3, 4, 5], slot=4)], [K])  # wider than the table
    media = StepSequence([7], 40, [3, 5, 9], slot=4, mm_embeds=torch.zeros(1, 8), mm_index=[0])
    assert not g.can_run([media], [K])
    with pytest.raises(ValueError, match="keep_slots"):
        check_replay_slots([3, 4], [3, 9], replay=True)
    check_replay_slots([3, 4], [3, 9], replay=False)


def _advance_context_loop(history, input_ids, cu_seqlens, num_kept):
    """The per-request loop commit.py used before (the oracle)."""
    keep = history.shape[1]
    rows = []
    for b, (start, n) in enumerate(zip(cu_seqlens[:-1].tolist(), num_kept.tolist())):
        ids_ = torch.cat([history[b], input_ids[start:start + n].to(history.dtype)])
        rows.append(ids_[ids_.shape[0] - keep:])
    return torch.stack(rows)


@pytest.mark.parametrize("order", [2, 3, 5])
def test_vectorised_context_advance_equals_the_loop(order):
    g = torch.Generator().manual_seed(order)
    for _ in range(20):
        lens = torch.randint(1, 7, (5,), generator=g)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)
        ids_ = torch.randint(0, 1000, (int(cu[-1]),), generator=g)
        history = torch.randint(0, 1000, (5, order - 1), generator=g, dtype=torch.int32)
        kept = torch.stack([torch.randint(1, int(n) + 1, (), generator=g) for n in lens]).to(torch.int32)
        assert torch.equal(_advance_context(history, ids_, cu, kept), _advance_context_loop(history, ids_, cu, kept))


def test_vectorised_slot_carry_equals_copying_the_moved_slots(model):  # noqa: F811
    """commit_verified now carries every request's small slot tensors (an identity copy where nothing
    moved) instead of copy_slots over the moved pairs: same tensors bitwise."""
    a, b = make_engine(model, {"method": "mtp"}), make_engine(model, {"method": "mtp"})
    g = torch.Generator().manual_seed(0)
    for x, y in zip(a.storage.slot_tensors(), b.storage.slot_tensors()):
        v = torch.randint(-50, 50, x.shape, generator=g).to(x.dtype)
        x.copy_(v), y.copy_(v)
    slots, keep = [3, 5, 7, 0, 0], [3, 11, 12, 0, 0]  # request 0 kept its slot; two padding rows
    a.storage.copy_slots([(s, k) for s, k in zip(slots, keep) if s != k], skip_gdn_state=True)
    src, dst = torch.tensor(slots), torch.tensor(keep)
    for x in b.storage.slot_tensors(skip_gdn_state=True):
        x.index_copy_(0, dst, x.index_select(0, src))
    for x, y in zip(a.storage.slot_tensors(), b.storage.slot_tensors()):
        assert torch.equal(x, y)


def test_records_must_live_in_the_shared_buffers(model):  # noqa: F811
    """The commit graph reads the verify's records after it: they must be views of the shared buffers."""
    engine = make_engine(model, {"method": "mtp", "num_speculative_tokens": K})
    g = SpecGraphs(engine.runner, [1, 2], K, True, max_blocks_per_seq=4)
    kept = g._buffer(1, "gdn0.mixed", (K + 1, 8), torch.float32)
    assert g.shared["gdn0.mixed"].shape == (2 * (K + 1), 8)  # sized for the largest batch
    g._check_records({"gdn0": GDNRecord(0, kept, (kept[:, :2],) * 5, 1.0)})
    with pytest.raises(RuntimeError, match=r"gdn0.replay_inputs is not in VerifyMeta.buffers"):
        g._check_records({"gdn0": GDNRecord(0, kept, (kept.clone(),) * 5, 1.0)})
    with pytest.raises(RuntimeError, match="must scale with the batch size"):
        g._buffer(1, "gdn0.mixed", (K + 1, 9), torch.float32)


@pytest.mark.parametrize("replay", [False, True], ids=["per-draft-slots", "replay"])
@pytest.mark.parametrize("drafter", ["mtp", "forced"])
@torch.no_grad()
def test_rounds_through_the_graph_buffers_equal_no_spec(model, replay, drafter):  # noqa: F811
    """6 concurrent requests (padded to the size-8 round, then smaller sizes as they finish), forced
    drafts with request i's draft i % 5 wrong (every accept length), or the MTP head's own."""
    prompts = [ids(5 + 7 * i, seed=30 + i) for i in range(6)]
    plain = [Req(f"r{i}", p, max_tokens=9 + i) for i, p in enumerate(prompts)]
    run(make_engine(model, {"method": None}, max_num_seqs=1), plain)
    engine = graph_engine(model, replay)
    if drafter == "forced":
        force(engine, {r.request_id: (len(r.prompt_token_ids), r.token_ids) for r in plain},
              lambda rid: int(rid[1:]) % 5)
    reqs = [Req(r.request_id, r.prompt_token_ids, r.max_tokens) for r in plain]
    run(engine, reqs)
    assert engine.spec_graphs.num_replays > 0, "no round ran through the graph buffers"
    if drafter == "forced":
        assert engine.spec_stats.num_accepted_tokens > 0
    assert_clean(engine)
    assert_same_tokens(reqs, plain)


@pytest.mark.parametrize("replay", [False, True], ids=["per-draft-slots", "replay"])
@torch.no_grad()
def test_a_request_at_its_last_token_keeps_its_round_in_the_graphs(model, replay):  # noqa: F811
    """Requests decoding side by side that end on max_tokens in different rounds: the round where one has no room
    left for a draft still runs through the graph buffers (before, the whole batch's round ran eagerly), and the
    tokens equal the run without speculation."""
    prompts = [ids(8, seed=50 + i) for i in range(3)]
    plain = [Req(f"r{i}", p, max_tokens=6 + 3 * i) for i, p in enumerate(prompts)]
    run(make_engine(model, {"method": None}, max_num_seqs=1), plain)
    engine = graph_engine(model, replay)
    eager = []  # the steps that verified outside the graph buffers (runner.verify: the eager verify forward)
    verify = engine.runner.verify
    engine.runner.verify = lambda steps, *a, **k: eager.append([len(s.token_ids) for s in steps]) or verify(
        steps, *a, **k)
    reqs = [Req(r.request_id, r.prompt_token_ids, r.max_tokens) for r in plain]
    run(engine, reqs)
    assert engine.spec_graphs.num_replays >= 3
    assert not eager, f"rounds verified eagerly (rows per request): {eager}"
    assert_clean(engine)
    assert_same_tokens(reqs, plain)


@pytest.mark.parametrize("replay", [False, True], ids=["per-draft-slots", "replay"])
@torch.no_grad()
def test_graph_rounds_commit_the_state_of_the_non_spec_run(model, replay):  # noqa: F811
    prompt, n = ids(21, seed=5), 17
    base_trace: dict[int, list] = {}
    base = make_engine(model, {"method": None})
    plain = Req("a", prompt, n)
    run(base, [plain], state_trace(base, "a", base_trace))
    engine = graph_engine(model, replay, sizes=(1, 2))
    rounds = iter(range(1000))
    force(engine, {"a": (len(prompt), plain.token_ids)}, lambda rid: next(rounds) % 5)  # accept 0..4 in turn
    trace: dict[int, list] = {}
    req = Req("a", prompt, n)
    run(engine, [req], state_trace(engine, "a", trace))
    assert req.token_ids == plain.token_ids
    assert engine.spec_graphs.num_replays >= 3
    assert len(trace) >= 3 and set(trace) <= set(base_trace)
    for computed, state in trace.items():
        for x, y in zip(state, base_trace[computed]):
            assert torch.equal(x, y), f"state differs after {computed} tokens"
    assert_clean(engine)


@torch.no_grad()
def test_graph_drafts_equal_the_eager_drafters(model):  # noqa: F811
    """The MTP seed padded to R rows per request (rows past the pending ones at the positions the
    draft steps write next) and the draft steps on the static buffers propose what the eager drafter
    proposes, round for round: the padding leaves nothing a later MTP row reads."""
    logs = {}
    for mode in ("eager", "graphs"):
        engine = graph_engine(model) if mode == "graphs" else make_engine(model, {"method": "mtp",
                                                                                 "num_speculative_tokens": K})
        log, propose = logs.setdefault(mode, []), engine.drafter.propose

        def spy(items, *graphs, propose=propose, log=log):
            out = propose(items, *graphs)
            rows = out.tolist() if isinstance(out, torch.Tensor) else out
            log.append([d[:it.num_drafts] for it, d in zip(items, rows)])
            return out

        engine.drafter.propose = spy
        run(engine, [Req(f"r{i}", ids(5 + 7 * i, seed=30 + i), max_tokens=30) for i in range(3)])
        if mode == "graphs":
            assert engine.spec_graphs.num_replays >= 20
    assert logs["graphs"] == logs["eager"]

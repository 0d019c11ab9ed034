"""On a GPU: speculative rounds replayed from CUDA graphs (spec/graphs.py) against the eager rounds.

The same requests with the same forced drafts (request i's draft i % 5 wrong: every accept length,
and fewer drafts near max_tokens) through an engine with graphs and one with enforce_eager: the
verify rows handed to sampling agree within rounding round after round (so the draft steps, the
verify and the commit all match the eager path), the tokens are identical, and most rounds really
replayed a graph, padded from 3 requests to the captured 4. The graphs' memory is counted against
the reserve.

DFlash2 (EngineConfig.dflash2_graph_rounds; on by default since F1 run I, benchmarks/RESULTS.md S2b) drafts into the
verify and commit graphs, 1 + 7 = 8 rows per request, at C1 and C8: the earlier attempt hit a CUDA illegal memory
access in the replay-mode round on cold whole-directory runs; benchmarks/sanitize_dflash2.sh runs these tests under
compute-sanitizer memcheck.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

from revolta.engine import Engine, EngineConfig
from revolta.presets.default_drafter import init_drafter_weights
from revolta.spec.dflash2.checkpoint import save_draft_model
from revolta.spec.dflash2.draft_config import DFlash2DraftConfig
from revolta.spec.dflash2.model import DFlash2DraftModel
from test_spec_gpu import Req, force, model  # noqa: F401  (the MTP test model)

sys.path.insert(0, str(Path(__file__).parents[1] / "spec"))  # the DFlash2 drafter fixture of the CPU tests
from dflash2_fixtures import drafter_config  # noqa: E402

pytestmark = pytest.mark.gpu


def record_calls(engine, calls):
    """Keep each sampling call's draft counts and logits rows (the engine samples greedily itself)."""
    sampler = engine.sampler
    sample, verify = sampler.sample, sampler.verify

    def sample_spy(requests, logits):
        calls.append(([0] * len(requests), logits.float().clone()))
        sample(requests, logits)

    def verify_spy(requests, logits, drafts):
        calls.append(([len(d) for d in drafts], logits.float().clone()))
        return verify(requests, logits, drafts)

    sampler.sample, sampler.verify = sample_spy, verify_spy


def spec_run(model, prompts, refs, eager, replay, spec=None, size=4, draft_graph=False):  # noqa: F811
    spec = {"method": "mtp", **(spec or {}), "spec_state_replay": replay}
    engine = Engine(model, EngineConfig(max_model_len=512, max_num_seqs=max(4, size), max_num_batched_tokens=256,
                                        kv_cache_gib=0.5, kernels="triton", enforce_eager=eager,
                                        cudagraph_capture_sizes=(size,), speculative_config=spec,
                                        dflash2_graph_rounds=spec["method"] == "dflash2",
                                        dflash2_draft_graph=draft_graph))
    # MTP4: request i's draft i % 5 wrong; DFlash2 (7 drafts): draft (i + 3) % 8 (7: all right), so C1 accepts too
    mod, shift = (5, 0) if spec["method"] == "mtp" else (8, 3)
    force(engine, refs, lambda rid: (int(rid[1:]) + shift) % mod)
    calls = []
    reqs = [Req(f"r{i}", p, 21 + 3 * i) for i, p in enumerate(prompts)]
    for r in reqs:
        engine.add_request(r)
    record_calls(engine, calls)
    with torch.no_grad():
        while engine.has_unfinished():
            engine.step()
    return engine, reqs, calls


@pytest.fixture(scope="module")
def drafter_dir(model, tmp_path_factory):  # noqa: F811
    """A 3-layer DFlash2 drafter (two sliding layers) for the test model, random weights, on disk."""
    d = DFlash2DraftModel(DFlash2DraftConfig.from_dict(drafter_config(model.cfg), source="gpu test drafter"))
    init_drafter_weights(d, seed=4)
    return str(save_draft_model(d, tmp_path_factory.mktemp("dflash2")))


# (method, requests, captured size, DFlash2's drafter forward in a graph too)
CASES = [("mtp", 3, 4, False), ("dflash2", 1, 1, False), ("dflash2", 8, 8, False), ("dflash2", 8, 8, True)]


@pytest.mark.parametrize("replay", [False, True], ids=["per-draft-slots", "replay"])
@pytest.mark.parametrize("method,num_reqs,size,draft_graph", CASES,
                         ids=["mtp-C3", "dflash2-C1", "dflash2-C8", "dflash2-C8-draft-graph"])
def test_graph_rounds_equal_eager_rounds(model, replay, method, num_reqs, size, draft_graph, request):  # noqa: F811
    """MTP rounds replay draft + verify + commit graphs; DFlash2 rounds draft eagerly (or replay the drafter's
    graph) and replay verify + commit. The forced drafts replace the drafter's, so every run verifies the same."""
    # every decode step drafts (the adaptive policy may pause a drafter its measured rows call slower)
    spec = {"method": "dflash2", "model": request.getfixturevalue("drafter_dir"), "draft_policy": "always"} \
        if method == "dflash2" else None
    g = torch.Generator().manual_seed(1)
    lens = (9, 70, 33, 140, 17, 64, 8, 111)[:num_reqs]
    prompts = [torch.randint(0, 4000, (n,), generator=g).tolist() for n in lens]
    plain = Engine(model, EngineConfig(max_model_len=512, max_num_seqs=8, kv_cache_gib=0.5, kernels="triton",
                                       speculative_config={"method": None}))
    base = [Req(f"r{i}", p, 21 + 3 * i) for i, p in enumerate(prompts)]
    for r in base:
        plain.add_request(r)
    with torch.no_grad():
        while plain.has_unfinished():
            plain.step()
    refs = {r.request_id: (len(r.prompt_token_ids), r.token_ids) for r in base}
    eager, ref_reqs, ref_calls = spec_run(model, prompts, refs, True, replay, spec, size)
    graph, got_reqs, got_calls = spec_run(model, prompts, refs, False, replay, spec, size, draft_graph)
    if method == "dflash2":
        assert (graph.drafter.graphs is not None) == draft_graph and eager.drafter.graphs is None
        assert not draft_graph or graph.drafter.graphs.num_replays >= 5
    assert eager.spec_graphs is None and graph.spec_graphs.batch_sizes == [size]
    assert graph.spec_graphs.draft_graph == (method == "mtp")
    assert graph.spec_graphs.rows == (5 if method == "mtp" else 8)
    assert graph.spec_graphs.num_replays >= (8 if method == "mtp" else 5), graph.spec_graphs.num_replays
    assert graph.spec_stats.num_accepted_tokens > 0
    for r, g_ in zip(ref_reqs, got_reqs):
        assert g_.token_ids == r.token_ids, r.request_id
    assert len(got_calls) == len(ref_calls)
    worst = 0.0
    for (dl, a), (dl2, b) in zip(got_calls, ref_calls):
        assert dl == dl2
        worst = max(worst, ((a - b).abs().max() / b.abs().max()).item())
    print(f"{method} C{num_reqs} graph vs eager rounds: worst relative logit difference {worst:.3g}")
    assert worst <= 1e-4


def test_graph_memory_counts_against_the_reserve(model, caplog):  # noqa: F811
    with caplog.at_level(logging.INFO, logger="revolta.engine"):  # the engine's and its executor's logs
        engine = Engine(model, EngineConfig(max_model_len=512, max_num_seqs=2, kernels="triton",
                                            gpu_memory_utilization=0.05, cudagraph_mem_mib=1,
                                            speculative_config={"method": "mtp"}))
    g = engine.spec_graphs
    assert g.batch_sizes == [1, 2] and g.used_bytes > 2**20
    assert engine.plan.budget.cudagraph_reserve_bytes == 2**20
    assert any("speculative round" in r.message and "MiB" in r.message for r in caplog.records)
    over = g.used_bytes > 2**20 + 64 * 2**20  # graph_warning's slack: max(64 MiB, 5% of the reserve)
    warned = any("CUDA graphs use" in r.message and "cudagraph_mem_mib=" in r.message for r in caplog.records)
    assert warned == over, (g.used_bytes, warned)


def test_dflash2_takes_its_graphs_by_default(model, drafter_dir):  # noqa: F811
    """With neither option given a GPU engine runs DFlash2 rounds through the verify / commit graphs and the drafter's
    own graphs (greedy drafts); False keeps them eager."""
    spec = {"method": "dflash2", "model": drafter_dir, "draft_policy": "always"}
    kw = dict(max_model_len=512, max_num_seqs=2, kv_cache_gib=0.5, kernels="triton", cudagraph_capture_sizes=(2,),
              speculative_config=spec)
    on = Engine(model, EngineConfig(**kw))
    assert on.spec_graphs is not None and on.spec_graphs.rows == 8 and on.drafter.graphs is not None
    off = Engine(model, EngineConfig(**kw, dflash2_graph_rounds=False, dflash2_draft_graph=False))
    assert off.spec_graphs is None and off.drafter.graphs is None

"""On a GPU: speculative rounds replayed from CUDA graphs (spec/graphs.py) against the eager rounds.

The same requests with the same forced drafts (request i's draft i % 5 wrong: every accept length,
and fewer drafts near max_tokens) through an engine with graphs and one with enforce_eager: the
verify rows handed to sampling agree within rounding round after round (so the draft steps, the
verify and the commit all match the eager path), the tokens are identical, and most rounds really
replayed a graph, padded from 3 requests to the captured 4. The graphs' memory is counted against
the reserve.
"""

from __future__ import annotations

import logging

import pytest
import torch

from revolta.engine import Engine, EngineConfig
from test_spec_gpu import Req, force, model  # noqa: F401  (the MTP test model)

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


def spec_run(model, prompts, refs, eager, replay):  # noqa: F811
    engine = Engine(model, EngineConfig(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=256,
                                        kv_cache_gib=0.5, kernels="triton", enforce_eager=eager,
                                        cudagraph_capture_sizes=(4,),
                                        speculative_config={"method": "mtp", "spec_state_replay": replay}))
    force(engine, refs, lambda rid: int(rid[1:]) % 5)
    calls = []
    reqs = [Req(f"r{i}", p, 21 + 3 * i) for i, p in enumerate(prompts)]
    for r in reqs:
        engine.add_request(r)
    record_calls(engine, calls)
    with torch.no_grad():
        while engine.has_unfinished():
            engine.step()
    return engine, reqs, calls


@pytest.mark.parametrize("replay", [False, True], ids=["per-draft-slots", "replay"])
def test_graph_rounds_equal_eager_rounds(model, replay):  # noqa: F811
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 4000, (n,), generator=g).tolist() for n in (9, 70, 33)]
    plain = Engine(model, EngineConfig(max_model_len=512, max_num_seqs=4, kv_cache_gib=0.5, kernels="triton",
                                       speculative_config={"method": None}))
    base = [Req(f"r{i}", p, 21 + 3 * i) for i, p in enumerate(prompts)]
    for r in base:
        plain.add_request(r)
    with torch.no_grad():
        while plain.has_unfinished():
            plain.step()
    refs = {r.request_id: (len(r.prompt_token_ids), r.token_ids) for r in base}
    eager, ref_reqs, ref_calls = spec_run(model, prompts, refs, True, replay)
    graph, got_reqs, got_calls = spec_run(model, prompts, refs, False, replay)
    assert eager.spec_graphs is None and graph.spec_graphs.batch_sizes == [4]
    assert graph.spec_graphs.num_replays >= 8, graph.spec_graphs.num_replays
    assert graph.spec_stats.num_accepted_tokens > 0
    for r, g_ in zip(ref_reqs, got_reqs):
        assert g_.token_ids == r.token_ids, r.request_id
    assert len(got_calls) == len(ref_calls)
    worst = 0.0
    for (dl, a), (dl2, b) in zip(got_calls, ref_calls):
        assert dl == dl2
        worst = max(worst, ((a - b).abs().max() / b.abs().max()).item())
    print(f"graph vs eager rounds: worst relative logit difference {worst:.3g}")
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

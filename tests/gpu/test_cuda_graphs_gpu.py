"""On a GPU: decode steps replayed from CUDA graphs give what the eager path gives (issue: engine).

The tiny kernel-friendly model of test_kernel_path_gpu runs the same batch of requests through an
engine with graphs and one with enforce_eager: identical greedy tokens, logits within rounding, and
the graph engine really served its decode steps from graphs, also for batch sizes it has to pad.
The memory budget reserves the configured graph memory before the cache is sized.
"""

from __future__ import annotations

import pytest
import torch

from revolta.config import ModelConfig
from revolta.engine import Engine, EngineConfig
from revolta.model import FlashNextModel, init_random_weights

from test_kernel_path_gpu import SMALL, Req, keep_logits, prompts

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=[torch.float32, torch.float16])
def model(request):
    m = FlashNextModel(ModelConfig.from_dict(SMALL), with_mtp=False).eval()
    init_random_weights(m, seed=5)
    return m.to_dtype(request.param).to("cuda")


def run(model, eager, prompt_list, n=20, **kw):
    engine = Engine(model, EngineConfig(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=96,
                                        kernels="triton", enable_prefix_caching=False, kv_cache_gib=1.0,
                                        enforce_eager=eager, **kw))
    keep_logits(engine)
    reqs = [Req(str(i), p, n) for i, p in enumerate(prompt_list)]
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    return engine, reqs


@torch.no_grad()
def test_graph_decode_equals_eager(model):
    # 6 requests: decode batches of 6, 5, ... pad to the captured 8 and 4
    eager_engine, ref = run(model, True, prompts())
    graph_engine, got = run(model, False, prompts())
    assert eager_engine.graphs is None
    graphs = graph_engine.graphs
    assert graphs is not None and graphs.batch_sizes == [1, 2, 4, 8] and graphs.num_replays >= 15
    tol = 1e-4 if model.dtype == torch.float32 else 2e-2
    for r, g in zip(ref, got):
        assert g.token_ids == r.token_ids, r.request_id
        a, b = torch.stack(g.logits), torch.stack(r.logits)
        assert ((a - b).abs().max() / b.abs().max()).item() <= tol, r.request_id


def async_requests(stop=None):
    """The async test's requests (benchmarks/diag_async.py replays them): greedy, one seeded (4), one with logprobs
    (3), one penalised (5), and request 2 stopping at token `stop`."""
    from revolta.engine import Request
    from revolta.engine.sampling import SamplingParams, make_generator

    out = []
    for i, p in enumerate(prompts()):
        params = SamplingParams(temperature=0.8 if i == 4 else 0.0, seed=7 + i, max_tokens=20, ignore_eos=True,
                                stop_token_ids=[stop] if stop is not None and i == 2 else [],
                                logprobs=2 if i == 3 else None,
                                **(dict(repetition_penalty=1.3, frequency_penalty=0.5) if i == 5 else {}))
        out.append(Request(str(i), p, params, generator=make_generator(7 + i, "cuda") if i == 4 else None))
    return out


@torch.no_grad()
def test_async_scheduling_equals_synchronous_graph_decode(model):
    """async_scheduling on the graph path: a chained step's input ids are the previous step's samples, copied on the
    device into the graph's input buffer (gathered from the rows left once a request ended), the sampling parameters
    reach the device through pinned memory, penalties count the token in flight and logprobs are read with the
    tokens: the greedy and seeded tokens and the logprob entries of synchronous steps, with a request stopping while
    its successor is in flight, and the graphs served the chained steps."""
    def generate(async_scheduling, requests):
        # one captured size: a step launched before the host saw a request end still has that request's row (it
        # is dropped afterwards), so with sizes 1, 2, 4, 8 the async engine can replay the 8-row graph where the
        # synchronous one replays the 4-row graph (here: the step after requests 0 and 1 end), and the GPU's
        # kernels round a row differently at different batch sizes; with one graph every decode step runs the
        # same kernels in both engines, so bitwise equality is the contract under test
        engine = Engine(model, EngineConfig(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=96,
                                            kernels="triton", enable_prefix_caching=False, kv_cache_gib=1.0,
                                            cudagraph_capture_sizes=(8,), async_scheduling=async_scheduling))
        for r in requests:
            engine.add_request(r)
        while engine.has_unfinished():
            engine.step()
        engine.step()  # lands a step left in flight
        return engine, [(r.token_ids, r.finish_reason, r.stop_reason, r.logprobs) for r in requests]

    probe = async_requests()
    generate(False, probe)
    stop = probe[2].token_ids[9]
    _, expected = generate(False, async_requests(stop))
    engine, got = generate(True, async_requests(stop))
    for i, (g, e) in enumerate(zip(got, expected)):  # which request and which field, for a failure on one card
        first = next((j for j, (a, b) in enumerate(zip(g[0], e[0])) if a != b), None)
        assert g[0] == e[0], f"request {i}: tokens differ first at {first} ({len(g[0])} / {len(e[0])} tokens)"
        assert g[1:3] == e[1:3], f"request {i}: finish {g[1:3]}, synchronous {e[1:3]}"
        diffs = [(j, t, a[t].logprob - b[t].logprob if t in a else "missing")
                 for j, (a, b) in enumerate(zip(g[3] or [], e[3] or [])) for t in b if a.get(t) != b[t]]
        assert g[3] == e[3], f"request {i}: logprob entries differ (position, token, difference): {diffs[:6]}"
    assert expected[2][2] == stop and len(expected[2][0]) <= 10
    assert engine.num_chained_steps >= 10 and engine.graphs.num_replays >= engine.num_async_steps
    assert engine.graphs.batch_sizes == [8]
    assert not engine.allocator._seqs


@torch.no_grad()
def test_graph_capture_sizes_and_reserve(model, monkeypatch):
    monkeypatch.setenv("REVOLTA_CUDAGRAPH_MEM_MIB", "300")
    engine = Engine(model, EngineConfig(max_model_len=512, max_num_seqs=3, kernels="triton",
                                        gpu_memory_utilization=0.05, cudagraph_capture_sizes=(1, 3)))
    assert engine.plan.budget.cudagraph_reserve_bytes == 300 * 2**20
    assert engine.plan.budget.activation_bytes > 0
    assert engine.graphs.batch_sizes == [1, 3] and engine.graphs.used_bytes > 0
    eager = Engine(model, EngineConfig(max_model_len=512, max_num_seqs=3, kernels="triton",
                                       gpu_memory_utilization=0.05, enforce_eager=True))
    assert eager.plan.budget.cudagraph_reserve_bytes == 0 and eager.graphs is None


def test_no_garbage_collection_inside_a_capture():
    """capture_graph keeps Python's cyclic collector off while it captures (a collection there may tear down an
    unreachable engine's graphs or pinned buffers, whose CUDA calls invalidate the capture: the spec-graph test failed
    that way with a warm Triton cache), and on again after: a captured function that makes enough cyclic garbage to
    trigger collections sees none start during the capture, and replays what it computed."""
    import gc

    from revolta.engine.cuda_graphs import capture_graph

    device = torch.device("cuda")
    x = torch.arange(64.0, device=device)
    during = []

    def watch(phase, info):
        if phase == "start" and torch.cuda.is_current_stream_capturing():
            during.append(info["generation"])

    def fn():
        for i in range(50_000):  # cyclic garbage, far past every generation's allocation threshold
            cell = [i]
            cell.append(cell)
        return x * 2

    gc.callbacks.append(watch)
    try:
        graph, out = capture_graph(fn, torch.cuda.graph_pool_handle(), device)
    finally:
        gc.callbacks.remove(watch)
    assert not during, f"collections of generations {sorted(set(during))} started inside the capture"
    assert gc.isenabled()
    out.zero_()
    graph.replay()
    assert torch.equal(out, x * 2)

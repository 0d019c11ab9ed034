"""When tests/gpu/test_cuda_graphs_gpu.py's async test fails on a GPU: which runs agree (RESULTS.md G1)?

Synchronous against synchronous (are the kernels deterministic?), async against async, async against synchronous;
one capture size (8, as the test) against the default sizes (1, 2, 4, 8), CUDA graphs against eager; the test's
fp32 and fp16 models and requests. Prints "equal" or the first difference per request.

    PYTHONPATH=src python benchmarks/diag_async.py
"""

from __future__ import annotations

import sys

import torch

sys.path[:0] = ["tests/gpu", "tests"]  # the GPU tests' model and requests
from test_cuda_graphs_gpu import async_requests  # noqa: E402
from test_kernel_path_gpu import SMALL  # noqa: E402

from revolta.config import ModelConfig  # noqa: E402
from revolta.engine import Engine, EngineConfig  # noqa: E402
from revolta.model import FlashNextModel, init_random_weights  # noqa: E402


@torch.no_grad()
def gen(model, async_, stop, sizes, eager=False):
    kw = {} if sizes is None else dict(cudagraph_capture_sizes=sizes)
    e = Engine(model, EngineConfig(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=96, kernels="triton",
                                   enable_prefix_caching=False, kv_cache_gib=1.0, enforce_eager=eager,
                                   async_scheduling=async_, **kw))
    rs = async_requests(stop)
    for r in rs:
        e.add_request(r)
    while e.has_unfinished():
        e.step()
    e.step()
    return [(r.token_ids, r.finish_reason, r.logprobs) for r in rs]


def diff(a, b):
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x[0] != y[0]:
            j = next((j for j, (p, q) in enumerate(zip(x[0], y[0])) if p != q), None)
            out.append(f"r{i} tokens@{j}")
        elif x[1] != y[1]:
            out.append(f"r{i} finish")
        elif x[2] != y[2]:
            d = [(j, t, x[2][j][t].logprob - y[2][j][t].logprob) for j in range(len(y[2])) for t in y[2][j]
                 if x[2][j].get(t) != y[2][j][t]]
            out.append(f"r{i} logprobs {d[:3]}")
    return out or "equal"


for dt in (torch.float32, torch.float16):
    m = FlashNextModel(ModelConfig.from_dict(SMALL), with_mtp=False).eval()
    init_random_weights(m, seed=5)
    m = m.to_dtype(dt).to("cuda")
    probe = gen(m, False, None, (8,))
    stop = probe[2][0][9]
    for sizes in ((8,), None):
        s1, s2 = gen(m, False, stop, sizes), gen(m, False, stop, sizes)
        a1, a2 = gen(m, True, stop, sizes), gen(m, True, stop, sizes)
        print(dt, "sizes", sizes, "| sync/sync", diff(s1, s2), "| async/async", diff(a1, a2), "| async/sync",
              diff(a1, s1), flush=True)
    e1, e2 = gen(m, False, stop, None, True), gen(m, True, stop, None, True)
    print(dt, "eager | async/sync", diff(e2, e1), "| eager/graph8 sync", diff(e1, s1), flush=True)

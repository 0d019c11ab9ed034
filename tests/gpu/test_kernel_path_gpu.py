"""On a GPU: the whole tiny model with the Triton kernels vs the torch references (issue: kernels).

Same greedy tokens through the engine (chunked prefill, decode, several requests), logits within
tolerance, and equality with the simple per-sequence torch path in fp32.
"""

from __future__ import annotations

import pytest
import torch

from revolta.config import ModelConfig
from revolta.engine import Engine, EngineConfig
from revolta.model import FlashNextModel, init_random_weights
from revolta.state import SequenceState
from engine_spies import greedy_request, spy_rows

pytestmark = pytest.mark.gpu

L, F = "linear_attention", "full_attention"
SMALL = dict(  # kernel-friendly dims: K=V=64 GDN heads, 128-wide QSA heads, sparse from t = 67
    model_type="qwen4_exp_text", vocab_size=4096, eos_token_id=4095, hidden_size=256, num_hidden_layers=8,
    layer_types=[L, L, L, F] * 2, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[6, 5, 5],
                         mrope_interleaved=True),
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
    num_experts=32, num_experts_per_tok=4, moe_intermediate_size=128, shared_expert_intermediate_size=128,
    hc_lowrank=32, ple_layer_ids=[2], ple_embed_dim=256, heads_per_ngram=4, ngram_vocab_size_base=4099,
    make_ngram_vocab_size_divisible_by=8, indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=64,
    indexer_budget=64, indexer_compress_ratio=4, split_ngram_parts=1, output_gate_type="sigmoid",
)


def Req(rid, prompt, n):
    """A greedy request of exactly n tokens that keeps the logits row of each (`r.logits`, see keep_logits)."""
    r = greedy_request(rid, prompt, n)
    r.logits = []
    return r


def keep_logits(engine) -> None:
    spy_rows(engine, lambda r, rows, emitted: r.logits.extend(rows[:emitted].float().cpu()))


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 4000, (n,), generator=g).tolist() for n in (1, 7, 70, 130, 33, 300)]


def generate(model, kernels, n=24):
    engine = Engine(model, EngineConfig(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=96,
                                        kernels=kernels, enable_prefix_caching=False,
                                        kv_cache_gib=1.0, enforce_eager=True))  # graphs: test_cuda_graphs
    keep_logits(engine)
    reqs = [Req(str(i), p, n) for i, p in enumerate(prompts())]
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    return reqs


def build(dtype):
    m = FlashNextModel(ModelConfig.from_dict(SMALL), with_mtp=False).eval()
    init_random_weights(m, seed=3)
    return m.to_dtype(dtype).to("cuda")


@pytest.fixture(scope="module", params=[torch.float32, torch.float16])
def model(request):
    return build(request.param)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def truth_logits(truth_model, r):
    """The fp32 model's logits for each token `r` emitted, on `r`'s own tokens: [n, V]."""
    full = torch.tensor([r.prompt_token_ids + r.token_ids[:-1]], device="cuda")
    return truth_model(full)[0, len(r.prompt_token_ids) - 1:].float().cpu()


@torch.no_grad()
def test_triton_path_same_greedy_tokens_as_torch_path(model):
    ref, got = generate(model, "torch"), generate(model, "triton")
    if model.dtype == torch.float32:
        for r, g in zip(ref, got):
            assert g.token_ids == r.token_ids, r.request_id
            assert rel_err(torch.stack(g.logits), torch.stack(r.logits)) <= 2e-3, r.request_id
        return
    # fp16: both paths round at different points, and a rounding difference can flip a discrete choice (a
    # top-10 expert or a QSA block near a tie), which moves that row's logits by a few percent. On the
    # H200 (2026-12-04) such rows sit in different requests on the two paths (torch path 4.2% on request
    # 2, Triton path 2.4% on request 1; swapping the MoE ops moves the Triton spike to another request),
    # so each path is compared with the fp32 model on its own tokens, row by row: the typical (median) row
    # must be as accurate as the torch path's, no row may be off by more than a flip's size, and the two
    # paths may part only where the fp32 model itself sees a tie closer than those rows' errors
    truth_model = build(torch.float32)
    rows_a, rows_b = [], []
    for r, g in zip(ref, got):
        a, b = torch.stack(g.logits), torch.stack(r.logits)
        truth_a, truth_b = truth_logits(truth_model, g), truth_logits(truth_model, r)
        err_a, err_b = row_rel_err(a, truth_a), row_rel_err(b, truth_b)
        rows_a.append(err_a)
        rows_b.append(err_b)
        if g.token_ids != r.token_ids:
            i = next(j for j, (x, y) in enumerate(zip(g.token_ids, r.token_ids)) if x != y)
            gap = (truth_b[i, r.token_ids[i]] - truth_b[i, g.token_ids[i]]).abs().item()
            assert gap <= 2 * (err_a[i] + err_b[i]).item() * truth_b[i].abs().max().item(), (r.request_id, i, gap)
    rows_a, rows_b = torch.cat(rows_a), torch.cat(rows_b)
    assert rows_a.median() <= 1.5 * rows_b.median() + 1e-3, (rows_a.median(), rows_b.median())
    assert rows_a.max() <= 0.08, rows_a.max()


def row_rel_err(a, b):
    """Per row: max |a - b| over the row's largest |b|: [n]."""
    return (a - b).abs().amax(dim=-1) / b.abs().amax(dim=-1)


@torch.no_grad()
def test_fp32_paged_triton_equals_simple_state_path(model):
    if model.dtype != torch.float32:
        pytest.skip("the simple path comparison is an fp32 numerics check")
    got = generate(model, "triton", n=12)
    for r in got:
        st, out = SequenceState(), []
        logits = model(torch.tensor(r.prompt_token_ids, device="cuda"), cu_seqlens=[0, len(r.prompt_token_ids)],
                       states=[st])[-1]
        for _ in range(12):
            out.append(int(logits.argmax()))
            logits = model(torch.tensor(out[-1:], device="cuda"), cu_seqlens=[0, 1], states=[st])[-1]
        assert r.token_ids == out, r.request_id

"""Packed (int4 / fp4) checkpoints under TP on real processes (gloo, fp32 activations): the tool-written tiny
checkpoints of tests/quant (AutoAWQ GEMM with fused experts, compressed-tensors asymmetric int4 and NVFP4 per
expert), loaded by slices at TP2, give TP1's logits within 1e-5 relative and its greedy tokens; each rank holds
its whole groups (the packed bytes `revolta info --tp 2` reports, its reads less than the checkpoint); a split that would cut a
quantization group is refused naming the tensor before any weight is read.

The tiny model's expert widths are 64 here (32 in tests/quant), so TP2 leaves each rank one whole group of 32.
"""

from __future__ import annotations

import pytest
import torch
from quant_checkpoints import write_quantized

from revolta.config import ModelConfig
from revolta.layers.linear import QuantLinear
from revolta.layers.quant_moe import QuantExperts
from revolta.model import FlashNextModel, init_random_weights, load_model
from revolta.parallel import ParallelConfig, ParallelConfigError, ParallelContext
from revolta.parallel.layers import RowParallelQuantLinear
from revolta.parallel.load import load_rank_checkpoint
from revolta.parallel.shard import build_rank_model
from revolta.quantized import weights_per_gpu
from revolta.state import SequenceState
from tp_run import COLLECTIVE_TIMEOUT, run_ranks
from tp_tiny import tiny

CASES = (("awq", True), ("ct-int4-asym", False), ("ct-nvfp4", False))
STEPS = 4


def _packed_bytes(model) -> int:
    """The packed weights' bytes (not the kernels' split-K counters the layers also hold)."""
    holders = [h for m in model.modules() if isinstance(m, (QuantLinear, QuantExperts))
               for h in ((m,) if isinstance(m, QuantLinear) else (m.gate_up_proj, m.down_proj))]
    return sum(t.numel() * t.element_size() for h in holders for t in h.packed().values())


@torch.no_grad()
def _run(model: FlashNextModel, ids: torch.Tensor) -> dict:
    """Full-sequence logits [B, S, V]; greedy tokens from a prefill then STEPS single-token decodes with state."""
    full = model(ids)
    B, S = ids.shape
    states = [SequenceState() for _ in range(B)]
    cu = [b * S for b in range(B + 1)]
    nxt = model(ids.reshape(-1), cu_seqlens=cu, states=states, logits_indices=torch.tensor(cu[1:]) - 1).argmax(-1)
    tokens = [nxt]
    for _ in range(STEPS - 1):
        nxt = model(nxt, cu_seqlens=list(range(B + 1)), states=states).argmax(-1)
        tokens.append(nxt)
    return {"full": full, "tokens": torch.stack(tokens, 1), "packed_bytes": _packed_bytes(model)}


def _rank(rank: int, tp: int, group, dirs: list[str], ids: torch.Tensor) -> list[dict]:
    ctx = ParallelContext.from_group(group, timeout=COLLECTIVE_TIMEOUT)
    out = []
    for d in dirs:
        cfg = ModelConfig.from_pretrained(d)
        model = build_rank_model(cfg, ParallelConfig(tp), ctx, with_vision=False)
        stats = load_rank_checkpoint(model, d, rank, tp)
        row = [m for m in model.modules() if isinstance(m, RowParallelQuantLinear)]
        assert len(row) >= 4, "o_proj / out_proj should be packed row-parallel linears"
        out.append(dict(_run(model, ids), bytes_read=stats.bytes_read))
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    cfg = tiny(moe_intermediate_size=64, shared_expert_intermediate_size=64)
    model = FlashNextModel(cfg, with_vision=False).eval()
    init_random_weights(model, seed=3)
    root = tmp_path_factory.mktemp("tp_quant")
    for fmt, fused in CASES:
        write_quantized(model, root / fmt, fmt, fused_experts=fused)
    return root


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_tp2_packed_checkpoints_give_tp1_logits_and_tokens(ckpts, tmp_path):
    torch.manual_seed(0)
    ids = torch.randint(0, 500, (2, 13))
    dirs = [str(ckpts / fmt) for fmt, _ in CASES]
    ref = [_run(load_model(d, progress=False, with_vision=False), ids) for d in dirs]
    cfg = [ModelConfig.from_pretrained(d) for d in dirs]
    ranks = run_ranks(_rank, 2, tmp_path, dirs, ids, timeout_s=240)
    for i, (fmt, _) in enumerate(CASES):
        size = sum(f.stat().st_size for f in (ckpts / fmt).glob("*.safetensors"))
        for r, got in enumerate(ranks):
            assert _rel(got[i]["full"], ref[i]["full"]) <= 1e-5, f"{fmt} rank {r}"
            assert torch.equal(got[i]["tokens"], ref[i]["tokens"]), f"{fmt} rank {r}"
            # `revolta info --tp 2` reports what a rank holds: less than TP1, more than half (replicated MTP fc_*)
            assert got[i]["packed_bytes"] == weights_per_gpu(cfg[i], 2)["packed"], fmt
            assert ref[i]["packed_bytes"] // 2 < got[i]["packed_bytes"] < ref[i]["packed_bytes"]
            assert got[i]["bytes_read"] < size


def test_split_that_cuts_a_group_is_refused_naming_the_tensor(ckpts):
    from dataclasses import replace

    from revolta.parallel.packed import packed_slices, packed_tensors
    from revolta.quantized import meta_model

    cfg = ModelConfig.from_pretrained(ckpts / "awq")
    narrow = replace(cfg, text=replace(cfg.text, moe_intermediate_size=32))  # 16 inputs per rank: half a group
    with pytest.raises(ParallelConfigError, match=r"tensor_parallel_size=2 splits experts' down_proj.*group 32"):
        build_rank_model(narrow, ParallelConfig(2), ParallelContext(0, 2, object()), with_vision=False)
    name = "model.language_model.layers.0.mlp.experts.down_proj.qzeros"  # [E, I/32, H/8]
    pt = packed_tensors(meta_model(narrow, with_vision=False))[name]
    with pytest.raises(ParallelConfigError, match=rf"{name}: tensor_parallel_size=2 .* input features \[\(16, 32\)\]"
                                                  r".*quantization group 32"):
        packed_slices(name, pt, narrow.text, 1, 2)
    ok = packed_tensors(meta_model(cfg, with_vision=False))[name]
    assert packed_slices(name, ok, cfg.text, 1, 2).ranges == ((1, 2),)  # the second of the two groups


def test_llm_tp2_on_an_awq_checkpoint_gives_the_tp1_tokens(ckpts, one_thread):
    from revolta import LLM
    from revolta.engine.sampling import SamplingParams

    prompts = [{"prompt_token_ids": [(7 * i + 3 * n) % 500 for i in range(n)]} for n in (21, 9)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    args = dict(model=str(ckpts / "awq"), device="cpu", max_model_len=64, max_num_seqs=2, block_size=16,
                kv_cache_gib=0.004, speculative_config={"method": None})
    want = [o.outputs[0].token_ids for o in LLM(**args).generate(prompts, params, use_tqdm=False)]
    llm = LLM(tensor_parallel_size=2, **args)
    try:
        assert isinstance(llm.model.model.language_model.layers[3].self_attn.o_proj, RowParallelQuantLinear)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.close()
    assert got == want and all(len(t) == 5 for t in got)


def test_tp4_ranks_load_exactly_their_whole_groups(tmp_path):
    """TP4 (expert and GDN value widths 128: one group of 32 per rank): each rank's packed tensors are its slices of the TP1-loaded
    ones (per-expert AWQ files assembled, then cut), and a rank reads exactly its parts."""
    from revolta.parallel.packed import packed_tensors
    from revolta.parallel.shard import rank_slices, shard_state_dict
    from revolta.quantized import meta_model

    cfg = tiny(linear_num_key_heads=4, linear_value_head_dim=32, moe_intermediate_size=128,
               shared_expert_intermediate_size=128)
    model = FlashNextModel(cfg, with_vision=False).eval()
    init_random_weights(model, seed=5)
    write_quantized(model, tmp_path, "awq")
    cfg = ModelConfig.from_pretrained(tmp_path)
    full = load_model(tmp_path, progress=False, with_vision=False).state_dict()
    packed = packed_tensors(meta_model(cfg, with_vision=False))
    expert = "model.language_model.layers.0.mlp.experts.down_proj.scales"  # [E, I/32, H]: one group row per rank
    for rank in range(4):
        rank_model = build_rank_model(cfg, ParallelConfig(4), ParallelContext(rank, 4, object()), with_vision=False)
        read = load_rank_checkpoint(rank_model, tmp_path, rank, 4).bytes_read
        slices = {n: rank_slices(n, cfg.text, rank, 4, packed) for n in full}
        assert read == sum(x.numel() * x.element_size() if slices[n] is None else  # vocabulary padding is not read
                           x.numel() // x.shape[slices[n].dim] * sum(e - s for s, e in slices[n].ranges) * x.element_size()
                           for n, x in full.items())
        got, want = rank_model.state_dict(), shard_state_dict(full, cfg, rank, 4, packed)
        assert got[expert].shape[1] == 1 and torch.equal(got[expert], full[expert][:, rank: rank + 1])
        for name in packed:
            assert torch.equal(got[name], want[name]), f"rank {rank}: {name}"

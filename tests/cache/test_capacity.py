"""Capacity planning: the dry run for the real config (4 x 32 GB, TP4, 512K, fp8) and its internal
consistency, the spec's concurrency method, and configurations rejected before any weight loads."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from cache_sim import tiny_config
from revolta.cache.capacity import (
    GiB,
    CacheConfig,
    CacheConfigError,
    MemoryBudget,
    fit_max_model_len,
    plan_cache,
    resolve_kv_dtype,
)
from revolta.plan import dry_run_plan, dry_run_report
from revolta.config import ModelConfig
from revolta.summary import fixed_state_breakdown, fixed_state_bytes_per_sequence, kv_bytes_breakdown, kv_bytes_per_token

REAL_CONFIG = Path(__file__).parents[1] / "data" / "qwen3_8_flash_next_config.json"
L512K = 524_288


@pytest.fixture(scope="module")
def real() -> ModelConfig:
    return ModelConfig.from_pretrained(REAL_CONFIG)


def _check_consistency(plan):
    c, bs = plan.cache, plan.block_size
    budget = plan.budget.cache_bytes
    pool_tokens = (plan.num_blocks - 1) * bs
    assert pool_tokens * plan.kv_bytes_per_token + plan.num_slots * plan.state_bytes <= budget
    assert plan.storage_bytes <= budget
    assert plan.pool_pages == (budget - plan.scalar_bytes) // plan.page_bytes
    assert plan.num_blocks + plan.num_slots * plan.state_pages == plan.pool_pages
    assert plan.state_pages == -(-plan.state_bytes // plan.page_bytes)
    needed = -(-c.max_model_len // bs) + (1 + c.num_draft_slots) * plan.state_pages
    assert plan.pages_per_request == needed
    assert plan.unified_concurrency == pytest.approx((plan.pool_pages - 1 - plan.state_pages) / needed)
    # the reported figures are what the allocated KV blocks hold, nothing more
    assert plan.kv_cache_tokens == pool_tokens
    assert plan.max_concurrency == pytest.approx(
        min(pool_tokens / (c.max_model_len + c.num_speculative_tokens), c.max_num_seqs))
    assert plan.max_concurrency <= plan.unified_concurrency


@pytest.mark.parametrize("spec", [0, 4])
def test_real_config_4x32gb_tp4_512k_fp8(real, spec):
    report = dry_run_report(real, 32, 4, L512K, "fp8_e4m3", num_speculative_tokens=spec)
    print(f"\n--- revolta info --gpu-memory 32 --tp 4 --max-model-len 524288 --kv-cache-dtype fp8_e4m3"
          f"{' (MTP4)' if spec else ''}\n{report}")
    plan = dry_run_plan(real, 32, 4, L512K, "fp8_e4m3", num_speculative_tokens=spec)
    _check_consistency(plan)
    # the byte figures are summary's (per GPU at TP4: one KV head per rank, GDN heads split by 4)
    assert plan.kv_bytes_per_token == kv_bytes_per_token(real, "fp8_e4m3", "compressed", include_mtp=spec > 0, tp=4)
    assert plan.kv_bytes_per_token == (7072 if spec else 6528)
    # summary's fixed state counts the c-1 pending index keys of an incomplete group; the slot
    # holds a ring of 2c raw keys (+ positions) per QSA layer instead
    f = fixed_state_breakdown(real, include_mtp=spec > 0, tp=4)
    pending = f["qsa_pending"] + f["qsa_pending_positions"]
    c = real.text.indexer_compress_ratio
    assert f["total"] == fixed_state_bytes_per_sequence(real, include_mtp=spec > 0, tp=4)
    assert plan.state_bytes == f["total"] - pending + pending // (c - 1) * (2 * c)
    assert plan.block_size == 256
    assert plan.capacity_lines()[0] in report and plan.capacity_lines()[1] in report
    # plausibility against the release note (1,153,143 tokens / 2.20x at 512K with MTP4): same order
    assert 1.3 < plan.max_concurrency < 2.6 and 1.5 < plan.unified_concurrency < 2.6


def test_real_config_tp4_dcp2_halves_the_trunk_kv_per_rank(real):
    """TP4 + DCP2 (the release note's deployment): the two ranks sharing a KV head each hold half its tokens, so a
    rank's page shrinks by half the trunk K/V (index keys and the MTP layer's K/V stay replicated) and more blocks
    fit the same budget; the plan stays self-consistent."""
    tp4 = dry_run_plan(real, 32, 4, L512K, "fp8_e4m3", num_speculative_tokens=4, max_num_seqs=8)
    dcp2 = dry_run_plan(real, 32, 4, L512K, "fp8_e4m3", num_speculative_tokens=4, max_num_seqs=8, dcp=2)
    _check_consistency(dcp2)
    b = kv_bytes_breakdown(real, "fp8_e4m3", "compressed", include_mtp=True, tp=4)
    assert b["main_kv"] == 12 * 2 * 256  # 12 QSA layers, K and V of one 256-wide head, 1 byte each
    assert dcp2.kv_bytes_per_token == tp4.kv_bytes_per_token - b["main_kv"] // 2 == 4000
    assert dcp2.layout.dcp == 2 and dcp2.budget == tp4.budget  # the weights are TP's: DCP changes only the cache
    assert 1.7 * tp4.kv_cache_tokens < dcp2.kv_cache_tokens < 1.8 * tp4.kv_cache_tokens
    report = dry_run_report(real, 32, 4, L512K, "fp8_e4m3", num_speculative_tokens=4, max_num_seqs=8, dcp=2)
    print(f"\n--- revolta info --gpu-memory 32 --tp 4 --dcp 2 --max-model-len 524288 --kv-cache-dtype fp8_e4m3 "
          f"--max-num-seqs 8 --num-speculative-tokens 4\n{report}")
    assert "TP 4, DCP 2" in report and dcp2.capacity_lines()[0] in report
    with pytest.raises(CacheConfigError, match="decode_context_parallel_size=3 must be >= 1 and divide"):
        dry_run_plan(real, 32, 4, L512K, "fp8_e4m3", dcp=3)


def test_more_memory_more_capacity_and_fp16_halves_it(real):
    base = dry_run_plan(real, 32, 4, L512K, "fp8_e4m3")
    bigger = dry_run_plan(real, 48, 4, L512K, "fp8_e4m3")
    assert bigger.kv_cache_tokens > base.kv_cache_tokens
    fp16 = dry_run_plan(real, 32, 4, 262_144, "fp16")
    fp8 = dry_run_plan(real, 32, 4, 262_144, "fp8_e4m3")
    assert 1.7 < fp8.kv_cache_tokens / fp16.kv_cache_tokens < 2.1
    _check_consistency(fp16)


def test_cpu_tier_and_replay_plan(real):
    plan = dry_run_plan(real, 32, 4, L512K, "fp8_e4m3", num_speculative_tokens=4, kv_offload_gib=48)
    host = 48 * GiB / 4
    assert plan.num_cpu_blocks > 1 and plan.num_cpu_slots > 1 and plan.cpu_storage_bytes <= host + plan.scalar_bytes
    replay = dry_run_plan(real, 32, 4, L512K, "fp8_e4m3", num_speculative_tokens=4, spec_state_replay=True)
    assert replay.max_concurrency > plan.max_concurrency  # no per-draft state slots
    assert replay.num_running_slots == 8 and plan.num_running_slots == 40


def test_rejections_say_what_to_change(real):
    with pytest.raises(CacheConfigError, match="kv_cache_dtype='fp4'.*fp8_e4m3"):
        dry_run_report(real, 32, 4, L512K, "fp4")
    with pytest.raises(CacheConfigError, match="lower --max-model-len to"):
        dry_run_report(real, 32, 4, 8_000_000, "fp8_e4m3")
    with pytest.raises(CacheConfigError, match="no memory left for the KV cache"):
        dry_run_report(real, 16, 4, L512K, "fp8_e4m3")
    with pytest.raises(CacheConfigError, match="block_size=100"):
        dry_run_report(real, 32, 4, L512K, "fp8_e4m3", block_size=100)
    with pytest.raises(CacheConfigError, match="tensor_parallel_size=3"):
        dry_run_report(real, 32, 3, L512K, "fp8_e4m3")
    with pytest.raises(CacheConfigError, match="MTP layer"):
        plan_cache(tiny_config().__class__.from_dict({**_no_mtp()}), CacheConfig(64, num_speculative_tokens=2),
                   MemoryBudget(gpu_memory_bytes=1 << 30))
    with pytest.raises(CacheConfigError, match="gpu_memory_utilization"):
        dry_run_report(real, 32, 4, L512K, "fp8_e4m3", gpu_memory_utilization=1.5)
    gdn_only = _no_mtp()
    gdn_only["text_config"] = dict(gdn_only["text_config"],
                                   layer_types=["linear_attention"] * len(gdn_only["text_config"]["layer_types"]))
    with pytest.raises(CacheConfigError, match="no full-attention layer"):
        plan_cache(tiny_config().__class__.from_dict(gdn_only), CacheConfig(64), MemoryBudget(gpu_memory_bytes=1 << 30))


def _no_mtp():
    from cache_sim import TINY_TEXT

    text = dict(TINY_TEXT, mtp_num_hidden_layers=0)
    return dict(model_type="qwen4_exp", architectures=["Qwen4ExpForConditionalGeneration"], text_config=text)


def test_kv_dtype_aliases():
    assert resolve_kv_dtype("auto", "float16") == "fp16" and resolve_kv_dtype("auto", "bfloat16") == "bf16"
    assert resolve_kv_dtype("fp8") == "fp8_e4m3" and resolve_kv_dtype("float16") == "fp16"


def test_tiny_plan_feeds_the_allocator():
    cfg = tiny_config()
    plan = plan_cache(cfg, CacheConfig(max_model_len=128, block_size=16, max_num_seqs=2, kv_offload_gib=0.01),
                      MemoryBudget(gpu_memory_bytes=4 << 20, cudagraph_reserve_bytes=0, other_bytes=0), dtype="float32")
    _check_consistency(plan)
    from revolta.cache.hybrid import HybridAllocator

    a = HybridAllocator(plan.allocator_config())
    assert a.blocks.num_ids == plan.num_blocks and a.cpu_slots.num_ids == plan.num_cpu_slots
    assert replace(plan.layout, num_blocks=plan.num_cpu_blocks, num_slots=plan.num_cpu_slots) == plan.cpu_layout()


@pytest.mark.parametrize("spec", [0, 4])
def test_fit_max_model_len_is_the_longest_whole_block_length_that_plans(real, spec):
    """The checkpoint's 262,144 tokens on one 32 GiB GPU: the fit plans, one more block does not."""
    cache = CacheConfig(max_model_len=262_144, num_speculative_tokens=spec, max_num_seqs=8)
    budget = MemoryBudget(gpu_memory_bytes=32 * GiB, weights_bytes=20 * GiB)
    with pytest.raises(CacheConfigError, match="lower --max-model-len"):
        plan_cache(real, cache, budget)
    fit = fit_max_model_len(real, cache, budget)
    assert 0 < fit < 262_144 and fit % 256 == 0
    _check_consistency(plan_cache(real, replace(cache, max_model_len=fit), budget))
    with pytest.raises(CacheConfigError, match="lower --max-model-len"):
        plan_cache(real, replace(cache, max_model_len=fit + 256), budget)
    roomy = MemoryBudget(gpu_memory_bytes=80 * GiB, weights_bytes=20 * GiB)
    assert fit_max_model_len(real, cache, roomy) == 262_144  # it fits whole: unchanged
    no_blocks = MemoryBudget(gpu_memory_bytes=32 * GiB, weights_bytes=26 * GiB)  # room for the state slots only
    assert fit_max_model_len(real, cache, no_blocks) == 0


def test_a_length_that_does_not_fit_names_the_cache_bytes_it_needs(real):
    """The error carries the least cache that holds the length (the engine's fitted-length warning says how much
    more that is): that many bytes plan, one byte less does not."""
    cache = CacheConfig(max_model_len=262_144, num_speculative_tokens=4, max_num_seqs=8)
    budget = MemoryBudget(gpu_memory_bytes=32 * GiB, weights_bytes=20 * GiB)
    with pytest.raises(CacheConfigError) as e:
        plan_cache(real, cache, budget)
    need = e.value.needed_cache_bytes
    assert need > budget.cache_bytes

    def exactly(n: int) -> MemoryBudget:
        return MemoryBudget(gpu_memory_bytes=n, gpu_memory_utilization=1.0, cudagraph_reserve_bytes=0, other_bytes=0)

    assert exactly(need).cache_bytes == need
    plan_cache(real, cache, exactly(need))
    with pytest.raises(CacheConfigError):
        plan_cache(real, cache, exactly(need - 1))

"""Speculative decoding in the cache plan: per-draft state slots vs replay (spec/engine.md §3.1, §3.3)."""

from __future__ import annotations

from pathlib import Path

from revolta.plan import dry_run_plan
from revolta.cli import main
from revolta.config import ModelConfig

REAL = Path(__file__).parents[1] / "data" / "qwen3_8_flash_next_config.json"


def test_replay_needs_fewer_state_slots_and_leaves_more_kv(capsys):
    cfg = ModelConfig.from_pretrained(REAL)
    args = (cfg, 32.0, 4, 524288, "fp8_e4m3")
    keep = dry_run_plan(*args, num_speculative_tokens=4)
    replay = dry_run_plan(*args, num_speculative_tokens=4, spec_state_replay=True)
    off = dry_run_plan(*args, num_speculative_tokens=0)
    seqs = keep.cache.max_num_seqs
    assert keep.num_slots - replay.num_slots == seqs * 4  # one slot per draft per running request
    assert replay.allocator_config().per_draft_state is False and keep.allocator_config().per_draft_state
    assert off.kv_cache_tokens > replay.kv_cache_tokens > keep.kv_cache_tokens  # the MTP layer's K/V still costs replay some
    assert main(["info", str(REAL), "--gpu-memory", "32", "--tp", "4", "--max-model-len", "524288",
                 "--kv-cache-dtype", "fp8_e4m3", "--num-speculative-tokens", "4", "--spec-state-replay"]) == 0
    out = capsys.readouterr().out
    assert "speculative decoding MTP x4 (replay)" in out and f"GPU KV cache size: {replay.kv_cache_tokens:,}" in out

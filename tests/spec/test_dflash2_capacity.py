"""The capacity report with DFlash2 (release note 0.1.3, spec/engine.md §3.3, §4.2): the drafter's
KV group, and the state slots per request with per-draft slots (2 + 7) and with replay (2)."""

from __future__ import annotations

from revolta.plan import dry_run_plan
from revolta.cli import main
from revolta.config import ModelConfig
from revolta.parallel.context import ParallelContext
from revolta.spec.config import SpeculativeConfig
from revolta.spec.dflash2.draft_config import DFlash2DraftConfig
from revolta.spec.dflash2.rank_drafter import build_rank_drafter
from revolta.spec.dflash2.sharded_codebook import codebook_bytes_per_gpu
from dflash2_fixtures import REAL, drafter_config, tiny_target, write_drafter

# the released drafter's shape (spec §2.1: 5 sliding-window layers, window 2048, at the target width)
RELEASED = dict(num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                layer_types=["sliding_attention"] * 5, sliding_window=2048,
                dflash_config={"selector_rank": 256, "selector_top_k": 16})
ARGS = (32.0, 4, 524288, "fp8_e4m3")  # per GPU: V100 32 GB, TP4, 512K, E4M3 (spec §1.1)


def plans(tmp_path):
    cfg = ModelConfig.from_pretrained(REAL)
    drafter = write_drafter(tmp_path / "drafter", cfg, **RELEASED)
    out = {}
    for replay in (False, True):
        spec = SpeculativeConfig.resolve({"method": "dflash2", "model": drafter,
                                          "sm70_dflash2": {"spec_state_replay": replay}},
                                         has_mtp=True, tensor_parallel_size=4, env={})
        books = codebook_bytes_per_gpu(cfg.text.vocab_size, 256, 4, sharded=True)  # sharding: on by default at TP4
        out[replay] = dry_run_plan(cfg, *ARGS, drafter_weights_bytes=books, **spec.cache_fields("fp8_e4m3", "float16"))
    return cfg, drafter, out


def test_dflash2_state_slots_and_draft_kv_group(tmp_path):
    cfg, _, by_replay = plans(tmp_path)
    keep, replay = by_replay[False], by_replay[True]
    seqs = keep.cache.max_num_seqs
    assert keep.state_slots_per_request == 2 + 7 and replay.state_slots_per_request == 2
    assert keep.num_slots - replay.num_slots == seqs * 7
    assert keep.allocator_config().per_draft_state and not replay.allocator_config().per_draft_state
    # the drafter's own group: 5 sliding layers x 2048 tokens x (K + V) x 2 KV heads per rank x 128 x 2 bytes
    # (revolta's drafter cache is 16-bit beside the fp8 target cache)
    assert keep.draft_kv_bytes_per_request == replay.draft_kv_bytes_per_request == 5 * 2048 * 2 * 2 * 128 * 2
    assert keep.draft_kv_bytes == seqs * keep.draft_kv_bytes_per_request
    # no MTP layer in DFlash2's pages: the page is the no-speculation page
    off = dry_run_plan(cfg, *ARGS, cudagraph_reserve_mib=1200)
    assert keep.page_bytes == off.page_bytes and not keep.layout.with_mtp
    # replay frees 7 slots per request for the KV pool; the drafter's group and its verify rows cost the rest
    assert off.kv_cache_tokens > replay.kv_cache_tokens > keep.kv_cache_tokens
    assert off.pool_pages * off.page_bytes - replay.pool_pages * replay.page_bytes >= replay.draft_kv_bytes


def test_info_reports_dflash2_with_replay_on_and_off(tmp_path, capsys):
    _, drafter, by_replay = plans(tmp_path)
    for replay, slots in ((False, "9 = 1 running + 1 prefix snapshot + 7 per-draft (no replay"),
                          (True, "2 = 1 running + 1 prefix snapshot + 0 per-draft (replay")):
        spec = ('{"method": "dflash2", "model": "%s", "sm70_dflash2": {"spec_state_replay": %s}}'
                % (drafter, "true" if replay else "false"))
        assert main(["info", str(REAL), "--gpu-memory", "32", "--tp", "4", "--max-model-len", "524288",
                     "--kv-cache-dtype", "fp8_e4m3", "--speculative-config", spec]) == 0
        out = capsys.readouterr().out
        plan = by_replay[replay]
        assert f"speculative decoding DFlash2 x7 ({'replay' if replay else 'per-draft state slots'})" in out
        assert "KV fp8_e4m3 (DFlash2 draft fp16)" in out and "CUDA graphs 1.17 GiB" in out
        assert ("DFlash2 draft KV group: 5 layers (5 sliding, window 2048) x 1,024 B/token = 10.00 MiB per request, "
                "x 8 seqs = 80.00 MiB taken from the budget") in out
        assert "DFlash2 selector codebooks: 60.62 MiB per GPU (sharded over TP 4; in the weights above" in out
        assert f"state slots per request: {slots}" in out
        assert f"GPU KV cache size: {plan.kv_cache_tokens:,} tokens" in out
        assert "sm70_dflash2 options" in out and "context_kv_graph=n/a" in out
        assert f"spec_state_replay={str(replay).lower()} [config, release note true]" in out
    assert main(["info", str(REAL), "--gpu-memory", "32", "--speculative-config", '{"method": "dflash2"}']) == 2
    assert "needs 'model'" in capsys.readouterr().err
    assert main(["info", str(REAL), "--gpu-memory", "32", "--num-speculative-tokens", "4",
                 "--speculative-config", '{"method": "mtp"}']) == 2
    assert "replaces --num-speculative-tokens" in capsys.readouterr().err


def test_codebook_sharding_in_the_report(tmp_path, capsys):
    MiB = 2**20
    assert codebook_bytes_per_gpu(248320, 256, 4, sharded=False) == 2 * 248320 * 256 * 2  # 242.5 MiB
    assert codebook_bytes_per_gpu(248320, 256, 4, sharded=True) * 4 == codebook_bytes_per_gpu(248320, 256, 4, False)
    assert round(codebook_bytes_per_gpu(248320, 256, 4, True) / MiB, 1) == 60.6  # the release note's "61 MiB"
    _, drafter, _ = plans(tmp_path)
    tokens = {}
    for shard in ("true", "false"):
        spec = '{"method": "dflash2", "model": "%s", "sm70_dflash2": {"sharded_selector_codebook": %s}}' % (
            drafter, shard)
        assert main(["info", str(REAL), "--gpu-memory", "32", "--tp", "4", "--max-model-len", "524288",
                     "--kv-cache-dtype", "fp8_e4m3", "--speculative-config", spec]) == 0
        out = capsys.readouterr().out
        tokens[shard] = int(out.split("GPU KV cache size: ")[1].split(" tokens")[0].replace(",", ""))
        assert ("60.62 MiB per GPU (sharded over TP 4" if shard == "true" else "242.50 MiB per GPU (replicated") in out
    assert tokens["true"] > tokens["false"]  # sharding frees ~182 MiB per GPU for the KV pool


def test_the_plan_budgets_the_kv_heads_a_rank_drafter_holds(tmp_path):
    """The drafter KV group's bytes per rank follow the rank drafter (rank_drafter.py): heads / tp when tp divides
    the KV heads and the MLP width, else every head (the layers stay whole). The plan used to count heads / tp (at
    least 1) whatever the MLP width, under-budgeting the context store of a drafter whose layers stay whole."""
    target = tiny_target()
    h = target.text.hidden_size
    # (KV heads, MLP width, tp): split; more ranks than KV heads; an MLP width tp does not divide; 3 of 4 heads
    for i, (kv, inter, tp) in enumerate([(2, 2 * h, 2), (2, 2 * h, 4), (2, 2 * h + 1, 2), (4, 3 * h, 3)]):
        raw = drafter_config(target, num_key_value_heads=kv, num_attention_heads=4, intermediate_size=inter)
        path = write_drafter(tmp_path / str(i), target, num_key_value_heads=kv, num_attention_heads=4,
                             intermediate_size=inter)
        spec = SpeculativeConfig.resolve({"method": "dflash2", "model": path}, has_mtp=False, tensor_parallel_size=tp,
                                         env={})
        group = spec.cache_fields("auto", "float32")["draft_kv_group"]
        held = build_rank_drafter(DFlash2DraftConfig.from_dict(raw), ParallelContext(0, tp, object())).num_kv_heads
        assert group.bytes_per_token(tp) == 2 * held * 16 * 4, (kv, inter, tp)  # K + V, head_dim 16, fp32

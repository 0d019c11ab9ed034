"""CacheStorage: exact shapes and dtypes of the layout, bytes equal to the plan, copies and scales."""

from __future__ import annotations

import logging

import pytest
import torch

from cache_sim import layout, tiny_config
from revolta.cache.capacity import CacheConfig, MemoryBudget, plan_cache
from revolta.cache.hybrid import Allocation, SwapOuts
from revolta.cache.storage import CacheStorage, kv_scales_from_state_dict, make_block_table, make_slot_mapping

KV_TORCH = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8_e4m3": torch.uint8, "int8": torch.int8}


@pytest.mark.parametrize("kv", ["fp16", "bf16", "fp8_e4m3", "int8"])
@pytest.mark.parametrize("tp", [1, 2])
def test_shapes_dtypes_and_bytes_match_the_plan(kv, tp, caplog):
    cfg, t = tiny_config(), tiny_config().text
    cache = CacheConfig(max_model_len=64, kv_cache_dtype=kv, block_size=16, max_num_seqs=3,
                        num_speculative_tokens=2)
    plan = plan_cache(cfg, cache, MemoryBudget(gpu_memory_bytes=8 << 20, cudagraph_reserve_bytes=0, other_bytes=0),
                      tp=tp, dtype="bfloat16")
    with caplog.at_level(logging.WARNING):
        st = CacheStorage(cfg, plan.layout)
    nb, ns, bs = plan.num_blocks, plan.num_slots, 16
    kvh, c, di = max(1, t.num_key_value_heads // tp), t.indexer_compress_ratio, t.indexer_head_dim
    assert list(st.qsa) == [3] and st.mtp is not None
    for q in (st.qsa[3], st.mtp):
        assert q.k_cache.shape == q.v_cache.shape == (nb, bs, kvh, t.head_dim)
        assert q.k_cache.dtype == KV_TORCH[kv]
        assert q.index_cache.shape == (nb, bs // c, di)
        assert q.index_cache.dtype == (torch.uint8 if kv in ("fp8_e4m3", "int8") else KV_TORCH[kv])
        if kv == "int8":
            assert q.k_scale.shape == q.v_scale.shape == (nb, bs, kvh) and q.k_scale.dtype == torch.float32
        elif kv == "fp8_e4m3":
            assert q.k_scale.shape == () and float(q.k_scale) == 1.0
        else:
            assert q.k_scale is None and q.v_scale is None
    assert kv != "fp8_e4m3" or "no k/v scales" in caplog.text
    assert list(st.gdn) == [0, 1, 2]
    for g in st.gdn.values():
        assert g.ssm_state.shape == (ns, t.linear_num_value_heads // tp, 16, 16) and g.ssm_state.dtype == torch.float32
        assert g.conv_state.shape == (ns, t.linear_conv_kernel_dim - 1, t.gdn_conv_dim // tp)
        assert g.conv_state.dtype == torch.bfloat16
    p = st.ple[1]
    assert p.conv.shape == (ns, 9, t.wide_size) and p.conv.dtype == torch.bfloat16
    assert p.context_ids.shape == (ns, 2) and p.context_ids.dtype == torch.int64
    assert (p.context_ids == t.eos_token_id).all()
    assert set(st.pending_keys) == {3, "mtp"} and st.pending_keys[3].shape == (ns, 2 * c, di)
    assert st.pending_positions.shape == (ns, 2 * c, 3) and st.pending_positions.dtype == torch.int64
    assert st.nbytes() == plan.storage_bytes
    assert plan.storage_bytes <= plan.budget.cache_bytes


def test_checkpoint_scales_and_ring():
    cfg = tiny_config()
    names = {"model.language_model.layers.3.self_attn.k_scale": torch.tensor(0.5),
             "model.language_model.layers.3.self_attn.v_scale": torch.tensor([0.25]),
             "mtp.layers.0.self_attn.k_scale": torch.tensor(2.0)}
    scales = kv_scales_from_state_dict(names)
    assert scales == {3: (0.5, 0.25), "mtp": (2.0, 1.0)}
    st = CacheStorage(cfg, layout(3, 2, block_size=8, kv_cache_dtype="fp8_e4m3", draft_kv_cache_dtype="fp8_e4m3",
                                  with_mtp=True, pending_ring=8), kv_scales=scales)
    assert float(st.qsa[3].v_scale) == 0.25 and float(st.mtp.k_scale) == 2.0
    assert st.pending_keys["mtp"].shape[1] == 8


def test_copies_swaps_and_reset():
    cfg = tiny_config()
    gpu, cpu = CacheStorage(cfg, layout(4, 4)), CacheStorage(cfg, layout(3, 3))
    for i, x in enumerate(gpu.block_tensors() + gpu.slot_tensors()):
        x.copy_(torch.arange(x.numel()).view(x.shape).to(x.dtype) + i)
    before_b = [x[2].clone() for x in gpu.block_tensors()]
    before_s = [x[1].clone() for x in gpu.slot_tensors()]
    gpu.pre_forward([], SwapOuts(blocks=((2, 1),), slots=((1, 2),)), cpu)
    assert all(torch.equal(c[1], b) for c, b in zip(cpu.block_tensors(), before_b))
    gpu.block_tensors()[0][3].zero_()
    a = Allocation(num_cached_tokens=4, num_computed_tokens=4, num_new_tokens=1, num_lookahead_tokens=0,
                   new_block_ids=(3,), state_slot=3, swap_in_blocks=((1, 3),), swap_in_slots=((2, 3),))
    gpu.pre_forward([a], None, cpu)
    assert all(torch.equal(x[3], b) for x, b in zip(gpu.block_tensors(), before_b))
    assert all(torch.equal(x[3], s) for x, s in zip(gpu.slot_tensors(), before_s))
    snap = Allocation(num_cached_tokens=0, num_computed_tokens=0, num_new_tokens=4, num_lookahead_tokens=0,
                      new_block_ids=(1,), state_slot=1, snapshot_slot=2)
    gpu.pre_forward([snap])  # a fresh sequence: its running slot is reset
    assert all(not x[1].any() for x in gpu.slot_tensors()[:-4] if x.dtype != torch.int64)
    assert (gpu.ple[1].context_ids[1] == cfg.text.eos_token_id).all()
    gpu.gdn[0].ssm_state[1].fill_(3.0)
    gpu.post_forward([snap])
    assert (gpu.gdn[0].ssm_state[2] == 3.0).all()


def test_block_table_and_slot_mapping():
    assert make_block_table([[3, 1], [2]], 4).tolist() == [[3, 1, 0, 0], [2, 0, 0, 0]]
    assert make_slot_mapping([5, 2], 2, 7, 4).tolist() == [22, 23, 8, 9, 10]
    assert make_slot_mapping([5, 2], 2, 7, 4).dtype == torch.int64

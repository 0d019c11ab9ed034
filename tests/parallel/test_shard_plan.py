"""The slice rules on the real geometry (meta tensors, no data): at TP4 every rank's model has exactly the
shapes its slices of the full checkpoint tensors have, and the splits are issue 23's numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from revolta.config import ModelConfig
from revolta.model import FlashNextModel
from revolta.parallel import ParallelConfig, ParallelContext
from revolta.parallel.shard import Slices, build_rank_model, shard_state_dict, tensor_slices

REAL = Path(__file__).resolve().parents[1] / "data" / "qwen3_8_flash_next_config.json"
NO_GROUP = object()  # building on meta runs no collective


@pytest.fixture(scope="module")
def real():
    return ModelConfig.from_pretrained(REAL)


@pytest.fixture(scope="module")
def full_shapes(real):
    with torch.device("meta"):
        model = FlashNextModel(real, with_vision=False)
    return model.state_dict()


@pytest.mark.parametrize("rank", [0, 3])
def test_rank_model_shapes_equal_its_slices_at_tp4(real, full_shapes, rank):
    model = build_rank_model(real, ParallelConfig(4), ParallelContext(rank, 4, NO_GROUP), with_vision=False)
    own = {n: tuple(x.shape) for n, x in model.state_dict().items()}
    cut = {n: tuple(x.shape) for n, x in shard_state_dict(full_shapes, real, rank, 4).items()}
    assert own == cut
    g, q, e = "model.language_model.layers.0.", "model.language_model.layers.3.", "model.language_model.layers.0.mlp."
    assert own[g + "linear_attn.in_proj_qkv.weight"] == ((4 + 4) * 128 + 12 * 128, 2560)  # 16/48 -> 4/12 heads
    assert own[g + "linear_attn.conv1d.weight"] == ((4 + 4) * 128 + 12 * 128, 1, 4)
    assert own[g + "linear_attn.A_log"] == (12,) and own[g + "linear_attn.in_proj_b.weight"] == (12, 2560)
    assert own[g + "linear_attn.out_proj.weight"] == (2560, 12 * 128)
    assert own[q + "self_attn.q_proj.weight"] == (6 * 2 * 256, 2560)  # 24 -> 6 query heads, query ‖ gate
    assert own[q + "self_attn.k_proj.weight"] == (256, 2560)  # 2 KV heads at TP4: one per rank
    assert own[q + "self_attn.indexer.index_qk_proj.weight"] == ((4 + 1) * 128, 2560)  # replicated
    assert own[e + "experts.gate_up_proj"] == (512, 2 * 160, 2560) and own[e + "experts.down_proj"] == (512, 2560, 160)
    assert own[e + "gate.weight"] == (512, 2560)  # router replicated
    assert own["lm_head.weight"] == (248320 // 4, 2560)


def test_fused_and_shared_ranges():
    t = ModelConfig.from_pretrained(REAL).text
    qkv = tensor_slices("model.language_model.layers.0.linear_attn.in_proj_qkv.weight", t, 1, 4)
    # q heads 4-7, k heads 4-7 (after 16 * 128 q rows), v heads 12-23 (after 2 * 2048 q/k rows)
    assert qkv == Slices(0, ((512, 1024), (2048 + 512, 2048 + 1024), (4096 + 1536, 4096 + 3072)), 2560)
    kv = [tensor_slices("model.language_model.layers.3.self_attn.v_proj.weight", t, r, 4).ranges for r in range(4)]
    assert kv == [((0, 256),), ((0, 256),), ((256, 512),), ((256, 512),)]  # ranks 0,1 share KV head 0
    up = tensor_slices("model.language_model.layers.0.mlp.experts.gate_up_proj", t, 2, 4)
    assert up == Slices(1, ((320, 480), (640 + 320, 640 + 480)), 320)  # gate rows, then up rows
    assert tensor_slices("model.language_model.layers.0.mlp.gate.weight", t, 2, 4) is None
    assert tensor_slices("model.language_model.layers.0.linear_attn.in_proj_qkv.weight", t, 0, 1) is None


def test_vocab_padding_rows_are_zero():
    full = torch.arange(10.0)[:, None].expand(10, 3)
    part = Slices(0, ((8, 10),), 3).take(full)  # the last of 4 ranks of a 10-row vocabulary: 2 rows + 1 pad
    assert part.tolist() == [[8.0] * 3, [9.0] * 3, [0.0] * 3]

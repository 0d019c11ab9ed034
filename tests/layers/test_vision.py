"""Vision tower (spec/model.md §8.2) against the HF `qwen4_exp` reference on the V-tiny config, fp32, CPU."""

from __future__ import annotations

import pytest
import torch

from revolta.config import VisionConfig
from revolta.layers.vision import VisionModel, merge_block_coords

# V-tiny (spec §12.2): head_dim 16, a 4x4 learned position table, patch 4, merge 2.
V_TINY = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, num_position_embeddings=16, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64)


def revolta_cfg() -> VisionConfig:
    return VisionConfig(hidden_act="gelu_pytorch_tanh", in_channels=3, **V_TINY)


def random_model(seed: int = 0) -> VisionModel:
    torch.manual_seed(seed)
    model = VisionModel(revolta_cfg()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)  # randomise everything: LN weights, biases and the position table included
    return model


@pytest.fixture(scope="module")
def hf_and_ours():
    transformers = pytest.importorskip("transformers")
    from revolta.config import ModelConfig

    text = dict(vocab_size=512, eos_token_id=511, hidden_size=64, num_hidden_layers=4,
                layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4,
                num_key_value_heads=2, head_dim=32,
                rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                     mrope_section=[2, 1, 1], mrope_interleaved=True),
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                hc_lowrank=16, ple_layer_ids=[2], ple_embed_dim=64, heads_per_ngram=2, ngram_vocab_size_base=97,
                make_ngram_vocab_size_divisible_by=8, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
                indexer_budget=8, indexer_compress_ratio=4, split_ngram_parts=1, output_gate_type="sigmoid")
    hf_cfg = transformers.Qwen4ExpConfig(text_config=text, vision_config=V_TINY, image_token_id=500,
                                         video_token_id=501, vision_start_token_id=502, vision_end_token_id=503)
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpVisionModel

    cfg = ModelConfig.from_dict(hf_cfg.to_dict())
    assert cfg.vision == revolta_cfg()
    torch.manual_seed(0)
    hf = Qwen4ExpVisionModel(hf_cfg.vision_config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.15)
    ours = VisionModel(cfg.vision).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


@pytest.mark.parametrize(
    "grids",
    [[(1, 4, 4)], [(1, 6, 8)], [(2, 4, 4)], [(1, 4, 4), (2, 6, 8)], [(1, 10, 2), (1, 2, 2), (3, 4, 6)]],
    ids=str,
)
def test_matches_hf(hf_and_ours, grids):
    hf, ours = hf_and_ours
    num_patches = sum(t * h * w for t, h, w in grids)
    torch.manual_seed(1)
    pixel_values = torch.randn(num_patches, ours.cfg.patch_dim)
    grid_thw = torch.tensor(grids)
    with torch.no_grad():
        ref = hf(pixel_values, grid_thw=grid_thw).pooler_output
        out = ours(pixel_values, grid_thw)
    assert out.shape == (num_patches // 4, 64) and out.dtype == torch.float32
    assert ref.abs().max() > 0.1  # not trivially small
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_parameter_names_are_checkpoint_names():
    model = VisionModel(revolta_cfg())
    sd = model.state_dict()
    depth = V_TINY["depth"]
    assert len(sd) == 2 + 1 + 12 * depth + 6  # 333 for the real 27-block tower (spec §9.3)
    assert sd["patch_embed.proj.weight"].shape == (32, 3, 2, 4, 4)
    assert sd["pos_embed.weight"].shape == (16, 32)
    assert sd["merger.linear_fc1.weight"].shape == (128, 128)
    assert sd["merger.linear_fc2.weight"].shape == (64, 128)
    for i in range(depth):
        for name in ("norm1", "norm2", "attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2"):
            assert f"blocks.{i}.{name}.weight" in sd and f"blocks.{i}.{name}.bias" in sd
    for name in ("norm", "linear_fc1", "linear_fc2"):
        assert f"merger.{name}.weight" in sd and f"merger.{name}.bias" in sd


def test_attention_stays_within_a_frame_and_an_item():
    model = random_model()
    grids = [(2, 4, 4), (1, 6, 4)]  # 32 + 24 patches -> 8 + 6 tokens
    torch.manual_seed(2)
    x = torch.randn(56, model.cfg.patch_dim)
    y = x.clone()
    y[16:32] += 1.0  # second frame of the first item only
    with torch.no_grad():
        a, b = model(x, grids), model(y, grids)
        alone = model(x[32:], [(1, 6, 4)])
    torch.testing.assert_close(a[:4], b[:4], rtol=0, atol=0)  # first frame untouched
    assert (a[4:8] - b[4:8]).abs().max() > 1e-3
    torch.testing.assert_close(a[8:], b[8:], rtol=0, atol=0)  # other item untouched
    torch.testing.assert_close(a[8:], alone, rtol=0, atol=1e-6)


def test_merge_block_coords():
    rows, cols = merge_block_coords(4, 6, 2)
    # first merge block is the 2x2 square at the top-left, then the one to its right
    assert rows[:8].tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert cols[:8].tolist() == [0, 1, 0, 1, 2, 3, 2, 3]
    assert sorted(zip(rows.tolist(), cols.tolist())) == [(r, c) for r in range(4) for c in range(6)]


def test_bfloat16_runs_close_to_fp32():
    model = random_model()
    torch.manual_seed(3)
    x = torch.randn(2 * 6 * 8, model.cfg.patch_dim)
    with torch.no_grad():
        ref = model(x, [(2, 6, 8)])
        out = model.to(torch.bfloat16)(x, [(2, 6, 8)])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)


def test_rejects_inconsistent_inputs():
    model = random_model()
    with pytest.raises(ValueError, match="pixel_values"):
        model(torch.randn(15, model.cfg.patch_dim), [(1, 4, 4)])
    with pytest.raises(ValueError, match="multiples"):
        model(torch.randn(12, model.cfg.patch_dim), [(1, 3, 4)])

"""YaRN inverse frequencies and attention factor against transformers' rope utilities."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from revolta.config import RopeConfig  # noqa: E402
from revolta.layers.rope import rope_inv_freq  # noqa: E402


@pytest.mark.parametrize("factor", [2.0, 4.0])
def test_yarn_matches_transformers(factor):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(rope_type="yarn", rope_theta=1e7, partial_rotary_factor=0.25, factor=factor,
                  original_max_position_embeddings=262144, beta_fast=32, beta_slow=1, truncate=True,
                  mrope_section=[11, 11, 10], mrope_interleaved=True)
    cfg = transformers.Qwen4ExpTextConfig(hidden_size=2560, num_attention_heads=24, head_dim=256,
                                          max_position_embeddings=int(262144 * factor), rope_parameters=params)
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    rope = RopeConfig(rope_type="yarn", factor=factor, original_max_position_embeddings=262144)
    inv, scale = rope_inv_freq(rope, 64)
    torch.testing.assert_close(inv, ref_inv.float(), rtol=1e-6, atol=0)
    assert abs(scale - ref_scale) < 1e-6

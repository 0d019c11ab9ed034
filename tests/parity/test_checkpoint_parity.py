"""A checkpoint written by the reference's save_pretrained loads with load_model and gives its logits."""

import pytest
import torch

pytest.importorskip("transformers")

from hf_oracle import assert_matches_reference, build_pair  # noqa: E402

import revolta  # noqa: E402


@torch.no_grad()
def test_reference_checkpoint_loads_and_matches(tmp_path):
    hf, _, _ = build_pair("T4", seed=41, vision=True, split_ngram_parts=3)
    hf.save_pretrained(tmp_path, max_shard_size="300KB")  # sharded, PLE table split in 3 parts
    assert (tmp_path / "model.safetensors.index.json").exists()
    model = revolta.load_model(tmp_path, dtype=torch.float32, device="cpu", progress=False)
    assert_matches_reference(model, hf, 50)


def test_load_model_keeps_decay_params_fp32_in_bf16(tmp_path):
    hf, _, _ = build_pair("T2", seed=1)
    hf.save_pretrained(tmp_path)
    model = revolta.load_model(tmp_path, dtype=torch.bfloat16, progress=False)
    gdn = model.model.language_model.layers[0].linear_attn
    assert gdn.A_log.dtype == torch.float32 and gdn.dt_bias.dtype == torch.float32
    assert gdn.in_proj_qkv.weight.dtype == torch.bfloat16
    logits = model(torch.tensor([[1, 2, 3, 4, 5]]))
    assert logits.shape == (1, 5, 512) and torch.isfinite(logits).all()

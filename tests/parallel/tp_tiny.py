"""The tiny model the parallel tests split: the T4 config of tests/parity with an MTP layer, fp32 random
weights (deterministic: the same on every rank and in the TP1 reference)."""

from __future__ import annotations

from pathlib import Path

import torch

from revolta.config import ModelConfig
from revolta.model import FlashNextModel, init_random_weights
from tiny_configs import T4_TEXT  # tests/parity, on sys.path via tests/conftest.py


def tiny(**text) -> ModelConfig:
    return ModelConfig.from_dict(dict(model_type="qwen4_exp", architectures=["Qwen4ExpForConditionalGeneration"],
                                      text_config=dict(T4_TEXT, mtp_num_hidden_layers=1, **text)))


def full_model(cfg: ModelConfig) -> FlashNextModel:
    model = FlashNextModel(cfg, with_vision=False)
    init_random_weights(model, seed=0)
    return model.eval()


def write_fp8_ple_checkpoint(cfg: ModelConfig, path: Path, parts: int = 3) -> int:
    """full_model(cfg) saved to `path` (one file, its config beside it) with the PLE table as FP8 E4M3 in `parts`
    shards and one global weight_scale (every placement computes with fp32(q) * scale); returns the table's rows.
    With 3 shards a TP2 rank's half of the rows ends inside the second shard."""
    from safetensors.torch import save_file

    from revolta.weights import checkpoint_tensors

    sd = dict(checkpoint_tensors(full_model(cfg), 1))
    name = next(n for n in sd if n.endswith("ngram_embedding.shard_0.weight"))
    base, table = name.removesuffix(".shard_0.weight"), sd.pop(name).float()
    scale = table.abs().max() / 448
    for i, part in enumerate((table / scale).to(torch.float8_e4m3fn).chunk(parts)):
        sd[f"{base}.shard_{i}.weight"] = part.contiguous()
    sd[f"{base}.weight_scale"] = scale.reshape(1)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, path / "model.safetensors")
    cfg.save(path)
    return table.shape[0]

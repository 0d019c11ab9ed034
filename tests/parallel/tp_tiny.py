"""The tiny model the parallel tests split: the T4 config of tests/parity with an MTP layer, fp32 random
weights (deterministic: the same on every rank and in the TP1 reference)."""

from __future__ import annotations

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

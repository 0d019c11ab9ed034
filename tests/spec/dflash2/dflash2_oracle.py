"""Shared fixtures for the DFlash2 parity tests: one tiny random drafter, built twice.

The oracle is `dflash` 0.1.0's `DFlash2DraftModel` (installed with --no-deps beside transformers); both models
get the same deterministic random weights, and a random target embedding and LM head stand in for the target.
"""

from __future__ import annotations

import copy

import torch
from dflash.model import DFlash2DraftModel as OracleModel
from torch import nn
from transformers import Qwen3Config

from revolta.spec.dflash2 import DFlash2DraftConfig, DFlash2DraftModel

V, H = 96, 32
RAW = {
    "vocab_size": V, "hidden_size": H, "intermediate_size": 48, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "use_sliding_window": True, "sliding_window": 6, "num_target_layers": 8,
    "dflash_config": {"block_size": 5, "mask_token_id": 7, "target_layer_ids": [1, 4, 6], "conv_kernel_size": 2,
                      "conv_group_size": 8, "selector_rank": 12, "selector_top_k": 6},
}


def raw_config(**dflash) -> dict:
    raw = copy.deepcopy(RAW)
    for k, v in dflash.items():
        (raw if k in ("is_causal", "sliding_window") else raw["dflash_config"])[k] = v
    return raw


def random_state(names_shapes: dict[str, torch.Size], seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic weights with visible spread everywhere (norm gains near 1, conv taps near identity)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(names_shapes):
        shape = names_shapes[name]
        t = torch.randn(shape, generator=g)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.2 * t
        elif name.endswith("base_kernel"):
            t = 0.3 * t
            t[:, 0] += 1.0  # tap 0 near identity so the sublayer signal survives both convolutions
        elif "codebook" in name:
            t = 0.5 * t
        else:
            t = t * shape[-1] ** -0.5
        out[name] = t
    return out


class Pair:
    """The same drafter as revolta's module and the oracle's, plus a stand-in target embedding and head."""

    def __init__(self, seed: int = 0, **dflash):
        raw = raw_config(**dflash)
        self.cfg = DFlash2DraftConfig.from_dict(raw)
        self.oracle = OracleModel(Qwen3Config(**copy.deepcopy(raw))).eval()
        state = random_state({n: t.shape for n, t in self.oracle.state_dict().items()}, seed)
        self.oracle.load_state_dict(state, strict=True)
        self.model = DFlash2DraftModel(self.cfg).eval()
        self.model.load_state_dict(state, strict=True)
        g = torch.Generator().manual_seed(seed + 1)
        self.embed = nn.Embedding(V, H)
        self.head = nn.Linear(H, V, bias=False)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(V, H, generator=g))
            self.head.weight.copy_(3.0 * torch.randn(V, H, generator=g) * H**-0.5)

"""The trained default's model for training: config, compact vocabulary, init and losses.

The model is a FlashNextModel with the embedded default's real vocabulary and special ids, but its token
embedding and LM head hold rows only for the `kept` token ids (the tokens seen in training), plus one zero
padding row that stands in for every other id on input. Logits are over kept tokens only, so a token never
seen in training can never be predicted. The n-gram (PLE) hash reads the raw ids, as at inference.

Losses (`losses`): next-token cross entropy, and the MTP head's cross entropy for the token two ahead (the
hidden at p and token p + 1 predict token p + 2, as the released model's MTP layer does).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig
from ..model import FlashNextModel
from ..state import SequenceState
from .default import DEFAULT_CONFIG

_L, _F = "linear_attention", "full_attention"

# Overrides of the embedded default's text config. "default": the shipped model (hidden 256, 8 layers + MTP, 8 experts
# top-2 + a shared expert, ~8 M non-embedding parameters); "tiny": CPU tests.
SIZES: dict[str, dict] = {
    "default": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                    linear_value_head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                    shared_expert_intermediate_size=128, hc_lowrank=16, ple_embed_dim=128,
                    ngram_vocab_size_base=8192, indexer_head_dim=64, indexer_budget=128,
                    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25,
                                     "mrope_section": [4, 2, 2], "mrope_interleaved": True}),
    # budget 16 / ratio 4: sparse from query position 19, inside a 32-token test row
    "tiny": dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=1,
                 linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16, hc_lowrank=4,
                 ple_embed_dim=16, ngram_vocab_size_base=256, indexer_head_dim=16, indexer_budget=16,
                 num_hidden_layers=4, layer_types=[_L, _L, _F, _L],
                 rope_parameters={"rope_type": "default", "rope_theta": 10_000, "partial_rotary_factor": 0.25,
                                  "mrope_section": [2, 0, 0], "mrope_interleaved": True}),
}


def trained_config(size: str = "default") -> ModelConfig:
    """The embedded default's config (vocabulary, special ids, layer kinds) with the `size` overrides, text only."""
    if size not in SIZES:
        raise ValueError(f"size={size!r} is not one of {sorted(SIZES)}")
    raw = copy.deepcopy(DEFAULT_CONFIG)
    raw.pop("vision_config")
    over = copy.deepcopy(SIZES[size])
    over["partial_rotary_factor"] = over["rope_parameters"]["partial_rotary_factor"]
    raw["text_config"].update(over)
    return ModelConfig.from_dict(raw, source=f"trained default ({size})")


@dataclass(frozen=True)
class LossWeights:
    mtp: float = 0.3


class TrainNet(nn.Module):
    """FlashNextModel with a compact embedding / LM head over `kept` ids [K] (sorted, int64)."""

    def __init__(self, cfg: ModelConfig, kept: Tensor, seed: int = 0):
        super().__init__()
        d = cfg.text.hidden_size
        with torch.device("meta"):
            net = FlashNextModel(cfg, with_vision=False)
        k = kept.numel()
        net.model.language_model.embed_tokens = nn.Embedding(k + 1, d, padding_idx=k, device="meta")
        net.lm_head = nn.Linear(d, k, bias=False, device="meta")
        net.to_empty(device="cpu")
        net.init_buffers()
        self.net = net
        self.batched = True  # run the rows as one batch in GDN / QSA (ForwardMeta.uniform_fresh); False: one by one
        self.register_buffer("kept", kept.clone(), persistent=True)
        remap = torch.full((cfg.text.vocab_size,), k, dtype=torch.long)
        remap[kept] = torch.arange(k)
        self.register_buffer("remap", remap, persistent=False)  # full id -> compact row (k: not kept)
        init_for_training(self.net, seed)

    @property
    def text(self):
        return self.net.model.language_model

    def trunk(self, ids: Tensor, taps: dict[int, Tensor | None] | None = None) -> Tensor:
        """ids: [B, S] full ids, each row a fresh sequence -> wide pre-mixer state [B, S, h*d]."""
        B, S = ids.shape
        flat = ids.reshape(-1)
        meta = self.net.make_meta(flat, [b * S for b in range(B + 1)], [SequenceState() for _ in range(B)])
        meta.taps, meta.uniform_fresh = taps, self.batched
        wide = self.text(self.text.embed_tokens(self.remap[flat]), meta)
        return wide.view(B, S, -1)

    def logits(self, wide: Tensor) -> Tensor:
        """wide: [..., h*d] -> logits over kept tokens [..., K] (fp32)."""
        y = self.text.hyper_connection_mixer.read(wide.flatten(0, -2))[0]
        return self.net.lm_head(y).float().unflatten(0, wide.shape[:-1])

    def mtp_logits(self, wide: Tensor, ids: Tensor) -> Tensor:
        """MTP draft step over every position: wide [B, S, W] at p and ids [B, S] -> logits [B, S-1, K] for p+2."""
        B, S, W = wide.shape
        tok = ids[:, 1:].reshape(-1)  # the token after each hidden
        hidden = wide[:, :-1].reshape(-1, W)
        n = S - 1
        meta = self.net.make_meta(tok, [b * n for b in range(B + 1)], [SequenceState() for _ in range(B)])
        meta.uniform_fresh = self.batched
        y, _ = self.net.mtp(hidden, self.text.embed_tokens(self.remap[tok]), meta)
        return self.net.lm_head(y).float().view(B, n, -1)

    def targets(self, ids: Tensor) -> Tensor:
        """Compact targets, -100 (ignored) where the id is not kept."""
        t = self.remap[ids]
        return t.masked_fill(t == self.kept.numel(), -100)

    def losses(self, ids: Tensor) -> dict[str, Tensor]:
        """ids: [B, S] -> {"ce": next-token CE, "mtp": CE of the token two ahead} (means over kept targets)."""
        wide = self.trunk(ids)
        tgt = self.targets(ids)
        ce = F.cross_entropy(self.logits(wide[:, :-1]).flatten(0, 1), tgt[:, 1:].flatten())
        out = {"ce": ce}
        if self.net.mtp is not None:
            m = self.mtp_logits(wide, ids)[:, :-1]  # row p predicts p + 2; the last row has no target
            out["mtp"] = F.cross_entropy(m.flatten(0, 1), tgt[:, 2:].flatten())
        return out


def init_for_training(net: FlashNextModel, seed: int, std: float = 0.02) -> None:
    """A trainable init (not `init_random_weights`, which spreads the norms for tests): N(0, std) matrices,
    output projections scaled by 1/sqrt(2 * layers), zero-centred norms at 0 and plain gains at 1, GDN decays
    spread as in Mamba (A in [1, 16], dt in [1e-3, 0.1])."""
    gen = torch.Generator().manual_seed(seed)
    layers = net.cfg.text.num_hidden_layers
    params = dict(net.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                dt = torch.exp(torch.empty(p.shape).uniform_(math.log(1e-3), math.log(0.1), generator=gen))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
            elif p.dim() == 1:  # norms: (1 + w) ones at 0, plain gains (GatedRMSNorm) at 1
                p.fill_(1.0 if name.endswith("linear_attn.norm.weight") else 0.0)
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
            else:
                scale = std / math.sqrt(2 * layers) if name.endswith(("o_proj.weight", "out_proj.weight",
                                                                       "down_proj.weight", "down_proj")) else std
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
        emb = net.model.language_model.embed_tokens
        emb.weight[emb.padding_idx].zero_()

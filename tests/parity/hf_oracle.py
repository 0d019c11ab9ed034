"""Build tiny random Qwen4Exp models in `transformers` (the oracle) and matching revolta models.

Configs follow spec/model.md §12.2. Every parameter is randomised (zero-initialised norms,
PLE conv and router included), so no path is trivially zero.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from revolta.config import ModelConfig
from revolta.model import FlashNextModel, init_random_weights

L, F = "linear_attention", "full_attention"

T4_TEXT = dict(
    vocab_size=512, eos_token_id=511, hidden_size=64, num_hidden_layers=4, layer_types=[L, L, L, F],
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[2, 1, 1],
                         mrope_interleaved=True),
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    hc_lowrank=16, ple_layer_ids=[2], ple_embed_dim=64, heads_per_ngram=2, ngram_vocab_size_base=97,
    make_ngram_vocab_size_divisible_by=8, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
    indexer_budget=8, indexer_compress_ratio=4, split_ngram_parts=1, output_gate_type="sigmoid",
    rms_norm_eps=1e-6, hidden_act="silu",
)
V_TINY = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, num_position_embeddings=16, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64)
TOKENS = dict(image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503)


def text_config(name: str) -> dict:
    cfg = copy.deepcopy(T4_TEXT)
    if name == "T2":
        cfg.update(num_hidden_layers=2, layer_types=[L, F], ple_layer_ids=[1])
    elif name == "T8":
        cfg.update(num_hidden_layers=8, layer_types=[L, L, L, F, L, L, L, F], ple_layer_ids=[2])
    elif name != "T4":
        raise KeyError(name)
    return cfg


def build_pair(name: str = "T4", seed: int = 0, vision: bool = False, **overrides):
    """(hf_model, revolta_model, revolta ModelConfig), both fp32 eval with identical random weights."""
    from transformers import Qwen4ExpConfig, Qwen4ExpForConditionalGeneration

    tc = text_config(name)
    tc.update(overrides)
    hf_cfg = Qwen4ExpConfig(text_config=tc, vision_config=dict(V_TINY), **TOKENS)
    hf_cfg._attn_implementation = "eager"
    hf_cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = Qwen4ExpForConditionalGeneration(hf_cfg).eval()
    cfg = ModelConfig.from_dict(hf_cfg.to_dict())
    ours = FlashNextModel(cfg, with_mtp=False, with_vision=vision).eval()
    init_random_weights(ours, seed=seed)
    sd = ours.state_dict()
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    if not vision:
        missing = [k for k in missing if not k.startswith("model.visual.")]
    assert not missing and not unexpected, (missing, unexpected)
    return hf, ours, cfg


def _stable_topk(self, k, dim=-1, largest=True, sorted=True):
    """torch.topk with revolta's tie policy: by score, then by ascending index."""
    order = torch.sort(self, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
    return torch.return_types.topk((self.gather(dim, order), order))


@contextlib.contextmanager
def deterministic_topk():
    """Run the oracle with a defined top-k tie policy.

    The QSA indexer's ReLU makes many block scores exactly 0, so ties at the budget boundary
    are common; torch.topk resolves them in an implementation-defined way (spec §4.4, §13.2).
    Inside this context every `Tensor.topk` breaks ties by ascending index, the policy revolta
    implements, so parity checks compare numerics rather than tie luck.
    """
    original = torch.Tensor.topk
    torch.Tensor.topk = _stable_topk
    try:
        yield
    finally:
        torch.Tensor.topk = original

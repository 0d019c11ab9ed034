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

from tiny_configs import F, L, T4_TEXT, TOKENS, V_TINY  # noqa: F401  (re-exported to the parity tests)


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


@torch.no_grad()
def assert_matches_reference(model, hf, seq_len: int, rtol: float = 1e-4) -> torch.Tensor:
    """revolta's full-forward logits on 2 random sequences of `seq_len` ids within rtol (relative to the largest) of
    the oracle's, with the same argmax everywhere; returns the ids."""
    ids = torch.randint(0, 500, (2, seq_len), generator=torch.Generator().manual_seed(0))
    with deterministic_topk():
        ref = hf(input_ids=ids).logits
    out = model(ids)
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= rtol
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    return ids

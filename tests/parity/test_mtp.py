"""The MTP head against a standalone implementation of spec/model.md §7.

No reference library implements MTP, so the oracle is built here from the spec's
equations: the stem (norms, fc_embedding, fc_hidden on every branch) in plain torch, and
the MTP decoder layer (QSA + MoE + HCs, no PLE) and final mixer taken from transformers'
qwen4_exp modules loaded with the MTP weights. Sequences run in one causal forward in the
oracle and incrementally (prefill, then k recursive draft steps) in revolta.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_oracle import TOKENS, V_TINY, deterministic_topk, text_config  # noqa: E402

from revolta.config import ModelConfig  # noqa: E402
from revolta.model import FlashNextModel, init_random_weights  # noqa: E402
from revolta.state import SequenceState  # noqa: E402

from transformers.models.qwen4_exp import modeling_qwen4_exp as hfm  # noqa: E402


def zc_norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


class StandaloneMTP:
    """Spec §7.2 written out directly; one causal pass over a whole sequence of (hidden, token, position)."""

    def __init__(self, model: FlashNextModel, hf_text_cfg):
        sd = {k[len("mtp."):]: v for k, v in model.state_dict().items() if k.startswith("mtp.")}
        self.sd, self.h = sd, hf_text_cfg.hc_count
        qsa_idx = hf_text_cfg.layer_types.index("indexed_attention")
        self.layer = hfm.Qwen4ExpTextDecoderLayer(hf_text_cfg, qsa_idx).eval()
        self.layer.load_state_dict({k[len("layers.0."):]: v for k, v in sd.items() if k.startswith("layers.0.")})
        self.mixer = hfm.Qwen4ExpTextGatedResidual(hf_text_cfg, use_combine=False).eval()
        self.mixer.load_state_dict({k[len("hyper_connection_mixer."):]: v for k, v in sd.items()
                                    if k.startswith("hyper_connection_mixer.")})
        self.rotary = hfm.Qwen4ExpTextRotaryEmbedding(hf_text_cfg)
        self.embed = model.model.language_model.embed_tokens.weight
        self.lm_head = model.lm_head.weight

    @torch.no_grad()
    def __call__(self, hidden, tokens, positions):
        """hidden [S, h*d], tokens [S], positions [S] -> (logits [S, V], wide output M [S, h*d])."""
        sd, S = self.sd, hidden.shape[0]
        e = zc_norm(self.embed[tokens], sd["pre_fc_norm_embedding.weight"]) @ sd["fc_embedding.weight"].t()
        hn = zc_norm(hidden, sd["pre_fc_norm_hidden.weight"])  # ONE group over all h*d features
        x = torch.cat([hn[:, b * e.shape[1]:(b + 1) * e.shape[1]] @ sd["fc_hidden.weight"].t() + e
                       for b in range(self.h)], dim=-1)[None]
        pos = positions.view(1, 1, S).expand(3, 1, S)
        cos_sin = self.rotary(x, pos)
        mask = torch.full((S, S), torch.finfo(torch.float32).min).triu(1)[None, None]
        with deterministic_topk():
            m = self.layer(x, position_embeddings=cos_sin, attention_mask=mask)
        y = self.mixer(m)
        return (y @ self.lm_head.t())[0], m[0]


@pytest.fixture(scope="module")
def setup():
    tc = text_config("T4")
    hf_cfg = transformers.Qwen4ExpConfig(text_config=tc, vision_config=dict(V_TINY), **TOKENS)
    hf_cfg.text_config._attn_implementation = "eager"
    raw = hf_cfg.to_dict()
    raw["text_config"]["mtp_num_hidden_layers"] = 1
    cfg = ModelConfig.from_dict(raw)
    model = FlashNextModel(cfg, with_vision=False).eval()
    init_random_weights(model, seed=17)
    return model, StandaloneMTP(model, hf_cfg.text_config)


def assert_close(a, b):
    rel = ((a - b).abs().max() / b.abs().max()).item()
    assert rel <= 1e-4, rel
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@torch.no_grad()
def test_mtp_weights_are_the_31_checkpoint_tensors(setup):
    model, _ = setup
    names = [k for k in model.state_dict() if k.startswith("mtp.")]
    assert len(names) == 31, names  # spec §7.1


@torch.no_grad()
@pytest.mark.parametrize("length", [1, 5, 30])
def test_prompt_pass_matches_standalone(setup, length):
    """Prefill seeding: hidden at t paired with token t+1 at position t, whole prompt at once."""
    model, oracle = setup
    ids = torch.randint(0, 500, (length + 1,), generator=torch.Generator().manual_seed(length))
    _, hidden = model(ids[:-1], return_hidden=True)  # target pre-mixer wide states [S, h*d]
    pos = torch.arange(length)
    logits, m = model.mtp_forward(hidden, ids[1:], pos.expand(3, -1), [0, length], [SequenceState()])
    ref_logits, ref_m = oracle(hidden, ids[1:], pos)
    assert_close(logits, ref_logits)
    torch.testing.assert_close(m, ref_m, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_recursive_drafting_matches_standalone(setup):
    """MTP4: prefill over the prompt, then 4 draft steps reusing M and positions p_t + k (spec §7.3)."""
    model, oracle = setup
    S, k = 20, 4
    ids = torch.randint(0, 500, (S + 1,), generator=torch.Generator().manual_seed(3))
    _, hidden = model(ids[:S], return_hidden=True)
    st = SequenceState()
    # seed the MTP cache with the prompt pairs (hidden t, token t+1, position t) for t < S-1
    model.mtp_forward(hidden[:-1], ids[1:S], torch.arange(S - 1).expand(3, -1), [0, S - 1], [st])
    h, tok, drafts, rows_h, rows_tok = hidden[-1:], ids[S:S + 1], [], [], []
    for step in range(k):
        rows_h.append(h)
        rows_tok.append(tok)
        pos = torch.full((3, 1), S - 1 + step)
        logits, h = model.mtp_forward(h, tok, pos, [0, 1], [st], step=step)
        tok = logits.argmax(-1)
        drafts.append(logits)
    seq_h = torch.cat([hidden[:-1]] + rows_h)
    seq_tok = torch.cat([ids[1:S]] + rows_tok)
    ref_logits, _ = oracle(seq_h, seq_tok, torch.arange(S - 1 + k))
    assert_close(torch.cat(drafts), ref_logits[S - 1:])

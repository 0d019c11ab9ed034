"""The vocab-masked LM head projects onto the allowed rows only (layers/allowed_vocab.py)."""

import torch
from torch import nn

from revolta.layers.allowed_vocab import AllowedVocabHead


def _full_masked(y, weight, mask):
    return (y @ weight.t()).float().masked_fill(~mask, float("-inf"))


def test_allowed_rows_give_the_masked_full_logits():
    g = torch.Generator().manual_seed(0)
    V, d = 1000, 32
    weight = torch.randn(V, d, generator=g)
    mask = torch.zeros(V, dtype=torch.bool)
    mask[torch.randperm(V, generator=g)[:90]] = True
    head = AllowedVocabHead()
    assert head.prepare(weight, mask)
    for n in (1, 5, 40):
        y = torch.randn(n, d, generator=g)
        got, want = head.logits(y, V), _full_masked(y, weight, mask)
        assert got.dtype == torch.float32 and got.shape == (n, V)
        assert torch.equal(torch.isinf(got), ~mask.expand(n, V))
        torch.testing.assert_close(got[:, mask], want[:, mask], rtol=1e-6, atol=1e-5)


def test_rows_follow_in_place_weight_writes_and_a_new_mask():
    V, d = 200, 8
    lm_head = nn.Linear(d, V, bias=False)
    mask = torch.zeros(V, dtype=torch.bool)
    mask[:20] = True
    head = AllowedVocabHead()
    y = torch.randn(3, d)
    assert head.prepare(lm_head.weight, mask)
    before = head.logits(y, V)
    with torch.no_grad():
        lm_head.weight.mul_(2.0)  # an in-place update through the parameter (a weight reload, an RL step)
    assert head.prepare(lm_head.weight, mask)
    torch.testing.assert_close(head.logits(y, V)[:, :20], 2.0 * before[:, :20])
    mask2 = torch.zeros(V, dtype=torch.bool)
    mask2[100:110] = True
    assert head.prepare(lm_head.weight, mask2)
    assert torch.equal(torch.isfinite(head.logits(y, V)), mask2.expand(3, V))
    mask2.fill_(True)  # in place: more than half the vocabulary allowed, the full product is the cheaper one
    assert not head.prepare(lm_head.weight, mask2)


def test_model_compute_logits_uses_the_allowed_rows_only_for_a_plain_head(default_dir):
    from revolta.model import load_model

    model = load_model(default_dir, progress=False)
    V = model.cfg.text.vocab_size
    y = torch.randn(4, model.cfg.text.hidden_size, dtype=model.dtype)
    assert not model.prepare_logits()  # no mask: the full head
    full = model.compute_logits(y)
    mask = torch.zeros(V, dtype=torch.bool)
    mask[1000:1064] = True
    model.logit_mask = mask
    assert model.prepare_logits()
    got = model.compute_logits(y)
    assert torch.equal(torch.isfinite(got), mask.expand(4, V))
    torch.testing.assert_close(got[:, mask], full[:, mask], rtol=1e-5, atol=1e-5)

"""fp32 parity of the text model against transformers' qwen4_exp (spec/model.md §12).

Criterion (issue "Model and foundation"): max |Δlogit| / max |logit| <= 1e-4 and identical
argmax at every position, for the tiny configs T2/T4/T8, through sparse QSA selection.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_oracle import build_pair, deterministic_topk  # noqa: E402

from revolta.state import SequenceState  # noqa: E402

REL_TOL = 1e-4
LENGTHS = [1, 2, 3, 4, 5, 11, 12, 13, 63, 64, 65, 130]


def assert_parity(out: torch.Tensor, ref: torch.Tensor) -> None:
    rel = ((out - ref).abs().max() / ref.abs().max()).item()
    assert rel <= REL_TOL, f"max |Δlogit| / max |logit| = {rel:.3e}"
    mismatch = (out.argmax(-1) != ref.argmax(-1)).nonzero().tolist()
    assert not mismatch, f"argmax differs at positions {mismatch[:10]}"


SEEDS = {"T2": 2, "T4": 4, "T8": 8}


@pytest.fixture(scope="module", params=["T2", "T4", "T8"])
def pair(request):
    hf, ours, cfg = build_pair(request.param, seed=SEEDS[request.param])
    return hf, ours, cfg


def random_ids(cfg, length: int, seed: int, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # stay clear of the media token ids (500..503) and EOS; EOS is placed explicitly where wanted
    return torch.randint(0, 500, (batch, length), generator=g)


@torch.no_grad()
def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with deterministic_topk():
        return hf(input_ids=ids).logits


@torch.no_grad()
@pytest.mark.parametrize("length", LENGTHS)
def test_full_forward(pair, length):
    hf, ours, cfg = pair
    ids = random_ids(cfg, length, seed=length)
    assert_parity(ours(ids), hf_logits(hf, ids))


@torch.no_grad()
def test_sparse_selection_is_exercised(pair):
    """The long sequence really is past the sparse onset (so parity above covers selection)."""
    _, _, cfg = pair
    assert max(LENGTHS) - 1 > cfg.text.qsa_sparse_onset + 4 * cfg.text.indexer_compress_ratio


@torch.no_grad()
@pytest.mark.parametrize("prefill", [1, 13, 64])
def test_prefill_then_decode(pair, prefill):
    hf, ours, cfg = pair
    ids = random_ids(cfg, 40 if prefill < 64 else 70, seed=7 + prefill)
    ref = hf_logits(hf, ids)[0]
    st = SequenceState()
    out = [ours(ids[0, :prefill], cu_seqlens=[0, prefill], states=[st])]
    for t in range(prefill, ids.shape[1]):
        out.append(ours(ids[0, t : t + 1], cu_seqlens=[0, 1], states=[st]))
    assert st.num_tokens == ids.shape[1]
    assert_parity(torch.cat(out), ref)


@torch.no_grad()
def test_chunked_prefill_odd_splits(pair):
    hf, ours, cfg = pair
    ids = random_ids(cfg, 5 + 7 + 13 + 64 + 3, seed=11)
    ref = hf_logits(hf, ids)[0]
    st, pos, out = SequenceState(), 0, []
    for n in (5, 7, 13, 64, 3):
        out.append(ours(ids[0, pos : pos + n], cu_seqlens=[0, n], states=[st]))
        pos += n
    assert_parity(torch.cat(out), ref)


@torch.no_grad()
@pytest.mark.parametrize("eos_at", [[0], [1], [17], [17, 18], [5, 30, 31]])
def test_eos_resets_ngram_context(pair, eos_at):
    hf, ours, cfg = pair
    ids = random_ids(cfg, 36, seed=3)
    ids[0, eos_at] = cfg.text.eos_token_id
    ref = hf_logits(hf, ids)[0]
    assert_parity(ours(ids)[0], ref)
    # and the same across an incremental split right after the EOS
    cut = eos_at[-1] + 1
    st = SequenceState()
    inc = torch.cat([ours(ids[0, :cut], cu_seqlens=[0, cut], states=[st]),
                     ours(ids[0, cut:], cu_seqlens=[0, 36 - cut], states=[st])])
    assert_parity(inc, ref)


@torch.no_grad()
def test_varlen_batch_matches_single_sequences(pair):
    hf, ours, cfg = pair
    lengths = [3, 17, 1, 66]
    seqs = [random_ids(cfg, n, seed=100 + n)[0] for n in lengths]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    states = [SequenceState() for _ in lengths]
    flat = ours(torch.cat(seqs), cu_seqlens=cu, states=states)
    for b, s in enumerate(seqs):
        single = ours(s[None])[0]
        torch.testing.assert_close(flat[cu[b] : cu[b + 1]], single, rtol=1e-5, atol=1e-5)
        assert_parity(flat[cu[b] : cu[b + 1]], hf_logits(hf, s[None])[0])
    # a mixed decode step: one token for every sequence, different context lengths
    nxt = torch.randint(0, 500, (len(lengths),), generator=torch.Generator().manual_seed(5))
    step = ours(nxt, cu_seqlens=list(range(len(lengths) + 1)), states=states)
    for b, s in enumerate(seqs):
        ref = hf_logits(hf, torch.cat([s, nxt[b : b + 1]])[None])[0, -1]
        assert_parity(step[b : b + 1], ref[None])


@torch.no_grad()
def test_hf_padded_batch_matches(pair):
    """Two sequences of one length in an HF batch agree with our flat batch row by row."""
    hf, ours, cfg = pair
    ids = random_ids(cfg, 30, seed=21, batch=2)
    assert_parity(ours(ids), hf_logits(hf, ids))

"""n-gram hashing constants, QSA tie policy, RoPE tables (spec §2.7, §4.4, §5)."""

import torch

from revolta.config import RopeConfig
from revolta.layers.ngram import hash_multipliers, head_table_sizes, ngram_context
from revolta.layers.qsa import select_blocks
from revolta.layers.rope import RotaryEmbedding, mrope_row_index, rope_inv_freq


def test_real_ple_constants_from_derivation():
    # spec §5.2: derived from vocab 248320, seed 1234, PLE index 0
    assert hash_multipliers(248320, 3, 0, 1234) == [23703573157769, 20109073645365, 8052911324071]
    sizes = head_table_sizes(20_000_000, 16, 0)
    assert sizes[:8] == [20000003, 20000023, 20000033, 20000047, 20000059, 20000063, 20000069, 20000077]
    assert sizes[8:] == [20000081, 20000093, 20000107, 20000147, 20000153, 20000159, 20000161, 20000171]
    assert sum(sizes) == 320_001_446


def test_ngram_context_resets_after_eos():
    eos = 9
    ctx = ngram_context([1, 2, eos, 3, 4, eos, eos, 5], [eos, eos], eos, 3)
    assert ctx[0] == [1, eos, eos]
    assert ctx[2] == [eos, 2, 1]  # the EOS itself keeps its predecessors
    assert ctx[3] == [3, eos, eos]  # the token after EOS hashes as (id, EOS, EOS)
    assert ctx[4] == [4, 3, eos]
    assert ctx[7] == [5, eos, eos]
    # context carried across calls
    assert ngram_context([7], [3, 4], eos, 3) == [[7, 4, 3]]


def test_select_blocks_ties_prefer_lower_index():
    scores = torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.5, 0.0]])
    chosen = select_blocks(scores, torch.tensor([6]), budget=3)
    assert chosen[0].tolist() == [True, True, False, False, True, False]
    # blocks beyond the visible count are never chosen
    chosen = select_blocks(scores, torch.tensor([3]), budget=3)
    assert chosen[0].tolist() == [True, True, True, False, False, False]


def test_mrope_interleaved_rows_real_sections():
    rows = mrope_row_index(32, (11, 11, 10), True)
    assert rows[1::3].tolist() == [1] * 11
    assert rows[2:30:3].tolist() == [2] * 10
    assert (rows[0::3] == 0).all() and rows[30] == 0


def test_rope_text_positions_and_yarn_scale():
    rope = RotaryEmbedding(RopeConfig(mrope_section=(2, 1, 1)), 8)
    cos, sin = rope(torch.arange(5).expand(3, -1))
    inv = 1.0 / (1e7 ** (torch.arange(0, 8, 2).float() / 8))
    torch.testing.assert_close(cos[3], torch.cos(3 * torch.cat([inv, inv])))
    yarn = RopeConfig(rope_type="yarn", factor=2.0, original_max_position_embeddings=262144)
    inv_y, scale = rope_inv_freq(yarn, 64)
    inv_d, _ = rope_inv_freq(RopeConfig(), 64)
    assert abs(scale - (0.1 * torch.log(torch.tensor(2.0)).item() + 1)) < 1e-6
    assert inv_y[0] == inv_d[0]  # highest frequency kept (extrapolated)
    torch.testing.assert_close(inv_y[-1], inv_d[-1] / 2)  # lowest frequency interpolated by the factor


def test_vectorised_ngram_contexts_equal_the_definition():
    from revolta.layers.ngram import ngram_contexts

    g = torch.Generator().manual_seed(0)
    eos, order = 9, 3
    lens = [1, 2, 7, 13, 4]
    seqs = [torch.randint(0, 11, (n,), generator=g).tolist() for n in lens]  # ids 9 = EOS appear often
    hists = [[eos, eos], [3, eos], [9, 4], [5, 6], [2, 9]]
    ids = torch.tensor([t for s in seqs for t in s])
    seq_index = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    local = torch.cat([torch.arange(n) for n in lens])
    got = ngram_contexts(ids, torch.tensor(hists), seq_index, local, eos)
    want = [c for s, h in zip(seqs, hists) for c in ngram_context(s, h, eos, order)]
    assert got.tolist() == want

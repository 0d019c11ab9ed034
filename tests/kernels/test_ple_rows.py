"""The PLE row-id kernel (kernels/ple_rows.py) against its torch reference, bitwise: row ids, the carried history and
the contexts stored back into the paged cache, at the real vocabulary and prime table sizes (spec/model.md §5.2)."""

import pytest
import torch

from revolta.kernels.ple_rows import carried_histories, ngram_contexts, ple_rows, ple_rows_ref, token_layout
from revolta.layers.ngram import hash_multipliers, head_table_sizes

VOCAB, EOS, ORDER, HEADS_PER_NGRAM = 248_320, 248_044, 3, 8  # TextConfig defaults (ngram_size 3, heads_per_ngram 8)
SIZES = head_table_sizes(20_000_000, (ORDER - 1) * HEADS_PER_NGRAM, 0)
OFFSETS = [sum(SIZES[:h]) for h in range(len(SIZES))]


def _step(lens: list[int], seed: int, num_slots: int = 12) -> dict:
    """A paged step of len(lens) sequences: EOS in ~1 of 4 step ids and carried ids, some sequences new."""
    g = torch.Generator().manual_seed(seed)

    def ids(*shape):
        x = torch.randint(0, VOCAB, shape, generator=g)
        return torch.where(torch.rand(shape, generator=g) < 0.25, EOS, x)

    B = len(lens)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    has_initial_state = torch.rand(B, generator=g) < 0.7
    has_initial_state[0] = False  # at least one new sequence, whose garbage slot row must read as EOS
    has_initial_state[1] = True
    return dict(ids=ids(int(cu[-1])), cu_seqlens=cu, context_ids=ids(num_slots, ORDER - 1),
                slots=torch.randperm(num_slots, generator=g)[:B].to(torch.int32), has_initial_state=has_initial_state,
                max_new_tokens=max(lens))


def _run(fn, step: dict, multipliers: list[int], store: bool):
    """fn's (rows, history) and the context_ids it leaves, on a copy of the step's cache."""
    s = dict(step, context_ids=step["context_ids"].clone())
    rows, history = fn(s["ids"], s["cu_seqlens"], s["context_ids"], s["slots"], s["has_initial_state"],
                       torch.tensor(multipliers), torch.tensor(SIZES), torch.tensor(OFFSETS), HEADS_PER_NGRAM, EOS,
                       s["max_new_tokens"], store=store)
    return rows, history, s["context_ids"]


def _mixes(step: dict, multipliers: list[int]) -> torch.Tensor:
    """[T, n-1] the bigram and trigram mixes the rows take the remainder of (the reference's own contexts)."""
    seq, local = token_layout(step["cu_seqlens"], step["ids"].shape[0], torch.device("cpu"))
    hist = carried_histories(step["context_ids"], step["slots"], step["has_initial_state"], EOS, torch.device("cpu"))
    c = ngram_contexts(step["ids"], hist, seq, local, EOS)
    mix, out = c[:, 0] * multipliers[0], []
    for k in range(1, ORDER):
        mix = mix ^ (c[:, k] * multipliers[k])
        out.append(mix)
    return torch.stack(out, -1)


REAL = hash_multipliers(VOCAB, ORDER, 0, 1234)  # spec §5.2: 23703573157769, 20109073645365, 8052911324071
# odd multipliers near 2^62: id * m wraps in int64, so the mixes go negative (a checkpoint's buffers are not
# bounded by the derivation) and the remainder must be the non-negative one
WRAPPING = [(1 << 62) - 57, (1 << 61) + 12345, (3 << 60) + 999]


@pytest.mark.parametrize("lens", [[1] * 6, [1, 5, 5, 1, 3, 1], [16, 2, 9]], ids=["decode", "verify5", "block16"])
@pytest.mark.parametrize("multipliers", [REAL, WRAPPING], ids=["real", "wrapping"])
def test_kernel_equals_reference_bitwise(lens, multipliers):
    step = _step(lens, seed=len(lens) + sum(lens))
    mixes = _mixes(step, multipliers)
    if multipliers is WRAPPING:
        assert (mixes < 0).any(dim=0).all(), "the negative-mix case (bigram and trigram) is not exercised"
    else:
        assert (mixes >= 0).all()  # spec §5.3: the real constants never overflow
    assert (step["ids"] == EOS).any() and (step["context_ids"][step["slots"].long()] == EOS).any()
    rows, history, ctx = _run(ple_rows, step, multipliers, store=True)
    rows_ref, history_ref, ctx_ref = _run(ple_rows_ref, step, multipliers, store=True)
    assert rows.dtype == torch.int64 and rows.shape == (sum(lens), len(SIZES))
    assert torch.equal(rows, rows_ref), (rows - rows_ref).abs().max()
    assert ((rows >= torch.tensor(OFFSETS)) & (rows < torch.tensor(OFFSETS) + torch.tensor(SIZES))).all()
    assert torch.equal(history, history_ref) and torch.equal(ctx, ctx_ref)
    assert (history[~step["has_initial_state"]] == EOS).all()
    # every slot of the step now holds its last n-1 ids; the others are untouched
    assert not torch.equal(ctx, step["context_ids"])
    others = torch.ones(ctx.shape[0], dtype=torch.bool)
    others[step["slots"].long()] = False
    assert torch.equal(ctx[others], step["context_ids"][others])


@pytest.mark.parametrize("fn", [ple_rows, ple_rows_ref], ids=["triton", "torch"])
def test_verify_step_stores_nothing_and_fills_the_record_buffer(fn):
    step = _step([5, 1, 5, 2], seed=3)
    rows, history, ctx = _run(fn, step, REAL, store=False)
    stored_rows, stored_history, _ = _run(fn, step, REAL, store=True)
    assert torch.equal(ctx, step["context_ids"]), "a verify step changed the carried contexts"
    assert torch.equal(rows, stored_rows) and torch.equal(history, stored_history)
    out = torch.full((4, ORDER - 1), -1, dtype=torch.int64)
    s = step
    _, got = fn(s["ids"], s["cu_seqlens"], s["context_ids"].clone(), s["slots"], s["has_initial_state"],
                torch.tensor(REAL), torch.tensor(SIZES), torch.tensor(OFFSETS), HEADS_PER_NGRAM, EOS,
                s["max_new_tokens"], store=False, history_out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, history)


def test_sequences_longer_than_the_tile_take_several_passes():
    step = dict(_step([5, 1, 9], seed=5), max_new_tokens=2)  # BLOCK_T 2: 3 and 5 passes
    rows, history, ctx = _run(ple_rows, step, WRAPPING, store=True)
    rows_ref, history_ref, ctx_ref = _run(ple_rows_ref, step, WRAPPING, store=True)
    assert torch.equal(rows, rows_ref) and torch.equal(history, history_ref) and torch.equal(ctx, ctx_ref)

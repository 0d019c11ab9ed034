"""The packed step buffer (engine/runner.py `pack_buffer`): a hand-worked step read back through StepInputs, and the
two builders (one Python list for short steps, tensor ops over all tokens for long ones) equal on random steps with
media positions, chunks across a prompt's given positions, padding rows and wider block tables."""

from __future__ import annotations

import random

import pytest
import torch

from revolta.engine import runner
from revolta.engine.runner import StepInputs, StepSequence, pack_buffer

BS, RATIO = 16, 4


def test_a_hand_worked_step_reads_back_through_step_inputs():
    media = torch.tensor([[0, 1, 1, 1, 2], [0, 1, 2, 1, 2], [0, 1, 1, 2, 2]])  # [3, P = 5] given positions
    seqs = [StepSequence([11], 17, [3, 7], slot=4, rope_delta=-2),  # decode: token index 17
            StepSequence([21, 22, 23], 3, [9], slot=6, rope_delta=-1, positions=media)]  # index 3, 4 given, 5 not
    flat = pack_buffer(seqs, BS, RATIO, num_rows=3, width=3)
    got = StepInputs.unpack(flat, 3, 5, 3)
    assert got.input_ids.tolist() == [11, 21, 22, 23, 0]
    assert got.positions.tolist() == [[15, 1, 2, 4, 0], [15, 1, 2, 4, 0], [15, 2, 2, 4, 0]]
    # compress groups of 4: sequence 0 starts in the group at 16 (16 - 2), sequence 1 in the group at 0 (given)
    assert got.group_pos.tolist() == [[14, 0, 0], [14, 0, 0], [14, 0, 0]]
    assert got.slots.tolist() == [4, 6, 0] and got.has_initial_state.tolist() == [True, True, False]
    assert got.cu_seqlens.tolist() == [0, 1, 4, 5] and got.seq_lens.tolist() == [18, 6, 1]
    assert got.block_table.tolist() == [[3, 7, 0], [9, 0, 0], [0, 0, 0]]
    assert got.slot_mapping.tolist() == [7 * BS + 1, 9 * BS + 3, 9 * BS + 4, 9 * BS + 5, 0]


def _random_step(rng: random.Random) -> tuple[list[StepSequence], int, int]:
    seqs = []
    for i in range(rng.randint(1, 9)):
        n = rng.choice([1, 1, 2, 5, rng.randint(1, 300)])
        start = rng.choice([0, rng.randint(0, 400)])
        blocks = list(range(100 * i, 100 * i + -(-(start + n) // BS) + rng.randint(0, 2)))
        given = rng.choice([None, rng.randint(1, 500)])
        positions = None if given is None else torch.randint(0, 1000, (3, given))
        seqs.append(StepSequence([rng.randint(0, 5000) for _ in range(n)], start, blocks, rng.randint(0, 20),
                                 rope_delta=rng.randint(-50, 50), positions=positions))
    width = max(len(s.block_ids) for s in seqs) + rng.choice([0, 0, 3, 200])  # a graph's wide table too
    return seqs, len(seqs) + rng.choice([0, 0, 2]), width


def test_list_and_tensor_builders_agree(monkeypatch):
    rng = random.Random(0)
    for _ in range(150):
        seqs, rows, width = _random_step(rng)
        for args in ((rows, width), (None, None)):
            monkeypatch.setattr(runner, "PACK_LIST_MAX_TOKENS", 10**9)
            listed = pack_buffer(seqs, BS, RATIO, *args)
            monkeypatch.setattr(runner, "PACK_LIST_MAX_TOKENS", 0)
            tensored = pack_buffer(seqs, BS, RATIO, *args)
            assert listed.dtype == tensored.dtype == torch.int64 and torch.equal(listed, tensored)


def test_bad_steps_are_named():
    with pytest.raises(ValueError, match="at least one new token"):
        pack_buffer([StepSequence([], 0, [1], 1)], BS, RATIO)
    with pytest.raises(ValueError, match="needs 2 blocks of 16"):
        pack_buffer([StepSequence([5], 16, [1], 1)], BS, RATIO)

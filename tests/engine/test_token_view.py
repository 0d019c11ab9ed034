"""TokenView (engine/token_view.py) reads like the concatenated list it stands for."""

from __future__ import annotations

import random

import pytest

from revolta.engine.token_view import TokenView


def test_reads_like_the_concatenation():
    rng = random.Random(0)
    for _ in range(200):
        head = [rng.randint(0, 99) for _ in range(rng.randint(0, 12))]
        tail = [rng.randint(0, 99) for _ in range(rng.randint(0, 12))]
        view, joined = TokenView(head, tail), head + tail
        assert len(view) == len(joined) and list(view) == joined and view == joined and joined == view
        for i in range(-len(joined), len(joined)):
            assert view[i] == joined[i]
        for _ in range(20):
            a, b = rng.randint(-15, 30), rng.randint(-15, 30)
            step = rng.choice([None, 1, 2, -1, -3])
            assert view[a:b:step] == joined[a:b:step] and view[a:] == joined[a:] and view[:b] == joined[:b]
        with pytest.raises(IndexError):
            view[len(joined)]


def test_reads_the_live_lists():
    head, tail = [1, 2], [3]
    view = TokenView(head, tail)
    tail.append(4)
    assert len(view) == 4 and view[-1] == 4 and view[1:] == [2, 3, 4]
    assert view != [1, 2, 3] and view != "1234"

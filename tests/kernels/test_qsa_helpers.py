"""Shared fixtures for the QSA kernel tests: a tiny paged world built from a QSAttention state."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from revolta.layers.qsa import QSAttention
from revolta.layers.rope import RotaryEmbedding
from revolta.presets.default import default_config

D, DI, HQ, KVH, HI, C = 32, 16, 4, 2, 2, 4
SCALE = 1.0 / math.sqrt(D)


def tiny_cfg(budget_blocks: int):
    cfg = default_config().text
    return dataclasses.replace(cfg, head_dim=D, num_attention_heads=HQ, num_key_value_heads=KVH, indexer_n_heads=HI,
                               indexer_head_dim=DI, indexer_budget=budget_blocks * C, indexer_compress_ratio=C)


def tiny_layer(budget_blocks: int, seed: int = 0) -> QSAttention:
    torch.manual_seed(seed)
    cfg = tiny_cfg(budget_blocks)
    import inspect

    extra = (0,) if "cache_key" in inspect.signature(QSAttention.__init__).parameters else ()
    layer = QSAttention(cfg, "qsa", *extra)
    with torch.no_grad():
        layer.indexer.k_layernorm.weight.normal_(0, 0.3)
    return layer


def rope_tables(n: int, budget_blocks: int = 2):
    cfg = tiny_cfg(budget_blocks)
    rope = RotaryEmbedding(cfg.rope, cfg.rotary_dim)
    pos = torch.arange(n)[None].expand(3, n)
    return rope(pos)  # cos, sin [n, R] fp32


def block_table_for(lengths, block_size: int, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Random distinct pages (never the null block 0), enough for each length, padded with 0."""
    need = [max(1, -(-n // block_size)) for n in lengths]
    width = max(need)
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    used = 0
    for b, k in enumerate(need):
        table[b, :k] = perm[used: used + k].int()
        used += k
    assert used < num_blocks
    return table


def slots_for(table: torch.Tensor, b: int, toks: torch.Tensor, block_size: int) -> torch.Tensor:
    return table[b].long()[toks // block_size] * block_size + toks % block_size


def assert_close(name, ref, out, atol, rtol=0.0):
    assert not torch.isnan(out).any(), f"{name}: NaN in output (unwritten or bad math)"
    err = (out.float() - ref.float()).abs()
    bound = atol + rtol * ref.float().abs()
    assert bool((err <= bound).all()), f"{name}: max abs err {err.max().item():.3g} (atol {atol})"


@pytest.fixture
def nan_poison(monkeypatch):
    """Make torch.empty / empty_like / new_empty return NaN (floats) or -7777 (ints): unwritten outputs fail."""
    real_empty, real_like, real_new = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype in (torch.int32, torch.int64, torch.int16):
            t.fill_(-7777)
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_like(*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: poison(real_new(self, *a, **k)))
    yield

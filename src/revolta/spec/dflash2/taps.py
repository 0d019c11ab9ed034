"""The drafter's context features from a Qwen3.8-Flash-Next target (spec/engine.md §2.1, draft_config.py).

The tap after target layer i is the wide residual leaving layer i, [T, hc_count * H]; `reduce_tap`
turns it into H features by the config's `tap_reduction`, and `context_features` concatenates the
taps in `target_layer_ids` order, [T, taps * H], the rows `DFlash2DraftModel.extend_context` takes.
`hidden_taps` makes the paged runner return those rows for every step (`ModelRunner.hidden_taps`);
`capture_boundaries` collects the residuals from an ordinary target forward (forward hooks that live
only inside the `with` block).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from ...model import TextModel
from ...engine.runner import HiddenTaps
from .draft_config import DFlash2DraftConfig


def reduce_tap(text: TextModel, layer_id: int, wide: Tensor, reduction: str) -> Tensor:
    """wide: [T, h*H] residual after target layer `layer_id` -> [T, H]."""
    h, d = text.cfg.hc_count, text.cfg.hidden_size
    if reduction == "stream_mean":
        return wide.unflatten(-1, (h, d)).mean(-2)
    if reduction == "stream0":
        return wide[..., :d]
    if reduction == "hc_read":
        nxt = layer_id + 1
        hc = text.layers[nxt].attn_hyper_connection if nxt < len(text.layers) else text.hyper_connection_mixer
        return hc.read(wide)[0]
    raise ValueError(f"tap_reduction={reduction!r} is not one of 'hc_read', 'stream_mean', 'stream0'")


def context_features(text: TextModel, cfg: DFlash2DraftConfig, boundaries: dict[int, Tensor]) -> Tensor:
    """boundaries: {layer id: [T, h*H]} for every tapped layer -> [T, taps * H] in target_layer_ids order."""
    missing = [i for i in cfg.target_layer_ids if i not in boundaries]
    if missing:
        raise ValueError(f"no captured residual after target layers {missing}; capture every id in "
                         f"target_layer_ids={list(cfg.target_layer_ids)}")
    return torch.cat([reduce_tap(text, i, boundaries[i], cfg.tap_reduction) for i in cfg.target_layer_ids], -1)


def hidden_taps(text: TextModel, cfg: DFlash2DraftConfig) -> HiddenTaps:
    """The runner setting that makes a step's hidden rows this drafter's context features [T, taps * H]."""
    return HiddenTaps(tuple(cfg.target_layer_ids), lambda boundaries: context_features(text, cfg, boundaries))


@contextmanager
def capture_boundaries(text: TextModel, layer_ids: tuple[int, ...]) -> Iterator[dict[int, list[Tensor]]]:
    """Inside the block, every forward of `text` appends each listed layer's output [T, h*H] to out[id]."""
    out: dict[int, list[Tensor]] = {i: [] for i in layer_ids}

    def keep(layer, _args, y, i):
        if isinstance(y, tuple):  # (x, inject, block out): the layer left its last HC write to the next read
            x, inject, block_out = y
            y = x if inject is None else layer.mlp_hyper_connection.combine(x, inject, block_out)
        out[i].append(y.detach())

    handles = [text.layers[i].register_forward_hook(lambda m, a, y, i=i: keep(m, a, y, i)) for i in layer_ids]
    try:
        yield out
    finally:
        for handle in handles:
            handle.remove()

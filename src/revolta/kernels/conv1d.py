"""Causal depthwise conv1d with carried state (GDN conv, PLE dilated conv). Torch reference."""

from __future__ import annotations

import torch
from torch import Tensor


def causal_conv1d_ref(x: Tensor, weight: Tensor, state: Tensor | None, dilation: int = 1) -> tuple[Tensor, Tensor]:
    """y_t[c] = Σ_j w[c, j] · x_{t - dilation·(W-1-j)}[c]; the last tap multiplies the current input.

    x: [T, C]; weight: [C, W]; state: [S, C] with S = dilation·(W-1) earlier inputs (oldest first;
    None = zeros, i.e. sequence start). Returns (y [T, C] in fp32, no activation; new state [S, C]
    in x.dtype, the last S inputs including the history).
    """
    T, C = x.shape
    W = weight.shape[-1]
    S = dilation * (W - 1)
    if state is None:
        state = x.new_zeros(S, C)
    xs = torch.cat([state.to(x.dtype), x], dim=0)  # [S + T, C]
    xf, wf = xs.float(), weight.float()
    y = torch.zeros(T, C, dtype=torch.float32, device=x.device)
    for j in range(W):
        start = j * dilation  # tap j reads the input (W-1-j)·dilation steps back
        y += xf[start : start + T] * wf[:, j]
    return y, xs[xs.shape[0] - S :].clone()

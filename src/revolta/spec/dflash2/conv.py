"""DFlash2's grouped dynamic causal convolution around a sublayer (spec/engine.md §2.2, item 1).

Along the block (one request's [anchor, mask x (block - 1)] row), feature c of position i becomes

    out[i, c] = sum_t (base[t, c] + delta[i, t, c // group_size]) * x[i - t, c],   t = 0 .. taps - 1,

with x[i - t] = 0 before the block's first position, so no tap crosses a block boundary. `delta`,
one coefficient per tap and channel group, is a linear function of the sublayer's *input* at i:
`prepare` computes both sides' coefficients from that input and convolves it (pre side); `finish`
convolves the sublayer's output with the post side's coefficients and its own base kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def grouped_dynamic_conv(x: Tensor, delta: Tensor, base: Tensor, group_size: int) -> Tensor:
    """x: [B, S, H] (each row one block); delta: [B, S, taps, H // group_size]; base: [taps, H] -> [B, S, H]."""
    S = x.shape[1]
    groups = x.shape[-1] // group_size
    xg = x.unflatten(-1, (groups, group_size))  # [B, S, G, g]
    out = torch.zeros_like(xg)
    for t in range(base.shape[0]):
        # x[i - t]: shift t rows down, zeros entering at the block start
        shifted = xg if t == 0 else F.pad(xg, (0, 0, 0, 0, t, 0))[:, :S]
        out = out + base[t].view(groups, group_size).to(x.dtype) * shifted
        out = out + delta[:, :, t, :, None] * shifted
    return out.flatten(-2)


class GroupedDynamicCausalConv(nn.Module):
    """`attention_conv` / `mlp_conv`: base_kernel [2 (pre, post), taps, H] and kernel_projection H -> 2*taps*G."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)

    def prepare(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x: [B, S, H] sublayer input -> (pre-convolved x [B, S, H], post coefficients [B, S, taps, G])."""
        groups = x.shape[-1] // self.group_size
        delta = self.kernel_projection(x).unflatten(-1, (2, self.kernel_size, groups))  # [B, S, 2, taps, G]
        return grouped_dynamic_conv(x, delta[:, :, 0], self.base_kernel[0], self.group_size), delta[:, :, 1]

    def finish(self, y: Tensor, post: Tensor) -> Tensor:
        """y: [B, S, H] sublayer output, post: from `prepare` -> [B, S, H]."""
        return grouped_dynamic_conv(y, post, self.base_kernel[1], self.group_size)

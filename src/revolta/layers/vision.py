"""Vision tower: patch embedding, ViT blocks with 2-D axial RoPE, and the 2x2 patch merger (spec/model.md §8.2).

Input is the flat patch stream that `revolta.multimodal.media.preprocess_image` produces: every item (image, or video
clip) contributes t*h*w patches in merge-block order (t, h/m, w/m, m, m), each patch a vector of
C*tp*p*p values ordered (channel, frame, row, col). Output is one `out_hidden_size` vector per group of m*m
neighbouring patches, i.e. one per `<|image_pad|>`/`<|video_pad|>` token, in the same order.

Parameter names equal the checkpoint names under `model.visual.` (spec §9.3), so
`VisionModel(cfg).load_state_dict({k.removeprefix("model.visual."): v ...}, strict=True)` works as is.
There is no deepstack. Attention never crosses a frame: each temporal slice of each item is its own segment.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from revolta.config import VisionConfig

Grid = tuple[int, int, int]  # (t, h, w) in patches, before merging


def as_grid_list(grid_thw: Tensor | Sequence[Sequence[int]]) -> list[Grid]:
    """`grid_thw` ([num_items, 3] tensor or nested sequence) as a list of Python (t, h, w) tuples."""
    rows = grid_thw.tolist() if isinstance(grid_thw, Tensor) else grid_thw
    return [(int(t), int(h), int(w)) for t, h, w in rows]


def merge_block_coords(h: int, w: int, merge: int, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """(row, col) of the h*w patches of one frame, listed in merge-block order (h/m, w/m, m, m).

    Returns two LongTensors [h*w]: patch k of the frame sits at (row[k], col[k]) of the raster grid.
    """
    bh, bw, ih, iw = torch.meshgrid(
        torch.arange(h // merge, device=device),
        torch.arange(w // merge, device=device),
        torch.arange(merge, device=device),
        torch.arange(merge, device=device),
        indexing="ij",
    )
    return (bh * merge + ih).flatten(), (bw * merge + iw).flatten()


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class PatchEmbed(nn.Module):
    """Conv3d with kernel == stride == (tp, p, p) over one patch, i.e. a Linear patch_dim -> hidden.

    The weight keeps the checkpoint's Conv3d shape [hidden, C, tp, p, p]; forward uses it as a matrix.
    """

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, pixel_values: Tensor) -> Tensor:
        """pixel_values [N, patch_dim] -> [N, hidden] in the weight dtype."""
        weight = self.proj.weight.flatten(1)  # [hidden, C*tp*p*p], flattened (channel, frame, row, col)
        return F.linear(pixel_values.to(weight.dtype), weight, self.proj.bias)


class VisionAttention(nn.Module):
    """Non-causal multi-head attention with 2-D RoPE, restricted to one frame of one item at a time."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, segments: list[tuple[int, int, int]]) -> Tensor:
        """x [N, hidden]; cos/sin [N, head_dim] fp32; segments: (start, num_frames, patches_per_frame) per item."""
        n = x.shape[0]
        qkv = self.qkv(x).view(n, 3, self.num_heads, self.head_dim)  # [N, 3, H, D]
        q, k, v = qkv.unbind(1)  # each [N, H, D]
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        out = torch.empty_like(q)  # [N, H, D]
        for start, t, hw in segments:
            end = start + t * hw
            # the t frames of an item are t equal-length contiguous segments: batch them
            qs, ks, vs = (z[start:end].view(t, hw, self.num_heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs)  # [t, H, hw, D]
            out[start:end] = o.transpose(1, 2).reshape(t * hw, self.num_heads, self.head_dim)
        return self.proj(out.view(n, -1))


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE over the whole head, computed in fp32. x [N, H, D]; cos/sin [N, D]."""
    xf = x.float()
    cos, sin = cos[:, None, :], sin[:, None, :]  # [N, 1, D]
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        # "gelu_pytorch_tanh" in the real config (spec §1.4); plain "gelu" means the exact erf form
        self.approximate = "tanh" if "tanh" in cfg.hidden_act else "none"

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    """Pre-norm ViT block: x + Attn(LN1(x)), then x + MLP(LN2(x)). LayerNorms have bias, eps 1e-6."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, segments: list[tuple[int, int, int]]) -> Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LN per patch, then each m*m group of consecutive patches (one merge block) -> one LLM token."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.merged_size = cfg.hidden_size * cfg.spatial_merge_size**2
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_size, self.merged_size, bias=True)
        self.linear_fc2 = nn.Linear(self.merged_size, cfg.out_hidden_size, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        """x [N, hidden] -> [N / m^2, out_hidden_size]."""
        x = self.norm(x).view(-1, self.merged_size)  # [N/m^2, m^2 * hidden]
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))  # exact-erf GELU here, unlike the blocks


class VisionModel(nn.Module):
    """The whole tower. Parameter names match the checkpoint under `model.visual.`.

    forward(pixel_values [N, patch_dim], grid_thw [num_items, 3]) -> [N / m^2, out_hidden_size], where
    N = sum(t*h*w) over items and m = spatial_merge_size. Works in the parameters' dtype; RoPE angles and the
    position-embedding resampling are computed in fp32. `grid_thw` may also be a list of (t, h, w) tuples, which
    spares the device-to-host copy a GPU tensor needs (the per-item loop runs on the host).
    """

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)

    def forward(self, pixel_values: Tensor, grid_thw: Tensor | Sequence[Sequence[int]]) -> Tensor:
        grids = as_grid_list(grid_thw)
        self._check(pixel_values, grids)
        x = self.patch_embed(pixel_values)  # [N, hidden]
        x = x + self.position_embeddings(grids).to(x.dtype)
        cos, sin = self.rope_cos_sin(grids)  # [N, head_dim] fp32 each
        segments, start = [], 0
        for t, h, w in grids:
            segments.append((start, t, h * w))
            start += t * h * w
        for block in self.blocks:
            x = block(x, cos, sin, segments)
        return self.merger(x)  # [N/m^2, out_hidden_size]

    def position_embeddings(self, grids: list[Grid]) -> Tensor:
        """Learned side x side table resampled per item (bilinear, align_corners=True, border clamp) to its
        (h, w) patch grid, listed in merge-block order and repeated for each of the t frames. Returns [N, hidden] fp32.
        """
        side, m = self.cfg.num_grid_per_side, self.cfg.spatial_merge_size
        table = self.pos_embed.weight.float().T.reshape(1, -1, side, side)  # [1, hidden, side, side]
        out = []
        for t, h, w in grids:
            grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]  # [hidden, h, w]
            rows, cols = merge_block_coords(h, w, m, table.device)
            out.append(grid[:, rows, cols].T.repeat(t, 1))  # [t*h*w, hidden]
        return torch.cat(out)

    def rope_cos_sin(self, grids: list[Grid]) -> tuple[Tensor, Tensor]:
        """cos, sin [N, head_dim] fp32: angles [row*inv_freq | col*inv_freq], duplicated for rotate-half."""
        m, half = self.cfg.spatial_merge_size, self.cfg.head_dim // 2
        device = self.pos_embed.weight.device
        # axial RoPE: head_dim/4 frequencies, shared by rows and columns. Built here, not kept as a buffer,
        # so that model.to(bfloat16) cannot round them.
        inv_freq = 1.0 / self.cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=device) / half)
        angles = []
        for t, h, w in grids:
            rows, cols = merge_block_coords(h, w, m, device)
            a = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)  # [h*w, head_dim/2]
            angles.append(a.repeat(t, 1))
        emb = torch.cat(angles).repeat(1, 2)  # [N, head_dim]
        return emb.cos(), emb.sin()

    def _check(self, pixel_values: Tensor, grids: list[Grid]) -> None:
        m = self.cfg.spatial_merge_size
        for t, h, w in grids:
            if t < 1 or h % m or w % m or h < m or w < m:
                raise ValueError(f"grid (t={t}, h={h}, w={w}): t must be >= 1 and h, w positive multiples of "
                                 f"spatial_merge_size={m}")
        num_patches = sum(t * h * w for t, h, w in grids)
        if pixel_values.shape != (num_patches, self.cfg.patch_dim):
            raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)}, but grid_thw {grids} needs "
                             f"[{num_patches}, {self.cfg.patch_dim}]")

"""The DFlash2 drafter as plain nn.Modules (spec/engine.md §2.1-2.3); parameter names are the dflash checkpoint's.

One round for a request whose committed tokens end at position p (the anchor, the last committed
token, sits at p; the target has computed positions 0 .. p - 1):

1. Context. The target's tapped hidden states of the positions the drafter has not consumed yet,
   concatenated per position ([n, taps * H], in `target_layer_ids` order), go through `fc` and
   `hidden_norm`; every layer's k_proj / v_proj (+ k_norm, RoPE at their positions) turn them into
   that layer's context K/V, appended to the request's `DraftKVCache` (the engine's drafter: its slot of a
   preallocated `DraftContextStore`, context_store.py). They stay for later rounds.
2. Block. [anchor, mask x (block_size - 1)] at positions p .. p + block_size - 1, embedded with the
   target's input embeddings (times `input_embedding_scale`), runs through the layers: each attends
   to [context K/V ; the block's own K/V] (causal only on sliding layers by default, sliding layers
   see keys within `sliding_window` positions), with a grouped dynamic causal convolution around its
   attention and its MLP. The block's K/V are not kept.
3. Drafts. The final-normed hidden states of the block_size - 1 mask positions go through the
   target's LM head (the drafter has none), `output_multiplier` and the optional softcap; the
   candidate selector walks them into block_size - 1 draft tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ...config import RopeConfig
from ...layers.moe import SwiGLU
from ...layers.norm import RMSNorm
from ...layers.rope import RotaryEmbedding, apply_rope
from .context_store import DraftContextStore, SlotBatch
from .conv import GroupedDynamicCausalConv
from .draft_config import DFlash2DraftConfig
from .selector import CandidateSelector, Selection


@dataclass
class DraftKVCache:
    """One request's drafter context K/V, dense and unpaged: `keys[l]`, `values[l]` [N, Hkv, D] for layer l
    at positions start .. start + N - 1 (K after k_norm and RoPE). `start` is 0 unless the context began later
    (a request whose earlier target rows were never seen, e.g. after a prefix-cache hit). A paged variant
    sharing the engine's pages can replace it; the model only reads `length`, `end`, `keys`, `values` and
    calls `append`."""

    keys: list[Tensor] = field(default_factory=list)
    values: list[Tensor] = field(default_factory=list)
    start: int = 0

    @property
    def length(self) -> int:
        """Rows held."""
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def end(self) -> int:
        """The position after the last row: where the next context row, or the block's anchor, sits."""
        return self.start + self.length

    def append(self, keys: list[Tensor], values: list[Tensor]) -> None:
        """Add per-layer rows [n, Hkv, D] at positions end .. end + n - 1."""
        if not self.keys:
            self.keys, self.values = list(keys), list(values)
        else:
            self.keys = [torch.cat([a, b]) for a, b in zip(self.keys, keys)]
            self.values = [torch.cat([a, b]) for a, b in zip(self.values, values)]

    def crop(self, end: int) -> None:
        """Keep positions before `end` (e.g. to roll back context that was never committed)."""
        n = max(0, end - self.start)
        self.keys = [k[:n] for k in self.keys]
        self.values = [v[:n] for v in self.values]


def block_visibility(ctx_pos: Tensor, ctx_valid: Tensor, q_start: Tensor, block: int, causal: bool,
                     window: int | None) -> Tensor:
    """Which keys each block query sees: [B, 1, block, N + block] bool, keys being [context ; block].

    ctx_pos / ctx_valid: [B, N] each context key's position and whether it holds a row of the request's context
    (padding, or a row left by an earlier request, does not); q_start: [B] the block's first position (the
    anchor's), where the context ends. Only position differences matter, so any common origin will do.
    """
    dev = q_start.device
    blk_pos = q_start[:, None] + torch.arange(block, device=dev)  # [B, S]
    q_pos = blk_pos[:, :, None]  # [B, S, 1]
    k_pos = torch.cat([ctx_pos, blk_pos], dim=1)[:, None, :]  # [B, 1, N + S]
    visible = torch.cat([ctx_valid, torch.ones_like(blk_pos, dtype=torch.bool)], dim=1)[:, None, :]
    if causal:
        visible = visible & (k_pos <= q_pos)
    if window is not None:
        visible = visible & (q_pos - k_pos < window)
        if not causal:
            visible = visible & (k_pos - q_pos < window)
    return visible.unsqueeze(1)


def _pad_stack(rows: list[Tensor], length: int) -> Tensor:
    """[N_b, ...] tensors -> [B, length, ...], zero-padded after each."""
    return torch.stack([F.pad(r, (0, 0) * (r.dim() - 1) + (0, length - r.shape[0])) for r in rows])

# With a mask, SDPA's default on sm90 is cuDNN, which builds an execution plan for every new shape: ~12 ms of host
# time per call on the H200, and the context grows every round, so every call was a new shape. The memory-efficient
# kernel (what sm70 runs anyway) has no per-shape plan.
CUDA_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class DraftAttention(nn.Module):
    """`self_attn`: Qwen3 GQA attention with q/k RMSNorm; K/V come from the context and the block."""

    def __init__(self, cfg: DFlash2DraftConfig, layer_idx: int):
        super().__init__()
        d, hq, hk, bias = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attention_bias
        self.head_dim = d
        self.causal, self.window = cfg.layer_is_causal(layer_idx), cfg.layer_window(layer_idx)
        self.q_proj = nn.Linear(cfg.hidden_size, hq * d, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, hk * d, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, hk * d, bias=bias)
        self.o_proj = nn.Linear(hq * d, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def key_value(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x: [T, H] -> (K [T, Hkv, D] normed and rotated, V [T, Hkv, D]); cos/sin: [T, D]."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (-1, self.head_dim)))
        return apply_rope(k, cos, sin), self.v_proj(x).unflatten(-1, (-1, self.head_dim))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx_k: Tensor, ctx_v: Tensor, mask: Tensor) -> Tensor:
        """x: [B, S, H] block; cos/sin: [B*S, D] at the block's positions; ctx_k/ctx_v: [B, N, Hkv, D];
        mask: [B, 1, S, N + S] which keys each query sees (`block_visibility`) -> [B, S, H]."""
        B, S, _ = x.shape
        q = self.q_norm(self.q_proj(x).unflatten(-1, (-1, self.head_dim))).flatten(0, 1)  # [B*S, Hq, D]
        q = apply_rope(q, cos, sin).unflatten(0, (B, S))
        k, v = self.key_value(x.flatten(0, 1), cos, sin)
        k = torch.cat([ctx_k, k.unflatten(0, (B, S))], dim=1)  # [B, N + S, Hkv, D]
        v = torch.cat([ctx_v, v.unflatten(0, (B, S))], dim=1)
        groups = q.shape[2] // k.shape[2]  # query head h reads K/V head h // groups
        k, v = (t.repeat_interleave(groups, dim=2).transpose(1, 2) for t in (k, v))
        with sdpa_kernel(CUDA_SDPA_BACKENDS) if q.is_cuda else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class DraftLayer(nn.Module):
    """conv(attention) and conv(MLP) sublayers, each pre-normed and added to the residual."""

    def __init__(self, cfg: DFlash2DraftConfig, layer_idx: int):
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = DraftAttention(cfg, layer_idx)
        self.mlp = SwiGLU(h, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.attention_conv = GroupedDynamicCausalConv(h, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = GroupedDynamicCausalConv(h, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx_k: Tensor, ctx_v: Tensor, mask: Tensor) -> Tensor:
        """x: [B, S, H] -> [B, S, H] (see DraftAttention.forward for the rest)."""
        u, post = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(u, cos, sin, ctx_k, ctx_v, mask), post)
        u, post = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(u), post)


class DFlash2DraftModel(nn.Module):
    """The whole drafter checkpoint: fc, hidden_norm, layers, norm, candidate_selector (no embeddings, no head)."""

    def __init__(self, cfg: DFlash2DraftConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_taps * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.candidate_selector = CandidateSelector(cfg.vocab_size, h, cfg.selector_rank, cfg.selector_top_k)
        # plain 1-D RoPE over the whole head: every frequency reads position row 0
        rope = RopeConfig(rope_theta=cfg.rope_theta, partial_rotary_factor=1.0,
                          mrope_section=(cfg.head_dim // 2, 0, 0), mrope_interleaved=False)
        self.rotary = RotaryEmbedding(rope, cfg.head_dim)

    @property
    def num_kv_heads(self) -> int:
        """KV heads the layers hold: the config's, or a tensor-parallel rank's share (rank_drafter.py keeps the
        full config on a rank's model)."""
        return self.layers[0].self_attn.k_proj.out_features // self.cfg.head_dim

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions: [T] long -> cos, sin [T, head_dim] fp32."""
        return self.rotary(positions.unsqueeze(0).expand(3, -1))

    # ---- context ----------------------------------------------------------------------------
    def _check_rows(self, tapped: Tensor) -> None:
        if tapped.shape[-1] != self.fc.in_features:
            raise ValueError(f"context rows have {tapped.shape[-1]} features; the drafter taps {self.cfg.num_taps} "
                             f"target layers of {self.cfg.hidden_size} ({self.fc.in_features} features)")

    def context_kv(self, tapped: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """tapped: [n, taps * H] target states at positions [n] -> per layer (K, V) [n, Hkv, D]."""
        ctx = self.hidden_norm(self.fc(tapped.to(self.fc.weight.dtype)))  # [n, H]
        cos, sin = self._rope(positions)
        return [layer.self_attn.key_value(ctx, cos, sin) for layer in self.layers]

    def extend_context(self, cache: DraftKVCache, tapped: Tensor) -> None:
        """Append K/V for tapped target states [n, taps * H] at positions cache.end .. + n - 1."""
        self._check_rows(tapped)
        if tapped.shape[0] == 0:
            return
        kv = self.context_kv(tapped, torch.arange(cache.end, cache.end + tapped.shape[0], device=tapped.device))
        cache.append([k for k, _ in kv], [v for _, v in kv])

    def extend_slots(self, store: DraftContextStore, rows: list[tuple[int, Tensor]]) -> None:
        """Append each (slot, tapped [n, taps * H]) at its slot's end, all requests through one fc and one write
        per layer; rows no layer keeps (a long prompt's beyond every sliding window) skip the drafter."""
        rows = [(slot, r) for slot, r in rows if r.shape[0]]
        if not rows:
            return
        for _, r in rows:
            self._check_rows(r)
        plan = store.plan_append([(slot, r.shape[0]) for slot, r in rows])
        tapped = torch.cat([r[r.shape[0] - f:] for (_, r), f in zip(rows, plan.fed)])  # [R, taps * H]
        for l, (k, v) in enumerate(self.context_kv(tapped, plan.positions)):
            store.write(l, k, v, plan)
        store.commit(plan)

    # ---- block -----------------------------------------------------------------------------
    def _run_block(self, block_embeds: Tensor, q_start: Tensor, context: Callable[[int], tuple[Tensor, Tensor]],
                   where: Callable[[int], tuple[Tensor, Tensor]], shapes: list[tuple]) -> Tensor:
        """The block through every layer. q_start: [B] the block's first position; context(l) -> layer l's context
        (K, V) [B, N_l, Hkv, D]; where(l) -> their (positions, valid) [B, N_l]; shapes[l]: what fixes the layer's
        context rows (layers with equal shapes and attention share one mask) -> final-normed [B, S, H]."""
        S = block_embeds.shape[1]
        cos, sin = self._rope((q_start[:, None] + torch.arange(S, device=q_start.device)).flatten())
        x = block_embeds.to(self.fc.weight.dtype)
        masks: dict[tuple, Tensor] = {}
        for l, layer in enumerate(self.layers):
            attn = layer.self_attn
            key = (shapes[l], attn.causal, attn.window)
            if key not in masks:
                masks[key] = block_visibility(*where(l), q_start, S, attn.causal, attn.window)
            x = layer(x, cos, sin, *context(l), masks[key])
        return self.norm(x)

    def block_hidden(self, block_embeds: Tensor, caches: list[DraftKVCache]) -> Tensor:
        """block_embeds: [B, S, H] for blocks starting right after each cache's context -> final-normed [B, S, H]."""
        B = block_embeds.shape[0]
        if len(caches) != B:
            raise ValueError(f"{B} blocks but {len(caches)} context caches")
        if any(c.length == 0 for c in caches):
            raise ValueError("a request has no drafter context yet: call extend_context with its tapped target "
                             "states (the prompt's, at least) before drafting")
        dev = block_embeds.device
        lens = torch.tensor([c.length for c in caches], device=dev)
        ends = torch.tensor([c.end for c in caches], device=dev)
        n = max(c.length for c in caches)
        rows = torch.arange(n, device=dev)
        pos = (ends - lens)[:, None] + rows  # [B, n]: row i of a context sits at its start + i
        valid = rows < lens[:, None]  # padding rows are never visible

        def context(l: int) -> tuple[Tensor, Tensor]:
            return _pad_stack([c.keys[l] for c in caches], n), _pad_stack([c.values[l] for c in caches], n)

        return self._run_block(block_embeds, ends, context, lambda l: (pos, valid), [n] * len(self.layers))

    def block_hidden_slots(self, block_embeds: Tensor, store: DraftContextStore, slots: list[int]) -> Tensor:
        """block_hidden for blocks starting at the ends of the store's `slots` (one per block row)."""
        if len(slots) != block_embeds.shape[0]:
            raise ValueError(f"{block_embeds.shape[0]} blocks but {len(slots)} context slots")
        store.check_drafting(slots)
        return self.block_hidden_batch(block_embeds, store, store.batch(slots))

    def block_hidden_batch(self, block_embeds: Tensor, store: DraftContextStore, batch: SlotBatch) -> Tensor:
        """block_hidden for blocks starting at the ends of `batch`'s slots (store.batch or store.ring_batch)."""
        shapes = [(c, v) for c, v in zip(store.capacities, batch.views)]
        return self._run_block(block_embeds, batch.ends, lambda l: store.read(l, batch),
                               lambda l: store.positions(l, batch), shapes)

    def compute_logits(self, hidden: Tensor, lm_head: Callable[[Tensor], Tensor]) -> Tensor:
        """hidden: [..., H] -> the target head's logits [..., V] times output_multiplier, then the softcap."""
        logits = lm_head(hidden.flatten(0, -2)).unflatten(0, hidden.shape[:-1])
        logits = logits * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def block_ids(self, anchor_ids: Tensor) -> Tensor:
        """anchor_ids: [B] -> [B, block_size]: [anchor, mask x (block_size - 1)]."""
        ids = torch.full((anchor_ids.shape[0], self.cfg.block_size), self.cfg.mask_token_id,
                         dtype=torch.long, device=anchor_ids.device)
        ids[:, 0] = anchor_ids
        return ids

    # ---- the engine's call -----------------------------------------------------------------
    def block_embeds(self, anchor_ids: Tensor, embed: Callable[[Tensor], Tensor]) -> Tensor:
        """anchor_ids: [B] -> the blocks' input [B, block_size, H] (target embeddings times input_embedding_scale)."""
        return embed(self.block_ids(anchor_ids)) * self.cfg.input_embedding_scale

    def select(self, hidden: Tensor, anchor_ids: Tensor, lm_head: Callable[[Tensor], Tensor],
               temperature: float = 0.0, generator: torch.Generator | None = None) -> Selection:
        """hidden: [B, block_size, H] from block_hidden -> the selector's walk over its mask positions."""
        hidden = hidden[:, 1:]  # the mask positions: hidden at block index i predicts the token there
        logits = self.compute_logits(hidden, lm_head)
        return self.candidate_selector(hidden, logits, anchor_ids, temperature, generator)

    @torch.no_grad()
    def forward(self, context: list[Tensor], caches: list[DraftKVCache], anchor_ids: Tensor,
                embed: Callable[[Tensor], Tensor], lm_head: Callable[[Tensor], Tensor],
                temperature: float = 0.0, generator: torch.Generator | None = None) -> Selection:
        """Draft one block per request.

        context: per request, tapped target states [n_b, taps * H] of the positions its cache lacks (n_b may be 0);
        caches: per request, its DraftKVCache (extended in place); anchor_ids: [B] each request's last committed
        token, at position cache.end after the extension; embed: the target's token embedding (ids -> [.., H]);
        lm_head: the target's head ([N, H] -> [N, V]). Returns Selection: tokens [B, block_size - 1], the
        candidates and, for temperature > 0, the selector's q. The engine's drafter runs the same steps on a
        DraftContextStore (extend_slots, block_hidden_slots, select).
        """
        for cache, rows in zip(caches, context, strict=True):
            self.extend_context(cache, rows)
        hidden = self.block_hidden(self.block_embeds(anchor_ids, embed), caches)
        return self.select(hidden, anchor_ids, lm_head, temperature, generator)

"""Which part of each checkpoint tensor a rank holds, and building a rank's model (docs/parallel.md).

A rank's model is the single-process FlashNextModel built from the *local* text config (head counts and
expert widths divided by tp), with the layers that communicate swapped for their parallel subclasses
(parallel/layers.py). Parameter names stay the checkpoint's names; only shapes shrink.

`tensor_slices(name, ...)` says which pieces of the full tensor `name` make this rank's tensor: a dim and
a list of [start, end) ranges along it, concatenated in order (a fused q ‖ k ‖ v projection takes one
range from each part). None: the tensor is replicated. The same answer drives slicing an in-memory state
dict (`shard_state_dict`) and reading only those ranges of a memory-mapped checkpoint (parallel/load.py).
A packed checkpoint's tensors follow their 16-bit weight's split in their stored layout (`rank_slices`,
parallel/packed.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch
from torch import Tensor

from ..config import ModelConfig, TextConfig
from ..layers.linear import QuantLinear
from ..layers.quantize import quantize_modules
from ..model import DecoderLayer, FlashNextModel
from .config import ParallelConfig, ParallelConfigError, validate_parallel
from .context import ParallelContext, subgroup_context
from .dcp import DCPAttention
from .layers import (ParallelMoE, RowParallelLinear, RowParallelQuantLinear, VocabParallelEmbedding,
                     VocabParallelLMHead)
from .packed import PackedTensor, packed_slices
from .slices import Slices, local_text_config, tensor_slices  # noqa: F401  (Slices, tensor_slices: re-exported)


def _parallel_layers(layer: DecoderLayer, t: TextConfig, ctx: ParallelContext) -> None:
    """Swap a layer's communicating modules (built from the local config) for their parallel subclasses."""
    d = t.hidden_size
    if layer.is_gdn:
        layer.linear_attn.out_proj = RowParallelLinear(t.gdn_value_dim, d, ctx)
    else:
        layer.self_attn.o_proj = RowParallelLinear(t.num_attention_heads * t.head_dim, d, ctx)
    layer.mlp = ParallelMoE(d, t.num_experts, t.num_experts_per_tok, t.moe_intermediate_size,
                            t.shared_expert_intermediate_size, t.norm_topk_prob, ctx=ctx)


def _pack(model: FlashNextModel, cfg: ModelConfig, ctx: ParallelContext) -> None:
    """Pack the rank model's linears and experts as the checkpoint stores them (quantize_modules, on the local
    sizes), then give the row-parallel linears their all-reduce back."""
    row = [n for n, m in model.named_modules() if isinstance(m, RowParallelLinear)]
    quantize_modules(model, cfg.quantization)
    for name in row:
        q = model.get_submodule(name)
        if isinstance(q, QuantLinear):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child,
                    RowParallelQuantLinear(q.in_features, q.out_features, q.bias is not None, q.fmt, ctx))


def build_rank_model(cfg: ModelConfig, pc: ParallelConfig, ctx: ParallelContext, with_mtp: bool = True,
                     with_vision: bool = True, dcp_ctx: ParallelContext | None = None) -> FlashNextModel:
    """This rank's FlashNextModel on the meta device (materialise with `to_empty`, then load its slices).

    At dcp > 1 the trunk QSA layers are DCPAttention over this rank's DCP group (`dcp_ctx`; None: created here from
    `ctx`, which every rank must then do at the same point). The vision tower is replicated. A packed (quantized)
    checkpoint's linears and expert banks are packed here too, each holding the rank's whole groups (parallel/packed.py).
    """
    validate_parallel(pc, cfg)
    if ctx.size != pc.tp:
        raise ParallelConfigError(f"the process group has {ctx.size} ranks but tensor_parallel_size={pc.tp}; start "
                                  f"one process per rank")
    t = local_text_config(cfg.text, pc.tp)
    if pc.dcp > 1 and dcp_ctx is None:
        dcp_ctx = subgroup_context(ctx, pc.dcp)  # outside the meta-device block: the group's rendezvous is real
    with torch.device("meta"):
        model = FlashNextModel(replace(cfg, text=t), with_mtp=with_mtp, with_vision=with_vision)
        if pc.tp == 1:
            return model
        lm = model.model.language_model
        lm.embed_tokens = VocabParallelEmbedding(t.vocab_size, t.hidden_size, ctx)
        model.lm_head = VocabParallelLMHead(t.hidden_size, t.vocab_size, ctx)
        if t.tie_word_embeddings:
            model.lm_head.weight = lm.embed_tokens.weight  # the same vocabulary rows on both
        for layer in lm.layers:
            if pc.dcp > 1 and not layer.is_gdn:  # the MTP layer's K/V stays replicated
                layer.self_attn = DCPAttention(t, layer.self_attn.state_key, layer.self_attn.cache_key, dcp_ctx)
            _parallel_layers(layer, t, ctx)
        if model.mtp is not None:  # the MTP layer is split like a decoder layer
            for layer in model.mtp.layers:
                _parallel_layers(layer, t, ctx)
        if cfg.quantization is not None and cfg.quantization.packed:
            _pack(model, cfg, ctx)
    model.cfg = cfg  # the full geometry: callers size caches and check ids against it
    return model


def rank_slices(name: str, t: TextConfig, rank: int, tp: int,
                packed: Mapping[str, PackedTensor] | None = None) -> Slices | None:
    """`tensor_slices`, or for a packed tensor of a quantized checkpoint (`packed`: parallel/packed.py
    `packed_tensors` of the full model) its Slices in the stored layout."""
    if packed and name in packed:
        return packed_slices(name, packed[name], t, rank, tp) if tp > 1 else None
    return tensor_slices(name, t, rank, tp)


def shard_state_dict(full: Mapping[str, Tensor], cfg: ModelConfig, rank: int, tp: int,
                     packed: Mapping[str, PackedTensor] | None = None) -> dict[str, Tensor]:
    """Rank `rank`'s tensors cut from a full (single-process) state dict (`packed`: see `rank_slices`)."""
    out = {}
    for name, x in full.items():
        sl = rank_slices(name, cfg.text, rank, tp, packed)
        out[name] = x if sl is None else sl.take(x)
    return out

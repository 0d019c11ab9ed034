"""Qwen3.8-Flash-Next as plain nn.Modules (spec/model.md §2): text trunk, MTP head, vision hookup.

Parameter names equal the official checkpoint names (`model.language_model.*`,
`model.visual.*`, `lm_head.weight`, `mtp.*`), so loading is a name-for-name copy
(see `revolta.weights` for the few on-disk differences).

Two ways to call it:
- full forward: `model(input_ids [B, S])` -> logits [B, S, V], no state kept;
- incremental: `model(input_ids [T], cu_seqlens=[0, ...], states=[SequenceState, ...])` over a
  flat varlen batch; each state carries its sequence's GDN/QSA/PLE state between calls.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from .config import GDN, ModelConfig, TextConfig
from .device import resolve_device
from .forward import ForwardMeta, PagedMeta
from .layers.allowed_vocab import AllowedVocabHead
from .layers.gdn import GatedDeltaNet
from .layers.hyperconnection import HyperConnection
from .layers.moe import MoE
from .layers.ngram import PLELayer
from .layers.norm import ZCRMSNorm
from .layers.qsa import QSAttention
from .layers.rope import RotaryEmbedding
from .state import SequenceState

# Parameters kept in fp32 whatever the model dtype (spec §2.6: GDN decay inputs).
FP32_PARAMS = ("A_log", "dt_bias")


class DecoderLayer(nn.Module):
    """One layer of spec §2.4: [PLE] -> HC read -> GDN|QSA -> HC combine -> HC read -> MoE -> HC combine."""

    def __init__(self, cfg: TextConfig, layer_idx: int, layer_type: str, state_prefix: str = "",
                 allow_ple: bool = True):
        super().__init__()
        self.is_gdn = layer_type == GDN
        if self.is_gdn:
            self.linear_attn = GatedDeltaNet(cfg, layer_idx)
        else:
            self.self_attn = QSAttention(cfg, state_key=f"{state_prefix}qsa{layer_idx}",
                                         cache_key="mtp" if state_prefix == "mtp" else layer_idx)
        self.mlp = MoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                       cfg.shared_expert_intermediate_size, cfg.norm_topk_prob)
        hc = dict(hidden_size=cfg.hidden_size, hc_count=cfg.hc_count, lowrank=cfg.hc_lowrank, eps=cfg.rms_norm_eps)
        self.attn_hyper_connection = HyperConnection(**hc)
        self.mlp_hyper_connection = HyperConnection(**hc)
        ple_ids = cfg.ple_layer_indices if allow_ple else ()
        self.ple = PLELayer(cfg, layer_idx, ple_ids.index(layer_idx)) if layer_idx in ple_ids else None

    def forward(self, x: Tensor, meta: ForwardMeta, inject: Tensor | None = None, out: Tensor | None = None,
                defer_write: bool = False):
        """x: [T, h*d] wide residual -> [T, h*d].

        inject [T, h], out [T, d]: the previous layer's last HC write of `out` into x is still to do; it rides
        in this layer's first HC read (`combine_read`: inside the read's first pass on the Triton path, one
        launch fewer, bitwise equal). defer_write: leave this layer's own last write the same way and
        return (x, inject, out) instead.
        """
        ops = meta.paged.ops if meta.paged is not None else None
        if self.ple is not None:
            if inject is not None:  # the PLE layer reads the residual itself: the write comes first
                x, inject = self.mlp_hyper_connection.combine(x, inject, out, ops), None
            x = x + self.ple(x, meta)
        x, u, inject = self.attn_hyper_connection.combine_read(x, inject, out, ops)
        u = self.linear_attn(u, meta) if self.is_gdn else self.self_attn(u, meta)
        x, u, inject = self.mlp_hyper_connection.combine_read(x, inject, u, ops)
        out = self.mlp(u, ops)
        if defer_write:
            return x, inject, out
        return self.mlp_hyper_connection.combine(x, inject, out, ops)


def _ops(meta: ForwardMeta):
    """The step's kernel table (None: the simple torch path)."""
    return meta.paged.ops if meta.paged is not None else None


class TextModel(nn.Module):
    """`model.language_model`: embeddings, decoder stack, final HC mixer."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, t) for i, t in enumerate(cfg.layer_types))
        self.hyper_connection_mixer = HyperConnection(cfg.hidden_size, cfg.hc_count, cfg.hc_lowrank,
                                                      cfg.rms_norm_eps, with_inject=False)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.rotary_dim)

    def forward(self, embeds: Tensor, meta: ForwardMeta, defer_write: bool = False):
        """embeds: [T, d] -> wide pre-mixer state X^(L) [T, h*d]; defer_write: (X^(L) before the last layer's
        HC write, its inject gates, its block output), the write left to the mixer's read (`combine_read`)."""
        x = embeds.repeat(1, self.cfg.hc_count)  # h identical copies, branch-major
        for layer in self.layers:  # n-gram rows need only the ids: start their lookups before the trunk
            if layer.ple is not None:
                layer.ple.prefetch(meta, embeds.dtype)
        inject = out = None
        for i, layer in enumerate(self.layers):
            # each layer's last write rides in the next layer's first read
            x, inject, out = layer(x, meta, inject, out, defer_write=True)
            if meta.taps is not None and i in meta.taps:
                x, inject = layer.mlp_hyper_connection.combine(x, inject, out, _ops(meta)), None
                meta.taps[i] = x
        if defer_write:
            return x, inject, out
        return x if inject is None else self.hyper_connection_mixer.combine(x, inject, out, _ops(meta))


class MTPHead(nn.Module):
    """`mtp.*`: one draft step from a wide hidden and a token (spec §7.2), sharing embed and lm_head."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        d, wide = cfg.hidden_size, cfg.wide_size
        self.hc_count = cfg.hc_count
        self.pre_fc_norm_embedding = ZCRMSNorm(d, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = ZCRMSNorm(wide, cfg.rms_norm_eps)  # ONE group over all h*d features
        self.fc_embedding = nn.Linear(d, d, bias=False)
        self.fc_hidden = nn.Linear(d, d, bias=False)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, t, state_prefix="mtp", allow_ple=False) for i, t in enumerate(cfg.mtp.layer_types))
        self.hyper_connection_mixer = HyperConnection(d, cfg.hc_count, cfg.hc_lowrank, cfg.rms_norm_eps,
                                                      with_inject=False)

    def forward(self, hidden: Tensor, token_embeds: Tensor, meta: ForwardMeta, step: int = 0) -> tuple[Tensor, Tensor]:
        """hidden: [T, h*d] wide state; token_embeds: [T, d] -> (mixed output [T, d], wide M [T, h*d])."""
        e = self.fc_embedding(self.pre_fc_norm_embedding(token_embeds))  # [T, d]
        hn = self.pre_fc_norm_hidden(hidden).unflatten(-1, (self.hc_count, -1))  # [T, h, d]
        x = (self.fc_hidden(hn) + e.unsqueeze(-2)).flatten(-2)  # same matrix per branch, ê on every branch
        x, inject, out = self.layers[step % len(self.layers)](x, meta, defer_write=True)
        x, y, _ = self.hyper_connection_mixer.combine_read(x, inject, out, _ops(meta))  # the layer's last write too
        return y, x


class _Backbone(nn.Module):
    """Holds `language_model` and `visual` so parameter names match the checkpoint's `model.*`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.language_model = TextModel(cfg.text)
        if cfg.vision is not None:
            from .layers.vision import VisionModel

            self.visual = VisionModel(cfg.vision)
        else:
            self.visual = None


class FlashNextModel(nn.Module):
    """The whole checkpoint: text trunk, optional vision tower, lm_head and optional MTP head."""

    def __init__(self, cfg: ModelConfig, with_mtp: bool = True, with_vision: bool = True):
        super().__init__()
        if not with_vision and cfg.vision is not None:
            cfg = ModelConfig(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}, "vision": None})
        self.cfg = cfg
        t = cfg.text
        self.model = _Backbone(cfg)
        self.lm_head = nn.Linear(t.hidden_size, t.vocab_size, bias=False)
        if t.tie_word_embeddings:
            self.lm_head.weight = self.model.language_model.embed_tokens.weight
        self.mtp = MTPHead(t) if (with_mtp and t.mtp is not None) else None
        self.kv_scales: dict[str, Tensor] = {}  # `*.self_attn.{k,v}_scale` of the checkpoint (see load_model)
        self.checkpoint_dir: Path | None = None  # where load_model read it (tokenizer, configs); None: built in code
        # [V] bool, True where a token may be predicted (the checkpoint's vocab_mask.json, see load_model); None: all.
        # Every logit path (next token, MTP and DFlash2 drafts) goes through compute_logits, so drafts and the
        # verified tokens see the same mask and greedy speculation stays equal to greedy without.
        self.register_buffer("logit_mask", None, persistent=False)
        self._allowed_head = AllowedVocabHead()  # the masked head's allowed rows, gathered once (compute_logits)

    def init_buffers(self) -> "FlashNextModel":
        """Recompute derived buffers (RoPE tables, n-gram hash constants) after `to_empty`."""
        for m in self.modules():
            if m is not self and hasattr(m, "init_buffers"):
                m.init_buffers()
        return self

    def merge_projections(self) -> "FlashNextModel":
        """Each GDN and QSA layer's input projections, and each MoE block's router and shared-expert gate (one input
        each), as one GEMM: a launch and its latency saved per merged projection at decode (layers/merged_linear.py).
        The parameters become views of the merged weights:
        names, state_dict and in-place loads (reload, sleep, TP shards) are unchanged. Call once the weights are
        where they will run (after load, dtype and device changes: a rebound parameter falls back to its own GEMM
        until called again); the loaders and ModelRunner do. Idempotent."""
        for m in self.modules():
            if m is not self and callable(getattr(m, "merge_projections", None)):
                m.merge_projections()
        return self

    # ---- dtype handling --------------------------------------------------------------------
    def to_dtype(self, dtype: torch.dtype) -> "FlashNextModel":
        """Cast floating parameters to `dtype`, keeping GDN A_log/dt_bias in fp32 (spec §2.6)."""
        for name, p in self.named_parameters():
            if p.is_floating_point():
                p.data = p.data.to(torch.float32 if name.endswith(FP32_PARAMS) else dtype)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    # ---- forward ---------------------------------------------------------------------------
    def make_meta(self, input_ids: Tensor, cu_seqlens: list[int], states: list[SequenceState],
                  positions: Tensor | None = None) -> ForwardMeta:
        """Per-step metadata for a flat batch. Default positions: index + rope_delta on all 3 rows."""
        if positions is None:
            positions = torch.cat([
                torch.arange(st.num_tokens, st.num_tokens + (cu_seqlens[b + 1] - cu_seqlens[b])) + st.rope_delta
                for b, st in enumerate(states)
            ]).to(input_ids.device).unsqueeze(0).expand(3, -1)
        cos, sin = self.model.language_model.rotary(positions)
        return ForwardMeta(cu_seqlens=list(cu_seqlens), states=states, input_ids=input_ids,
                           positions=positions, cos=cos, sin=sin)

    def embed(self, input_ids: Tensor, mm_embeds: Tensor | None = None, mm_index: Tensor | None = None) -> Tensor:
        """Token embeddings [T, d]; rows `mm_index` [N_mm] (default: every media pad, in order) take
        `mm_embeds` [N_mm, d]."""
        e = self.model.language_model.embed_tokens(input_ids)
        if mm_embeds is not None and mm_index is not None:
            if mm_index.shape[0] != mm_embeds.shape[0]:
                raise ValueError(f"{mm_index.shape[0]} media indices but {mm_embeds.shape[0]} media embeddings")
            e = e.index_copy(0, mm_index, mm_embeds.to(e.dtype))
        elif mm_embeds is not None:
            is_media = (input_ids == self.cfg.image_token_id) | (input_ids == self.cfg.video_token_id)
            if int(is_media.sum()) != mm_embeds.shape[0]:
                raise ValueError(f"{int(is_media.sum())} media pad tokens in the prompt but {mm_embeds.shape[0]} "
                                 "media embeddings; expand each item's placeholder to its token count")
            e = e.masked_scatter(is_media[:, None], mm_embeds.to(e.dtype))
        return e

    def forward(self, input_ids: Tensor, positions: Tensor | None = None, *, cu_seqlens: list[int] | None = None,
                states: list[SequenceState] | None = None, mm_embeds: Tensor | None = None,
                mm_index: Tensor | None = None, logits_indices: Tensor | None = None, return_hidden: bool = False,
                paged: PagedMeta | None = None, taps: dict[int, Tensor | None] | None = None):
        """Logits for a batch of token ids.

        input_ids: [B, S] (each row one fresh sequence; returns logits [B, S, V]) or a flat [T]
        with `cu_seqlens` [B+1] and `states` (B SequenceStates, updated in place; returns [T, V]).
        positions: [3, T] (or [3, B, S]) mRoPE positions; default index + rope_delta.
        mm_embeds: [N_mm, d] vision rows for the media pad tokens (in order), or for rows `mm_index` [N_mm].
        logits_indices: [N] rows of the flat batch to project (e.g. the last token of each sequence).
        return_hidden: also return the wide pre-mixer state [T, h*d] (the MTP input).
        paged: run on the paged hybrid cache instead of `states` (see runner.ModelRunner).
        taps: {layer id: None, ...}; each value is replaced by the wide residual [T, h*d] leaving that layer.
        Logits are fp32.
        """
        batched = input_ids.dim() == 2
        if batched:
            B, S = input_ids.shape
            input_ids = input_ids.reshape(-1)
            cu_seqlens = [b * S for b in range(B + 1)]
            states = [SequenceState() for _ in range(B)] if states is None else states
            if positions is not None and positions.dim() == 3:
                positions = positions.reshape(3, -1)
        elif states is None:
            states = [SequenceState()]
            cu_seqlens = [0, input_ids.shape[0]]
        if cu_seqlens is None or len(cu_seqlens) != len(states) + 1 or cu_seqlens[-1] != input_ids.shape[0]:
            raise ValueError(f"cu_seqlens={cu_seqlens} must have len(states)+1={len(states) + 1} entries ending at "
                             f"T={input_ids.shape[0]}")
        meta = self.make_meta(input_ids, cu_seqlens, states, positions)
        meta.paged, meta.taps = paged, taps
        text = self.model.language_model
        # the final mixer on the step's kernels (paged: the HC read kernels, 3 launches instead of ~20 torch ops),
        # with the last layer's write inside its first pass when it reads every row
        pending = text(self.embed(input_ids, mm_embeds, mm_index), meta, defer_write=True)
        for b, st in enumerate(states):
            st.num_tokens += cu_seqlens[b + 1] - cu_seqlens[b]
        ops = paged.ops if paged is not None else None
        if logits_indices is None:
            wide, y, _ = text.hyper_connection_mixer.combine_read(*pending, ops)
        else:
            wide = pending[0] if pending[1] is None else text.hyper_connection_mixer.combine(*pending, ops)
            y = text.hyper_connection_mixer.read(wide[logits_indices], ops)[0]
        logits = self.compute_logits(y)
        if batched and logits_indices is None:
            logits = logits.view(B, S, -1)
        return (logits, wide) if return_hidden else logits

    def prepare_logits(self) -> bool:
        """Gather the LM head's allowed rows now (a device sync) if `logit_mask` allows few enough ids for
        compute_logits to project onto them only (layers/allowed_vocab.py); ModelRunner calls it before
        capturing graphs. True when that path is on. The full-vocabulary head of a tensor-parallel rank keeps
        the mask instead."""
        return (self.logit_mask is not None and type(self.lm_head) is nn.Linear
                and self._allowed_head.prepare(self.lm_head.weight, self.logit_mask))

    def compute_logits(self, y: Tensor) -> Tensor:
        """y: [N, d] mixed hidden -> [N, V] fp32 (-inf where `logit_mask` forbids a token)."""
        if self.prepare_logits():
            return self._allowed_head.logits(y, self.cfg.text.vocab_size)
        logits = self.lm_head(y).float()
        if self.logit_mask is not None:
            logits = logits.masked_fill(~self.logit_mask, float("-inf"))
        return logits

    def mtp_forward(self, hidden: Tensor, token_ids: Tensor, positions: Tensor, cu_seqlens: list[int],
                    states: list[SequenceState], step: int = 0, paged: PagedMeta | None = None,
                    logits_indices: Tensor | None = None, mm_embeds: Tensor | None = None,
                    mm_index: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """One MTP draft step (spec §7.2-7.3) over a flat batch.

        hidden: [T, h*d] wide state at positions p; token_ids: [T] the token after each hidden;
        positions: [3, T] = p (position of the hidden). MTP's own QSA cache lives in `states`, or
        in the paged cache (`paged`, the MTP layer's K/V pages). logits_indices: [N] rows to project.
        mm_embeds: [N_mm, d] the vision rows the target embedded for the media pads token_ids[mm_index]
        ([N_mm]); they take the token embedding's place before pre_fc_norm_embedding, as vLLM feeds its
        drafter the target's input embeddings.
        Returns (logits [T or N, V] fp32, wide output M [T, h*d] for the next step).
        """
        if self.mtp is None:
            raise ValueError("this model has no MTP head (its config has no MTP layer, its checkpoint no mtp.* "
                             "weights, or it was loaded with with_mtp=False)")
        meta = self.make_meta(token_ids, cu_seqlens, states, positions)
        meta.paged = paged
        if (mm_embeds is None) != (mm_index is None):  # embed() would scatter into every pad id instead
            raise ValueError("mtp_forward needs mm_embeds and mm_index together (the vision rows and their rows)")
        y, m = self.mtp(hidden, self.embed(token_ids, mm_embeds, mm_index), meta, step)
        return self.compute_logits(y if logits_indices is None else y[logits_indices]), m


def init_random_weights(model: nn.Module, seed: int = 0, std: float = 0.02, device: str | None = None) -> None:
    """Deterministic random init of every parameter, zero-initialised norms included.

    Same seed and config give bitwise-identical weights on any machine (a CPU generator, names
    visited in sorted order). Norm gains get visible spread so no path is trivially zero.
    device: draw on this device instead (e.g. "cuda" for full-width benchmark weights, where a CPU
    generator would take minutes); reproducible on that device, not equal to the CPU values.
    """
    gen = torch.Generator(device=device or "cpu").manual_seed(seed)
    dev = gen.device
    params = dict(model.named_parameters())
    for name in sorted(params):
        p = params[name]
        shape = p.shape
        if name.endswith("A_log"):
            val = torch.empty(shape, device=dev).uniform_(0.0, 2.7, generator=gen)  # decay rates exp(A) in [1, 15]
        elif name.endswith("dt_bias"):
            val = torch.empty(shape, device=dev).uniform_(-4.0, 0.0, generator=gen)
        elif name.endswith("linear_attn.norm.weight"):
            val = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=dev)
        elif "norm" in name and p.dim() == 1:
            val = 0.2 * torch.randn(shape, generator=gen, device=dev)  # (1 + w) norms, zero-initialised in the references
        elif name.endswith("bias"):
            val = 0.02 * torch.randn(shape, generator=gen, device=dev)
        elif "conv1d" in name:
            val = 0.3 * torch.randn(shape, generator=gen, device=dev)
        elif "embed_tokens" in name or "ngram_embedding" in name or "pos_embed" in name:
            val = torch.randn(shape, generator=gen, device=dev)
        else:
            fan_in = shape[-1] if p.dim() > 1 else 1
            val = torch.randn(shape, generator=gen, device=dev) * min(std * 4, fan_in**-0.5)
        with torch.no_grad():
            p.copy_(val.to(p.dtype))


def load_model(path: str | Path, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
               with_mtp: bool | None = None, with_vision: bool = True, progress: bool = True,
               ple_placement: str = "device") -> FlashNextModel:
    """Build the model for the checkpoint at `path` and load its weights (memory-mapped, no 2x RAM).

    Returns an eval-mode FlashNextModel in `dtype` on `device`; call it on token ids [B, S] for logits.
    with_mtp: build and load the MTP head (speculative decoding's drafter). None (default): exactly when the
        checkpoint ships its `mtp.*` tensors (transformers' `save_pretrained` and NeMo fine-tunes write none, though
        their config may declare the layer); True: require them (a CheckpointError naming them otherwise); False: never.
    ple_placement: where the PLE n-gram table lives, "device", "host" or "disk" (ple/placement.py).
    `revolta.load_model` (presets/load.py) also takes "default": the embedded default model.
    """
    from .ple.load import PLELoader
    from .weights import load_weights, read_kv_scales, read_vocab_mask

    device = resolve_device(device)  # a device this machine lacks, or Volta under Triton < 3.4, stops here
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype={dtype!r} is not a torch dtype; use 'float32', 'float16' or 'bfloat16'")
        dtype = getattr(torch, dtype)
    cfg = ModelConfig.from_pretrained(path)
    with torch.device("meta"):
        model = FlashNextModel(cfg, with_mtp=has_mtp_weights(path, cfg) if with_mtp is None else with_mtp,
                               with_vision=with_vision)
    if with_mtp:
        _require_mtp_weights(model, path)
    if cfg.quantization is not None:  # packed layers in the checkpoint's format, checked before any load
        from .layers.quantize import quantize_modules

        quantize_modules(model, cfg.quantization)
    skip = [] if model.mtp is not None else ["mtp."]
    if model.model.visual is None:
        skip.append("model.visual.")
    ple = PLELoader(model, path, ple_placement)  # checks the table's shards before any data is read
    load_weights(model, path, dtype=dtype, device=device, skip_prefixes=tuple(skip) + ple.skip_prefixes,
                 progress=progress)
    ple.load(device)
    if cfg.quantization is not None:
        from .layers.quantize import check_loaded_shapes

        check_loaded_shapes(model)
    model.kv_scales = read_kv_scales(path)  # fp8 KV calibration, if the checkpoint ships it (cache metadata)
    model.checkpoint_dir = Path(path)
    model.logit_mask = read_vocab_mask(path, cfg.text.vocab_size, device)
    return model.merge_projections().eval()


def has_mtp_weights(path: str | Path, cfg: ModelConfig | None = None) -> bool:
    """Whether the checkpoint at `path` declares an MTP layer and ships its `mtp.*` tensors (reads names only)."""
    from .weights import checkpoint_has

    cfg = ModelConfig.from_pretrained(path) if cfg is None else cfg
    return cfg.text.mtp is not None and checkpoint_has(path, "mtp.")


def _require_mtp_weights(model: FlashNextModel, path: str | Path) -> None:
    """with_mtp=True: one error naming what is missing, instead of a list of every absent mtp.* tensor."""
    from .weights import CheckpointError, checkpoint_has

    if model.mtp is None:
        raise CheckpointError(f"with_mtp=True, but the config of {path} declares no MTP layer (mtp_num_hidden_layers "
                              "= 0); load it with with_mtp=None (the default) or with_mtp=False")
    if not checkpoint_has(path, "mtp."):
        names = [f"mtp.{name}" for name in model.mtp.state_dict()]
        raise CheckpointError(
            f"with_mtp=True, but {path} ships no MTP weights: its config declares an MTP layer, and all {len(names)} "
            f"of its tensors ({', '.join(names[:3])}, ...) are missing (transformers' save_pretrained and NeMo "
            "fine-tunes do not write them); load it with with_mtp=None (the default: the MTP head is built when its "
            "weights are present) or with_mtp=False, and decode without MTP speculation")

"""Random-weight stand-ins for the real model in the engine benchmarks: configs, models built where
they run, a DFlash2 drafter of the released shape, and the bytes a step must move (the roofline's
numerator).

`standin_config` starts from the real config (tests/data/qwen3_8_flash_next_config.json) and keeps
its widths, the first `num_layers` layers of its pattern (48: the full depth), `num_experts` experts
per layer (None: the real 512; 64 makes the full depth fit one GPU in fp16), the MTP layer when asked,
no vision tower. Its n-gram tables keep the real row width and lookups per token but far fewer rows
(a gather reads the same bytes per token whatever the table size). `widths="tiny"` keeps the same
pattern at the embedded default preset's widths with a 4,096-token vocabulary: a CPU smoke run of a
benchmark script.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from revolta.config import ModelConfig
from revolta.layers.ngram import NGramEmbedding
from revolta.model import FlashNextModel, init_random_weights

REAL_CONFIG = Path(__file__).resolve().parents[1] / "tests" / "data" / "qwen3_8_flash_next_config.json"
STANDIN_NGRAM_BASE = 65_537  # hash-table size base of the stand-in's n-gram tables (the real one: 20M)


def standin_config(num_layers: int, num_experts: int | None = None, with_mtp: bool = False,
                   widths: str = "real", real_ngram_table: bool = False) -> ModelConfig:
    """The real model's layer pattern and widths (`widths="tiny"`: the embedded default's widths) with
    `num_layers` layers, `num_experts` experts per layer (None: the config's) and its MTP layer when asked;
    real_ngram_table: the real config's n-gram table size (47.7 GiB in FP8) instead of the stand-in's."""
    if widths == "real":
        raw = json.loads(REAL_CONFIG.read_text())
        if not real_ngram_table:
            raw["text_config"].update(ngram_vocab_size_base=STANDIN_NGRAM_BASE, split_ngram_parts=1)
    elif widths == "tiny":
        from revolta.presets.default import DEFAULT_CONFIG

        raw = copy.deepcopy(DEFAULT_CONFIG)
        raw["text_config"].update(vocab_size=4096, eos_token_id=4095, pad_token_id=4095)  # a smoke run's logits
    else:
        raise ValueError(f"widths={widths!r}; use 'real' or 'tiny'")
    raw.pop("vision_config", None)
    t = raw["text_config"]
    if not with_mtp:
        for key in ("mtp", "mtp_num_hidden_layers"):
            t.pop(key, None)
    pattern = t["layer_types"][:4]  # GDN GDN GDN QSA, repeated
    t["num_hidden_layers"] = num_layers
    t["layer_types"] = [pattern[i % len(pattern)] for i in range(num_layers)]
    t["ple_layer_ids"] = [i for i in t["ple_layer_ids"] if i < num_layers]
    if num_experts is not None:
        t["num_experts"] = num_experts
        t["num_experts_per_tok"] = min(t["num_experts_per_tok"], num_experts)
    return ModelConfig.from_dict(raw, source=f"stand-in ({widths} widths, {num_layers} layers)")


def build_model(cfg: ModelConfig, device: str, dtype: torch.dtype, seed: int, with_mtp: bool = False,
                draw_on_device: bool = True) -> FlashNextModel:
    """The model with deterministic random weights (`init_random_weights`), allocated once at its final
    dtype on `device` (no fp32 copy: 20 B parameters would not fit twice). draw_on_device=False draws
    with the CPU generator (the embedded default's checkpoint values) and then moves the model."""
    home = device if draw_on_device else "cpu"
    # built on the meta device unless it stays on the CPU (meta's first use imports torch._dynamo: seconds)
    with torch.device("meta" if torch.device(home).type != "cpu" else "cpu"):
        model = FlashNextModel(cfg, with_mtp=with_mtp, with_vision=False)
    model.to_dtype(dtype)  # on meta: only the dtypes change
    model.to_empty(device=home).init_buffers()
    init_random_weights(model, seed=seed, device=device if draw_on_device else None)
    return model.to(device).eval()


# ---- a DFlash2 drafter shaped like the released one --------------------------------------------
# The released Qwen3.8 DFlash2 drafter (spec/engine.md §2.1-2.2) has 5 sliding-window layers (window
# 2048) at the target width, blocks of 8 (7 drafts), a rank-256 selector with top-16 candidates and
# taps at 5 target layer boundaries; its attention (32 query heads, 8 KV heads of 128) and 9,728-wide
# MLP are the Qwen3 drafter's. `DrafterShape.tiny` keeps the structure at the default preset's scale.


@dataclass(frozen=True)
class DrafterShape:
    num_layers: int = 5
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 9728
    selector_rank: int = 256

    @classmethod
    def tiny(cls) -> "DrafterShape":
        return cls(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256, selector_rank=16)


def drafter_config(target: ModelConfig, shape: DrafterShape = DrafterShape()) -> dict:
    """The drafter's config.json for `target`: taps at up to 5 evenly spread layer boundaries of it."""
    t = target.text
    taps = sorted({round(i * (t.num_hidden_layers - 1) / 4) for i in range(5)})
    n = shape.num_layers
    return {"architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "vocab_size": t.vocab_size,
            "hidden_size": t.hidden_size, "intermediate_size": shape.intermediate_size, "num_hidden_layers": n,
            "num_attention_heads": shape.num_heads, "num_key_value_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "layer_types": ["sliding_attention"] * n, "use_sliding_window": True, "sliding_window": 2048,
            "num_target_layers": t.num_hidden_layers,
            "dflash_config": {"target_layer_ids": taps, "block_size": 8, "mask_token_id": t.vocab_size - 1,
                              "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": shape.selector_rank,
                              "selector_top_k": 16}}


def write_drafter(target: ModelConfig, directory: str | Path, device: str = "cuda",
                  dtype: torch.dtype = torch.float16, shape: DrafterShape = DrafterShape()) -> str:
    """Build (on `device`, random weights) and save the drafter; returns the directory for
    speculative_config["model"]."""
    from revolta.presets.default_drafter import init_drafter_weights
    from revolta.spec.dflash2.checkpoint import save_draft_model
    from revolta.spec.dflash2.draft_config import DFlash2DraftConfig
    from revolta.spec.dflash2.model import DFlash2DraftModel

    cfg = DFlash2DraftConfig.from_dict(drafter_config(target, shape), source="benchmark stand-in drafter")
    with torch.device(device):
        model = DFlash2DraftModel(cfg)
    init_drafter_weights(model, seed=7)
    save_draft_model(model.to(dtype), directory)
    return str(directory)


# ---- the roofline: bytes one step must move -----------------------------------------------------


def uniform_distinct(num_experts: int, top_k: int, rows: int) -> float:
    """Expected distinct experts one layer touches when `rows` tokens route top_k of num_experts uniformly."""
    return num_experts * (1 - (1 - top_k / num_experts) ** rows)


def weight_tensors(model: torch.nn.Module):
    """(name, tensor) of every weight a forward reads: the parameters and the packed tensors (buffers) of
    quantized linears and expert banks."""
    from revolta.layers.linear import QuantLinear
    from revolta.layers.quant_moe import QuantExperts

    yield from model.named_parameters()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, (QuantLinear, QuantExperts)):
            for name, buf in mod.named_buffers():
                yield f"{mod_name}.{name}", buf


def table_row_bytes(emb: NGramEmbedding, dtype: torch.dtype) -> int:
    """Bytes one token's lookup reads from an n-gram table: num_heads rows in the table's storage dtype (FP8
    when it sits in host memory or is FP8 on the device), else in the model's dtype."""
    table = getattr(emb.table, "weight", None)
    itemsize = table.element_size() if table is not None else dtype.itemsize
    return emb.num_heads * emb.head_dim * itemsize


@dataclass(frozen=True)
class WeightBytes:
    """The model's parameter bytes by how a decode step reads them."""

    dense: int  # target weights read whole every step (lm_head excluded)
    lm_head: int
    expert: float  # one routed expert's gate_up + down bytes (one layer)
    num_experts: int
    mtp_dense: int  # the MTP head's weights other than its routed experts
    ngram_row: int  # n-gram embedding bytes one token gathers (all PLE layers)
    embed_row: int

    @classmethod
    def of(cls, model: FlashNextModel) -> "WeightBytes":
        t = model.cfg.text
        dense = lm_head = experts = mtp_dense = 0
        for name, p in weight_tensors(model):
            n = p.numel() * p.element_size()
            if ".mlp.experts." in name:
                experts += 0 if name.startswith("mtp.") else n
            elif name.startswith("mtp."):
                mtp_dense += n
            elif name.startswith("lm_head."):
                lm_head += n
            elif "embed_tokens" not in name and "ngram_embedding" not in name:
                dense += n  # gathered tables: only the looked-up rows count (below)
        ab = model.dtype.itemsize
        ngram = sum(table_row_bytes(m, model.dtype) for m in model.modules() if isinstance(m, NGramEmbedding))
        return cls(dense=dense, lm_head=lm_head, expert=experts / max(1, t.num_hidden_layers) / t.num_experts,
                   num_experts=t.num_experts, mtp_dense=mtp_dense, ngram_row=ngram, embed_row=t.hidden_size * ab)


def step_bytes(model: FlashNextModel, batch: int, context: int, kv_bytes: int, rows_per_request: int = 1,
               distinct: list[float] | None = None) -> dict[str, float]:
    """Bytes a target step over `batch` requests of `rows_per_request` rows each (1: decode, 1 + k: a
    verify) at `context` cached tokens must move: every non-expert weight and lm_head once, each layer's
    distinct touched experts once (`distinct` per layer as measured, else uniform routing), the rows'
    embedding and n-gram rows, each request's fp32 GDN state read and written once, its QSA K/V
    selection (the R rows of a request share one context read) and compressed index keys."""
    t = model.cfg.text
    w = WeightBytes.of(model)
    rows = batch * rows_per_request
    if distinct is None:
        distinct = [uniform_distinct(t.num_experts, t.num_experts_per_tok, rows)] * t.num_hidden_layers
    gdn_state = t.num_gdn_layers * batch * 2 * (t.linear_num_value_heads * t.linear_key_head_dim
                                               * t.linear_value_head_dim * 4)
    selected = min(context, t.qsa_max_width)
    out = {"dense_weights": w.dense, "lm_head": w.lm_head, "experts": w.expert * sum(distinct),
           "table_rows": rows * (w.embed_row + w.ngram_row), "gdn_state": gdn_state,
           "qsa_kv": t.num_qsa_layers * batch * selected * 2 * t.num_key_value_heads * t.head_dim * kv_bytes,
           "index_keys": t.num_qsa_layers * batch * (context // t.indexer_compress_ratio) * t.indexer_head_dim
           * kv_bytes}
    out["total"] = sum(out.values())
    out["distinct_experts_per_layer"] = sum(distinct) / len(distinct)
    return out


def mtp_draft_bytes(model: FlashNextModel, batch: int, num_drafts: int, context: int, kv_bytes: int) -> float:
    """Bytes the MTP drafting of one round must move: the seed over batch x (1 + k) rows and k - 1
    further steps of `batch` rows, each step reading the MTP layer's weights, its touched experts
    (uniform routing) and lm_head for the drafts' logits, and the MTP layer's K/V."""
    t = model.cfg.text
    w = WeightBytes.of(model)
    if model.mtp is None:
        raise ValueError("the model has no MTP head; build it with with_mtp=True")
    rows = [batch * (1 + num_drafts)] + [batch] * (num_drafts - 1)
    experts = sum(uniform_distinct(t.num_experts, t.num_experts_per_tok, r) for r in rows) * w.expert
    kv = batch * min(context, t.qsa_max_width) * 2 * t.num_key_value_heads * t.head_dim * kv_bytes
    return num_drafts * (w.mtp_dense + w.lm_head + kv) + experts + sum(rows) * w.embed_row

"""Sizes of a Qwen3.8-Flash-Next checkpoint from its config alone (no weights): parameter counts,
KV-cache bytes per token, fixed per-sequence state and the `revolta info DIR` text.

Parameter counts come from an instantiation of `FlashNextModel` on the meta device, summed by
parameter name, so they can never drift from the model code (spec/model.md §10.5). Cache and
state sizes follow the tables of spec §10.1-§10.3 and §4.6; TP splitting follows §10.6.

    cfg = ModelConfig.from_pretrained(path)
    print(format_summary(cfg, path, tp=1))
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from pathlib import Path

import torch

from .cache.sizes import (KV_DTYPES, INDEX_KEYS, fixed_state_breakdown, fixed_state_bytes_per_sequence,  # noqa: F401
                          kv_bytes_breakdown, kv_bytes_per_token, kv_heads_per_rank, model_bytes, qsa_kv_heads_per_rank)
from .units import human_bytes  # noqa: F401 (re-exported)
from .config import ModelConfig

# ---------------------------------------------------------------------------------------------
# parameter counts
# ---------------------------------------------------------------------------------------------

# Component keys of `parameter_counts`, in display order. The first group partitions every
# parameter of the model; the totals after it are sums of those.
COMPONENTS = (
    "embed_tokens",       # model.language_model.embed_tokens
    "lm_head",            # lm_head (0 when tied to embed_tokens)
    "hyper_connections",  # layers.{i}.{attn,mlp}_hyper_connection
    "final_mixer",        # model.language_model.hyper_connection_mixer
    "gdn_mixers",         # layers.{i}.linear_attn
    "qsa_mixers",         # layers.{i}.self_attn, indexer included
    "moe_shared",         # layers.{i}.mlp.{gate, shared_expert, shared_expert_gate}
    "routed_experts",     # layers.{i}.mlp.experts
    "ple_modules",        # layers.{i}.ple.* except the n-gram table (projections, norms, conv)
    "ple_table",          # layers.{i}.ple.ple_embedding.ngram_embedding
    "vision",             # model.visual
    "mtp",                # mtp.* (its routed experts included)
)
TOTALS = (
    "text_trunk",           # text model + lm_head, without the PLE table (and without MTP)
    "text_trunk_with_ple",  # + PLE table
    "hf_model",             # + vision tower: what transformers' Qwen4ExpForConditionalGeneration holds
    "total",                # + MTP: every tensor of the checkpoint
)
# Extra keys: sub-counts used for active parameters.
EXTRAS = ("mtp_routed_experts",)

_TEXT = "model.language_model."
_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (key, re.compile(pat))
    for key, pat in (
        ("embed_tokens", r"model\.language_model\.embed_tokens\."),
        ("lm_head", r"lm_head\."),
        ("final_mixer", r"model\.language_model\.hyper_connection_mixer\."),
        ("hyper_connections", r"model\.language_model\.layers\.\d+\.(attn|mlp)_hyper_connection\."),
        ("gdn_mixers", r"model\.language_model\.layers\.\d+\.linear_attn\."),
        ("qsa_mixers", r"model\.language_model\.layers\.\d+\.self_attn\."),
        ("routed_experts", r"model\.language_model\.layers\.\d+\.mlp\.experts\."),
        ("moe_shared", r"model\.language_model\.layers\.\d+\.mlp\."),
        ("ple_table", r"model\.language_model\.layers\.\d+\.ple\.ple_embedding\.ngram_embedding\."),
        ("ple_modules", r"model\.language_model\.layers\.\d+\.ple\."),
        ("vision", r"model\.visual\."),
        ("mtp", r"mtp\."),
    )
)
_MTP_EXPERTS = re.compile(r"mtp\.layers\.\d+\.mlp\.experts\.")


def _component(name: str) -> str:
    for key, pat in _RULES:
        if pat.match(name):
            return key
    raise ValueError(f"parameter {name!r} matches no component of revolta.summary; add a rule to _RULES")


@functools.lru_cache(maxsize=8)
def _counts(cfg: ModelConfig) -> tuple[tuple[str, int], ...]:
    from .model import FlashNextModel  # lazy: the model pulls in every layer module

    with torch.device("meta"):
        model = FlashNextModel(cfg, with_mtp=True, with_vision=True)
    counts = Counter({k: 0 for k in COMPONENTS + EXTRAS})
    for name, p in model.named_parameters():  # tied weights are listed once (under embed_tokens)
        counts[_component(name)] += p.numel()
        if _MTP_EXPERTS.match(name):
            counts["mtp_routed_experts"] += p.numel()
    return tuple(counts.items())


def parameter_counts(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts by component (keys `COMPONENTS`), totals (`TOTALS`) and `EXTRAS`.

    Exact: the model is instantiated on the meta device (no memory) and `numel` is summed by
    checkpoint name. int64 buffers (PLE hash constants) and RoPE tables are not parameters and
    are not counted. Components absent from the config (no vision, no MTP) count 0.
    """
    c = dict(_counts(cfg))
    c["text_trunk"] = sum(c[k] for k in COMPONENTS if k not in ("ple_table", "vision", "mtp"))
    c["text_trunk_with_ple"] = c["text_trunk"] + c["ple_table"]
    c["hf_model"] = c["text_trunk_with_ple"] + c["vision"]
    c["total"] = c["hf_model"] + c["mtp"]
    return c


def _units(cfg: ModelConfig) -> dict[str, int]:
    """How many identical units make up each component (for the per-unit column)."""
    t = cfg.text
    return {
        "embed_tokens": 1, "lm_head": 0 if t.tie_word_embeddings else 1, "hyper_connections": t.num_hidden_layers,
        "final_mixer": 1, "gdn_mixers": t.num_gdn_layers, "qsa_mixers": t.num_qsa_layers,
        "moe_shared": t.num_hidden_layers, "routed_experts": t.num_hidden_layers,
        "ple_modules": len(t.ple_layer_ids), "ple_table": len(t.ple_layer_ids),
        "vision": int(cfg.vision is not None), "mtp": t.num_mtp_layers,
    }


def active_parameters(cfg: ModelConfig) -> dict[str, int]:
    """Parameters used per decoded token (spec §0.1, §10.4).

    - `trunk`: weights multiplied per token in the text trunk: everything in `text_trunk` except
      embed_tokens and lm_head, with routed experts scaled by top-k / num_experts (exact for
      the real config: 10 of 512 experts, equal size). The embedding row and the PLE rows are
      gathered, not multiplied, and are listed apart in `gathered_rows`.
    - `trunk_with_lm_head`: + lm_head (the "6.7 B" figure).
    - `gathered_rows`: one embed_tokens row + (ngram heads x head dim) PLE values per PLE layer.
    - `mtp_step`: one MTP draft step: MTP weights with its experts scaled the same way, plus the
      shared lm_head (the embedding row is gathered).
    Vision is not counted (it runs once per image, not per token).
    """
    t = cfg.text
    c = parameter_counts(cfg)
    frac = t.num_experts_per_tok / t.num_experts
    dense = c["text_trunk"] - c["routed_experts"] - c["embed_tokens"] - c["lm_head"]
    trunk = dense + round(c["routed_experts"] * frac)
    lm_head = c["lm_head"] or c["embed_tokens"]  # tied: the shared matrix is still multiplied
    mtp = 0
    if c["mtp"]:
        mtp = c["mtp"] - c["mtp_routed_experts"] + round(c["mtp_routed_experts"] * frac) + lm_head
    return {
        "trunk": trunk,
        "trunk_with_lm_head": trunk + lm_head,
        "gathered_rows": t.hidden_size + len(t.ple_layer_ids) * t.ple_embed_dim,
        "mtp_step": mtp,
    }


# ---------------------------------------------------------------------------------------------
# cache and state bytes
# ---------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------
# text report
# ---------------------------------------------------------------------------------------------

def human_count(n: float) -> str:
    """125743653760 -> '125.74 B'; 6563840 -> '6.56 M'."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


def _layer_pattern(types: tuple[str, ...]) -> str:
    short = ["GDN" if x == "linear_attention" else "QSA" for x in types]
    for period in range(1, len(short) + 1):
        if len(short) % period == 0 and short == short[:period] * (len(short) // period):
            return f"{' '.join(short[:period])} x {len(short) // period}"
    return " ".join(short)


def _table(rows: list[tuple[str, ...]], align: str) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.ljust(w) if a == "<" else c.rjust(w) for c, w, a in zip(r, widths, align)]
        out.append("  " + "  ".join(cells).rstrip())
    return out


_LABELS = {
    "embed_tokens": "embed_tokens",
    "lm_head": "lm_head",
    "hyper_connections": "HC pairs (attn + mlp)",
    "final_mixer": "final HC mixer",
    "gdn_mixers": "GDN mixers",
    "qsa_mixers": "QSA mixers (incl. indexer)",
    "moe_shared": "MoE router + shared expert",
    "routed_experts": "routed experts",
    "ple_modules": "PLE proj/norms/conv",
    "text_trunk": "text trunk without PLE table",
    "ple_table": "PLE n-gram table",
    "text_trunk_with_ple": "text trunk with PLE table",
    "vision": "vision tower",
    "hf_model": "HF model (text + vision)",
    "mtp": "MTP head",
    "total": "total (checkpoint)",
}
_ORDER = ("embed_tokens", "lm_head", "hyper_connections", "final_mixer", "gdn_mixers", "qsa_mixers", "moe_shared",
          "routed_experts", "ple_modules", "text_trunk", "ple_table", "text_trunk_with_ple", "vision", "hf_model",
          "mtp", "total")

CAPACITY_CONTEXTS = (32_768, 131_072, 262_144, 1_048_576)


def _mtp_weights_note(num_mtp_layers: int, mtp_weights: bool | None) -> str:
    if not num_mtp_layers or mtp_weights is None:
        return ""
    if mtp_weights:
        return "; weights in the checkpoint (MTP4 speculative decoding by default)"
    return ("; NO mtp.* weights in the checkpoint (e.g. a transformers save_pretrained or NeMo fine-tune): the MTP "
            "head is not built and decoding runs without speculation")


def format_summary(cfg: ModelConfig, path: str | Path | None = None, *, tp: int = 1,
                   mtp_weights: bool | None = None) -> str:
    """The report `revolta info DIR` prints: architecture, layer pattern, key dims, parameter table,
    active parameters, KV bytes per token, fixed state per sequence and capacity examples.

    cfg: `ModelConfig.from_pretrained(DIR)`; path: shown in the header when given; tp: tensor-parallel
    size for the per-GPU cache/state figures (TP = 1 is always shown too); mtp_weights: whether the checkpoint
    ships the MTP layer's `mtp.*` tensors (None: not checked, e.g. a config.json alone). Needs no weights.
    """
    t, v = cfg.text, cfg.vision
    c = parameter_counts(cfg)
    units = _units(cfg)
    lines: list[str] = []
    head = f"{', '.join(cfg.architectures) or 'Qwen3.8-Flash-Next'} (model_type {cfg.model_type}, dtype {cfg.dtype})"
    lines.append(f"checkpoint: {path}" if path is not None else "checkpoint: (config only)")
    lines.append(f"architecture: {head}")

    ple = ", ".join(str(i) for i in t.ple_layer_indices) or "none"
    lines += [
        "",
        "layers:",
        f"  decoder layers: {t.num_hidden_layers} = {t.num_gdn_layers} GDN + {t.num_qsa_layers} QSA "
        f"(pattern {_layer_pattern(t.layer_types)}; QSA at {', '.join(map(str, t.qsa_layer_ids))})",
        f"  MoE layers: {t.num_hidden_layers} (all)",
        f"  PLE layers: {len(t.ple_layer_ids)} (zero-based decoder index {ple})",
        f"  MTP layers: {t.num_mtp_layers}" + (f" ({', '.join('QSA' for _ in t.mtp.layer_types)})" if t.mtp else "")
        + _mtp_weights_note(t.num_mtp_layers, mtp_weights),
        "",
        "dimensions:",
        f"  hidden {t.hidden_size}, HC streams {t.hc_count} (wide {t.wide_size}), HC low rank {t.hc_lowrank}, "
        f"vocab {t.vocab_size}",
        f"  GDN: {t.linear_num_key_heads} qk heads / {t.linear_num_value_heads} v heads x "
        f"{t.linear_key_head_dim}/{t.linear_value_head_dim}, conv kernel {t.linear_conv_kernel_dim}, "
        f"output gate {t.output_gate_type}",
        f"  QSA: {t.num_attention_heads} q heads / {t.num_key_value_heads} kv heads x {t.head_dim}, "
        f"rotary {t.rotary_dim} (theta {t.rope.rope_theta:g}, mrope {list(t.rope.mrope_section)}), "
        f"indexer {t.indexer_n_heads} heads x {t.indexer_head_dim}, budget {t.indexer_budget} tokens "
        f"in blocks of {t.indexer_compress_ratio} (sparse from position {t.qsa_sparse_onset})",
        f"  MoE: {t.num_experts} experts, top-{t.num_experts_per_tok}, expert width {t.moe_intermediate_size}, "
        f"shared expert {t.shared_expert_intermediate_size}",
        f"  PLE: {t.num_ngram_heads} n-gram heads x {t.ngram_head_dim}, n <= {t.ngram_size}, "
        f"conv kernel {t.ple_conv_kernel_size} dilation {t.ngram_size}, {t.split_ngram_parts} table shards",
        f"  context: {t.max_position_embeddings} native positions, rope {t.rope.rope_type}",
    ]
    if v is not None:
        lines.append(f"  vision: {v.depth} blocks x {v.hidden_size} ({v.num_heads} heads), MLP {v.intermediate_size}, "
                     f"patch {v.patch_size}, temporal {v.temporal_patch_size}, merge {v.spatial_merge_size}, "
                     f"out {v.out_hidden_size}")

    rows = [("component", "per unit", "units", "parameters", "")]
    for key in _ORDER:
        n = c[key]
        if key in TOTALS:
            rows.append((_LABELS[key], "", "", f"{n:,}", human_count(n)))
            continue
        u = units[key]
        per = f"{n // u:,}" if u and n % u == 0 else ""
        label = _LABELS[key]
        if key == "routed_experts" and u and n % (u * t.num_experts) == 0:
            label += f" ({t.num_experts} x {n // (u * t.num_experts):,})"
        if key == "lm_head" and t.tie_word_embeddings:
            label += " (tied to embed_tokens)"
        rows.append(("  " + label, per, str(u), f"{n:,}", human_count(n)))
    lines += ["", "parameters (exact, from the module tree):"] + _table(rows, "<>>>>")
    lines.append(f"  weights at {cfg.dtype}: {human_bytes(c['total'] * model_bytes(cfg.dtype))} "
                 f"({c['total'] * model_bytes(cfg.dtype) / 1e9:.1f} GB)")

    a = active_parameters(cfg)
    lines += [
        "",
        f"active parameters per token (routed experts x {t.num_experts_per_tok}/{t.num_experts}; "
        "embedding, PLE table, vision, MTP excluded):",
        f"  trunk matmul weights: {a['trunk']:,} ({human_count(a['trunk'])})",
        f"  + lm_head: {a['trunk_with_lm_head']:,} ({human_count(a['trunk_with_lm_head'])})",
        f"  gathered rows (1 embedding row + PLE rows): {a['gathered_rows']:,} values",
    ]
    if a["mtp_step"]:
        lines.append(f"  one MTP draft step (incl. shared lm_head): {a['mtp_step']:,} ({human_count(a['mtp_step'])})")

    tps = (1,) if tp == 1 else (1, tp)
    for tp_ in tps:
        rows = [("kv dtype", "main K+V", "+ compressed idx", "+ raw idx", "MTP extra (+compressed idx)")]
        for dt in KV_DTYPES:
            mtp = kv_bytes_breakdown(cfg, dt, "compressed", include_mtp=True, tp=tp_)
            rows.append((
                dt,
                f"{kv_bytes_per_token(cfg, dt, 'none', tp=tp_):,}",
                f"{kv_bytes_per_token(cfg, dt, 'compressed', tp=tp_):,}",
                f"{kv_bytes_per_token(cfg, dt, 'raw', tp=tp_):,}",
                f"+{mtp['mtp_main_kv'] + mtp['mtp_kv_scales'] + mtp['mtp_index_keys']:,}",
            ))
        where = "whole model" if tp_ == 1 else f"per GPU at TP {tp_}"
        lines += ["", f"KV cache bytes per token ({where}, {t.num_qsa_layers} QSA layers; int8 includes "
                  "fp32 per-token-per-head scales; raw index keys in model dtype):"] + _table(rows, "<>>>>")

    for tp_ in tps:
        f = fixed_state_breakdown(cfg, tp=tp_)
        where = "" if tp_ == 1 else f" per GPU at TP {tp_}"
        lines += [
            "",
            f"fixed state per sequence{where}: {f['total']:,} B ({human_bytes(f['total'])})",
            f"  GDN recurrent ({t.mamba_ssm_dtype}): {f['gdn_recurrent']:,} B; GDN conv: {f['gdn_conv']:,} B "
            f"(GDN total {f['gdn_recurrent'] + f['gdn_conv']:,} B = {human_bytes(f['gdn_recurrent'] + f['gdn_conv'])})",
            f"  PLE conv: {f['ple_conv']:,} B + ids {f['ple_ids']} B; QSA pending rings: {f['qsa_pending']:,} B "
            f"+ positions {f['qsa_pending_positions']} B",
        ]

    main = kv_bytes_per_token(cfg, "bf16", "none")
    lines += ["", "capacity examples (one sequence, TP 1, compressed index keys, fixed state included, no MTP):",
              f"  check: main K+V for {t.max_position_embeddings:,} tokens in bf16 = "
              f"{human_bytes(main * t.max_position_embeddings)}"]
    fixed = fixed_state_bytes_per_sequence(cfg)
    rows = [("context", *KV_DTYPES)]
    for n in CAPACITY_CONTEXTS:
        rows.append((f"{n:,}", *(human_bytes(kv_bytes_per_token(cfg, dt) * n + fixed) for dt in KV_DTYPES)))
    lines += _table(rows, "<>>>>")
    return "\n".join(lines) + "\n"

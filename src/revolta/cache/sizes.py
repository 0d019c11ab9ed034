"""Cache and state sizes of a model, computed from its config alone (spec/model.md §10.1-§10.3, §4.6; TP
splitting §10.6): KV bytes per token of context, fixed per-sequence state, heads per rank.

The cache planner (capacity.py) and storage (storage.py) size their pools with these; summary.py prints them.
"""

from __future__ import annotations

from ..config import ModelConfig

# bytes per cached element for each KV-cache dtype; int8 adds fp32 per-token-per-head K and V scales
KV_DTYPES = {"bf16": 2, "fp16": 2, "fp8_e4m3": 1, "int8": 1}
INDEX_KEYS = ("none", "compressed", "raw")
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "bf16": 2, "fp16": 2, "fp32": 4}


def model_bytes(name: str) -> int:
    try:
        return _DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} has no known size; expected one of {sorted(_DTYPE_BYTES)}") from None


def qsa_kv_heads_per_rank(cfg: ModelConfig, tp: int) -> int:
    """QSA KV heads held by one TP rank: split when kv_heads >= tp, else replicated (spec §10.6)."""
    return kv_heads_per_rank(cfg.text.num_key_value_heads, tp)


def kv_heads_per_rank(h: int, tp: int) -> int:
    """KV heads of an attention layer with `h` of them held by one TP rank: split when h >= tp, else replicated."""
    if tp < 1 or (h >= tp and h % tp) or (h < tp and tp % h):
        raise ValueError(f"tp={tp} neither divides nor is a multiple of num_key_value_heads={h}")
    return max(1, h // tp)


def kv_bytes_breakdown(cfg: ModelConfig, kv_dtype: str = "bf16", index_keys: str = "compressed",
                       include_mtp: bool = False, tp: int = 1, dcp: int = 1) -> dict[str, int]:
    """Growing cache bytes per token of context for one sequence, per GPU (spec §10.2, §4.6).

    kv_dtype: "bf16" | "fp16" | "fp8_e4m3" | "int8" for main K/V and compressed index keys.
    index_keys: "none" (main K/V only), "compressed" (one pooled key of indexer_head_dim per
    compress_ratio tokens, in kv_dtype: SGLang layout) or "raw" (every token's raw index key in
    the model dtype: HF layout).
    include_mtp: add the MTP layer's own K/V and index keys (`mtp_*` entries).
    tp: tensor-parallel size. KV heads are split (or replicated when num_key_value_heads < tp);
    the single index-key head is replicated on every rank.
    dcp: decode-context-parallel size: each rank holds 1/dcp of the trunk layers' main K/V (and int8 scales) of its
    KV head (parallel/dcp.py); index keys and the MTP layer's K/V stay replicated.

    Returns bytes per token for `main_kv`, `kv_scales`, `index_keys` (trunk QSA layers), the
    same three with an `mtp_` prefix, and `total`.
    """
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype={kv_dtype!r}; expected one of {list(KV_DTYPES)}")
    if index_keys not in INDEX_KEYS:
        raise ValueError(f"index_keys={index_keys!r}; expected one of {list(INDEX_KEYS)}")
    t = cfg.text
    heads = qsa_kv_heads_per_rank(cfg, tp)
    elt = KV_DTYPES[kv_dtype]
    main = 2 * heads * t.head_dim * elt  # K and V, per QSA layer
    scales = 2 * heads * 4 if kv_dtype == "int8" else 0  # fp32 K and V scale per token per head
    if index_keys == "compressed":
        idx = t.indexer_kv_heads * t.indexer_head_dim * elt // t.indexer_compress_ratio
    elif index_keys == "raw":
        idx = t.indexer_kv_heads * t.indexer_head_dim * model_bytes(cfg.dtype)
    else:
        idx = 0
    n, m = t.num_qsa_layers, (t.num_mtp_layers if include_mtp else 0)
    out = {"main_kv": n * main // dcp, "kv_scales": n * scales // dcp, "index_keys": n * idx,
           "mtp_main_kv": m * main, "mtp_kv_scales": m * scales, "mtp_index_keys": m * idx}
    out["total"] = sum(out.values())
    return out


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str = "bf16", index_keys: str = "compressed",
                       include_mtp: bool = False, tp: int = 1, dcp: int = 1) -> int:
    """Total of `kv_bytes_breakdown` (same arguments): cache bytes per token of context, per GPU."""
    return kv_bytes_breakdown(cfg, kv_dtype, index_keys, include_mtp, tp, dcp)["total"]


def fixed_state_breakdown(cfg: ModelConfig, include_mtp: bool = False, tp: int = 1) -> dict[str, int]:
    """Per-sequence state that does not grow with context, in bytes per GPU (spec §10.1, §10.3).

    - `gdn_recurrent`: S [HV, d_k, d_v] per GDN layer in mamba_ssm_dtype (fp32);
    - `gdn_conv`: the last (K-1) pre-conv vectors of the q/k/v channels per GDN layer, model dtype
      (HF keeps K columns instead: +1 vector per layer, not counted);
    - `ple_conv`: the last (kernel-1)*ngram_size pre-conv vectors (h*d channels), model dtype;
    - `ple_ids`: the last ngram_size-1 token ids, int64;
    - `qsa_pending`: raw index keys of the incomplete block, (compress_ratio-1) per QSA layer
      (+ the MTP layer with include_mtp), model dtype;
    - `qsa_pending_positions`: their 3-D mRoPE positions, int64, shared by all QSA layers.
    tp: GDN heads are split across ranks; PLE and the index-key rings are replicated.
    """
    t = cfg.text
    if t.linear_num_key_heads % tp:
        raise ValueError(f"tp={tp} does not divide linear_num_key_heads={t.linear_num_key_heads}")
    mb = model_bytes(cfg.dtype)
    state_bytes = model_bytes(t.mamba_ssm_dtype.removeprefix("torch."))
    hv = t.linear_num_value_heads // tp
    conv_dim = t.gdn_conv_dim // tp
    pending = t.indexer_compress_ratio - 1
    qsa_layers = t.num_qsa_layers + (t.num_mtp_layers if include_mtp else 0)
    num_ple = len(t.ple_layer_ids)
    out = {
        "gdn_recurrent": t.num_gdn_layers * hv * t.linear_key_head_dim * t.linear_value_head_dim * state_bytes,
        "gdn_conv": t.num_gdn_layers * (t.linear_conv_kernel_dim - 1) * conv_dim * mb,
        "ple_conv": num_ple * t.ple_conv_history * t.wide_size * mb,
        "ple_ids": num_ple * (t.ngram_size - 1) * 8,
        "qsa_pending": qsa_layers * pending * t.indexer_kv_heads * t.indexer_head_dim * mb,
        "qsa_pending_positions": pending * 3 * 8 if qsa_layers else 0,
    }
    out["total"] = sum(out.values())
    return out


def fixed_state_bytes_per_sequence(cfg: ModelConfig, include_mtp: bool = False, tp: int = 1) -> int:
    """Total of `fixed_state_breakdown` (same arguments): constant state bytes per live sequence, per GPU."""
    return fixed_state_breakdown(cfg, include_mtp, tp)["total"]

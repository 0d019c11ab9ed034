"""Config-only sizes (revolta.summary) against spec/model.md §10.2, §10.3, §10.5 and a real module tree."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from revolta.config import ModelConfig
from revolta.model import FlashNextModel
from revolta.summary import (
    COMPONENTS,
    active_parameters,
    fixed_state_breakdown,
    fixed_state_bytes_per_sequence,
    format_summary,
    kv_bytes_breakdown,
    kv_bytes_per_token,
    parameter_counts,
)

REAL_CONFIG = Path(__file__).parent / "data" / "qwen3_8_flash_next_config.json"

from tiny_configs import F, L, T4_TEXT as _T4, V_TINY  # noqa: E402  (tests/parity, on sys.path)

T4_TEXT = dict(_T4, mtp_num_hidden_layers=1)  # T4 of spec §12.2 plus one MTP layer


def tiny_config(vision: bool = True, **text_overrides) -> ModelConfig:
    text = copy.deepcopy(T4_TEXT)
    text.update(text_overrides)
    raw = dict(model_type="qwen4_exp", architectures=["Qwen4ExpForConditionalGeneration"], text_config=text,
               image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503)
    if vision:
        raw["vision_config"] = dict(V_TINY)
    return ModelConfig.from_dict(raw)


@pytest.fixture(scope="module")
def real() -> ModelConfig:
    return ModelConfig.from_pretrained(REAL_CONFIG)


def test_real_config_loads_with_spec_values(real):
    t, v = real.text, real.vision
    assert (t.num_hidden_layers, t.num_gdn_layers, t.num_qsa_layers) == (48, 36, 12)
    assert t.qsa_layer_ids == tuple(range(3, 48, 4))
    assert t.ple_layer_indices == (1,) and t.split_ngram_parts == 128 and t.eos_token_id == 248044
    assert t.rope.mrope_section == (11, 11, 10) and t.rope.mrope_interleaved and t.rotary_dim == 64
    assert t.num_mtp_layers == 1 and t.output_gate_type == "sigmoid"
    assert (v.depth, v.hidden_size, v.out_hidden_size, v.num_position_embeddings) == (27, 1152, 2560, 2304)
    assert real.image_token_id == 248056 and real.architectures == ("Qwen4ExpForConditionalGeneration",)
    assert ModelConfig.from_dict(real.to_dict()) == real
    raw = json.loads(REAL_CONFIG.read_text())
    assert raw["text_config"]["layer_types"] == [F if i % 4 == 3 else L for i in range(48)]


def test_real_parameter_counts_match_spec(real):
    c = parameter_counts(real)
    expected = {  # spec §10.5
        "embed_tokens": 635_699_200,
        "lm_head": 635_699_200,
        "hyper_connections": 48 * 13_209_600,
        "final_mixer": 6_563_840,
        "gdn_mixers": 36 * 57_958_624,
        "qsa_mixers": 12 * 51_446_528,
        "moe_shared": 48 * 6_228_480,
        "routed_experts": 48 * 512 * 4_915_200,
        "ple_modules": 32_839_680,
        "ple_table": 320_001_536 * 160,
        "vision": 448_931_056,
        "mtp": 2_607_150_848,
        "mtp_routed_experts": 2_516_582_400,
        "text_trunk": 125_743_653_760,
        "text_trunk_with_ple": 176_943_899_520,
        "hf_model": 177_392_830_576,
        "total": 179_999_981_424,
    }
    assert c == expected


def test_real_active_parameters(real):
    a = active_parameters(real)
    assert a["trunk"] == 6_035_596_160  # ≈ 6.04 B, spec §10.4
    assert a["trunk_with_lm_head"] == 6_671_295_360  # ≈ 6.67 B
    assert a["gathered_rows"] == 2560 + 16 * 160


@pytest.mark.parametrize("kv_dtype, main, compressed, raw, mtp_extra", [
    ("bf16", 24_576, 25_344, 27_648, 2_048 + 64),
    ("fp16", 24_576, 25_344, 27_648, 2_048 + 64),
    ("fp8_e4m3", 12_288, 12_672, 15_360, 1_024 + 32),
    ("int8", 12_480, 12_864, 15_552, 1_024 + 16 + 32),
])
def test_real_kv_bytes_match_spec(real, kv_dtype, main, compressed, raw, mtp_extra):
    assert kv_bytes_per_token(real, kv_dtype, "none") == main
    assert kv_bytes_per_token(real, kv_dtype, "compressed") == compressed
    assert kv_bytes_per_token(real, kv_dtype, "raw") == raw
    assert kv_bytes_per_token(real, kv_dtype, "compressed", include_mtp=True) == compressed + mtp_extra
    b = kv_bytes_breakdown(real, kv_dtype, "compressed", include_mtp=True)
    assert b["total"] == sum(v for k, v in b.items() if k != "total")


def test_real_kv_capacity_and_tp(real):
    assert kv_bytes_per_token(real, "bf16", "none") * 262_144 == 6 * 2**30  # spec §10.2 check
    # spec §10.6: TP4 replicates the 2 KV heads -> one head per rank; E4M3 main KV 6,144 B/token per GPU
    assert kv_bytes_per_token(real, "fp8_e4m3", "none", tp=4) == 6_144
    assert kv_bytes_breakdown(real, "fp16", "none", include_mtp=True, tp=4)["mtp_main_kv"] == 1_024
    assert kv_bytes_per_token(real, "bf16", "none", tp=2) == 12_288
    with pytest.raises(ValueError, match="tp=3"):
        kv_bytes_per_token(real, tp=3)
    with pytest.raises(ValueError, match="kv_dtype"):
        kv_bytes_per_token(real, "fp4")


def test_real_fixed_state_matches_spec(real):
    f = fixed_state_breakdown(real)
    assert f["gdn_recurrent"] + f["gdn_conv"] == 115_458_048 == 36 * (3_145_728 + 61_440)
    assert (f["ple_conv"], f["ple_ids"]) == (184_320, 16)
    assert f["qsa_pending"] == 12 * 3 * 128 * 2
    assert fixed_state_bytes_per_sequence(real) == f["total"] == sum(v for k, v in f.items() if k != "total")
    assert f["total"] / 2**20 == pytest.approx(110.3, abs=0.05)
    g4 = fixed_state_breakdown(real, tp=4)
    assert g4["gdn_recurrent"] + g4["gdn_conv"] == 115_458_048 // 4  # ≈ 27.5 MiB per GPU
    assert fixed_state_breakdown(real, include_mtp=True)["qsa_pending"] == 13 * 3 * 128 * 2


def test_real_format_summary(real):
    s = format_summary(real, REAL_CONFIG.parent)
    for line in [
        f"checkpoint: {REAL_CONFIG.parent}",
        "Qwen4ExpForConditionalGeneration",
        "48 = 36 GDN + 12 QSA (pattern GDN GDN GDN QSA x 12",
        "PLE layers: 1 (zero-based decoder index 1)",
        "MTP layers: 1",
        "125,743,653,760  125.74 B",
        "176,943,899,520  176.94 B",
        "177,392,830,576  177.39 B",
        "2,607,150,848    2.61 B",
        "179,999,981,424  180.00 B",
        "routed experts (512 x 4,915,200)",
        "trunk matmul weights: 6,035,596,160 (6.04 B)",
        "+ lm_head: 6,671,295,360 (6.67 B)",
        "bf16        24,576            25,344     27,648",
        "fp8_e4m3    12,288            12,672     15,360",
        "int8        12,480            12,864     15,552",
        "GDN total 115,458,048 B = 110.11 MiB",
        "main K+V for 262,144 tokens in bf16 = 6.00 GiB",
    ]:
        assert line in s, line
    s4 = format_summary(real, tp=4)
    assert "per GPU at TP 4" in s4 and "fp8_e4m3     6,144" in s4


def _numel(module: torch.nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("vision, mtp", [(True, True), (False, False)])
def test_tiny_counts_equal_instantiated_model(vision, mtp):
    cfg = tiny_config(vision=vision, **({} if mtp else {"mtp_num_hidden_layers": 0}))
    c = parameter_counts(cfg)
    torch.manual_seed(0)
    model = FlashNextModel(cfg)  # real CPU tensors this time
    lm = model.model.language_model
    layers = list(lm.layers)
    assert c["total"] == _numel(model)
    assert sum(c[k] for k in COMPONENTS) == c["total"]
    assert c["hf_model"] == _numel(FlashNextModel(cfg, with_mtp=False))
    assert c["text_trunk_with_ple"] == _numel(FlashNextModel(cfg, with_mtp=False, with_vision=False))
    assert c["embed_tokens"] == _numel(lm.embed_tokens) and c["lm_head"] == _numel(model.lm_head)
    assert c["final_mixer"] == _numel(lm.hyper_connection_mixer)
    assert c["hyper_connections"] == sum(_numel(x.attn_hyper_connection) + _numel(x.mlp_hyper_connection)
                                         for x in layers)
    assert c["gdn_mixers"] == sum(_numel(x.linear_attn) for x in layers if x.is_gdn)
    assert c["qsa_mixers"] == sum(_numel(x.self_attn) for x in layers if not x.is_gdn)
    assert c["routed_experts"] == sum(_numel(x.mlp.experts) for x in layers)
    assert c["moe_shared"] == sum(_numel(x.mlp) - _numel(x.mlp.experts) for x in layers)
    ple = layers[1].ple
    assert c["ple_table"] == ple.ple_embedding.ngram_embedding.weight.numel()
    assert c["ple_modules"] == _numel(ple) - c["ple_table"]
    assert c["vision"] == _numel(model.model.visual) and (c["vision"] > 0) == vision
    assert c["mtp"] == _numel(model.mtp) and (c["mtp"] > 0) == mtp
    s = format_summary(cfg)
    assert f"{c['total']:,}" in s and "pattern GDN GDN GDN QSA x 1" in s


def test_tiny_tied_embeddings_count_once():
    cfg = tiny_config(tie_word_embeddings=True)
    c = parameter_counts(cfg)
    assert c["lm_head"] == 0 and c["total"] == _numel(FlashNextModel(cfg))
    a = active_parameters(cfg)
    assert a["trunk_with_lm_head"] - a["trunk"] == c["embed_tokens"]


def test_tiny_state_bytes_follow_formulas():
    cfg = tiny_config()
    t = cfg.text
    f = fixed_state_breakdown(cfg)
    assert cfg.dtype == "bfloat16"
    mb = 2
    assert f["gdn_recurrent"] == 3 * 4 * 16 * 16 * 4
    assert f["gdn_conv"] == 3 * 3 * (2 * 32 + 64) * mb
    assert f["ple_conv"] == 9 * 4 * 64 * mb
    assert f["qsa_pending"] == 1 * 3 * 16 * mb
    assert kv_bytes_per_token(cfg, "bf16", "none") == t.num_qsa_layers * 2 * 2 * 32 * 2
    assert kv_bytes_per_token(cfg, "bf16", "compressed") - kv_bytes_per_token(cfg, "bf16", "none") == 16 * 2 // 4

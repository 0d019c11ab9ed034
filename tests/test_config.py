"""ModelConfig parsing: real layouts, aliases, and one clear error per inconsistency (spec §1, §12.4)."""

import copy
import json
from pathlib import Path

import pytest

from revolta.config import GDN, QSA, ConfigError, ModelConfig

REAL = Path(__file__).parent / "data" / "qwen3_8_flash_next_config.json"


def real_raw() -> dict:
    return json.loads(REAL.read_text())


def test_real_config_fields_and_derived_sizes():
    cfg = ModelConfig.from_pretrained(REAL.parent / REAL.name)
    t = cfg.text
    assert (t.hidden_size, t.num_hidden_layers, t.vocab_size) == (2560, 48, 248320)
    assert t.qsa_layer_ids == tuple(range(3, 48, 4)) and t.num_gdn_layers == 36
    assert (t.gdn_key_dim, t.gdn_value_dim, t.gdn_conv_dim) == (2048, 6144, 10240)
    assert (t.rotary_dim, t.num_ngram_heads, t.ngram_head_dim, t.ple_conv_history) == (64, 16, 160, 9)
    assert (t.qsa_block_budget, t.qsa_max_width, t.qsa_sparse_onset) == (512, 2051, 2051)
    assert t.ple_layer_indices == (1,) and t.output_gate_type == "sigmoid" and t.num_mtp_layers == 1
    assert cfg.vision.depth == 27 and cfg.vision.out_hidden_size == 2560


@pytest.mark.parametrize("top,text", [("qwen4_exp", "qwen4_exp_text"),
                                      ("qwen3_8_flash_next", "qwen3_8_flash_next_text")])
def test_both_model_type_names(top, text):
    raw = real_raw()
    raw["model_type"], raw["text_config"]["model_type"] = top, text
    raw["architectures"] = ["Qwen3_8FlashNextForConditionalGeneration"]
    assert ModelConfig.from_dict(raw).text.num_hidden_layers == 48


def test_text_only_top_level_export_and_old_rope_style():
    raw = real_raw()
    text = dict(raw["text_config"], model_type="qwen4_exp_text", architectures=["Qwen4ExpForCausalLM"])
    rope = text.pop("rope_parameters")
    text["rope_theta"], text["rope_scaling"] = rope["rope_theta"], {
        "mrope_section": rope["mrope_section"], "mrope_interleaved": True, "rope_type": "default"}
    text.pop("layer_types")  # derived from full_attention_interval
    cfg = ModelConfig.from_dict(text)
    assert cfg.vision is None
    assert cfg.text.layer_types == tuple(QSA if (i + 1) % 4 == 0 else GDN for i in range(48))
    assert cfg.text.rope.rope_theta == 1e7 and cfg.text.rope.partial_rotary_factor == 0.25


def test_round_trip():
    cfg = ModelConfig.from_pretrained(REAL)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def mutate(fn):
    raw = real_raw()
    fn(raw)
    return raw


@pytest.mark.parametrize("change,needle", [
    (lambda r: r.update(model_type="llama", architectures=["LlamaForCausalLM"]), "model_type='llama'"),
    (lambda r: r["text_config"].update(layer_types=["linear_attention"] * 47), "layer_types has 47 entries"),
    (lambda r: r["text_config"]["rope_parameters"].update(mrope_section=[11, 11, 11]), "mrope_section"),
    (lambda r: r["text_config"].update(ple_layer_ids=[4]), "ple_layer_ids contains 4"),
    (lambda r: r["text_config"].update(indexer_budget=2047), "indexer_budget=2047"),
    (lambda r: r["text_config"].update(indexer_kv_heads=2), "indexer_kv_heads=2"),
    (lambda r: r["text_config"].update(num_key_value_heads=5), "num_key_value_heads=5"),
    (lambda r: r["text_config"].update(linear_num_value_heads=40), "linear_num_value_heads=40"),
    (lambda r: r["text_config"].update(num_experts_per_tok=600), "num_experts_per_tok=600"),
    (lambda r: r["text_config"].update(hc_count=1), "hc_count=1"),
    (lambda r: r["text_config"].update(eos_token_id=300000), "eos_token_id=300000"),
    (lambda r: r["text_config"].update(ple_embed_dim=2500), "ple_embed_dim=2500"),
    (lambda r: r["text_config"].update(indexer_head_dim=32), "indexer_head_dim=32"),
    (lambda r: r["text_config"].pop("hidden_size"), "hidden_size"),
    (lambda r: r["vision_config"].update(out_hidden_size=2048), "out_hidden_size=2048"),
    (lambda r: r["vision_config"].update(num_position_embeddings=2300), "perfect square"),
])
def test_inconsistent_fields_name_the_field(change, needle):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(mutate(change))
    assert needle in str(e.value)


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_pretrained(tmp_path)


def test_config_is_frozen():
    cfg = ModelConfig.from_pretrained(REAL)
    with pytest.raises(AttributeError):
        cfg.text.hidden_size = 1  # type: ignore[misc]
    assert copy.deepcopy(cfg) == cfg

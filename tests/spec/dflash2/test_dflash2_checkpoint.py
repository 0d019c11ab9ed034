"""Loading dflash-format drafter checkpoints, and the drafter config's reading and checks."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from dflash2_oracle import RAW, Pair, raw_config
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from revolta.spec.dflash2 import DFlash2DraftConfig, DraftConfigError, load_draft_model
from revolta.spec.dflash2.checkpoint import save_draft_model
from revolta.weights import CheckpointError


def _same_state(model, reference) -> None:
    want = reference.state_dict()
    got = model.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_loads_the_oracles_saved_checkpoint(tmp_path):
    pair = Pair(seed=8)
    pair.oracle.save_pretrained(tmp_path)
    model = load_draft_model(tmp_path)
    assert model.cfg == pair.cfg
    _same_state(model, pair.oracle)


def test_loads_the_released_codebook_names(tmp_path):
    """Released checkpoints name the codebooks without `.weight` (dflash maps them with key_mapping)."""
    pair = Pair(seed=8)
    state = {(k[: -len(".weight")] if "codebook" in k else k): v for k, v in pair.oracle.state_dict().items()}
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(RAW))
    _same_state(load_draft_model(tmp_path), pair.oracle)


def test_round_trip_through_our_writer_loads_in_the_oracle(tmp_path):
    pair = Pair(seed=9)
    save_draft_model(pair.model, tmp_path)
    from dflash.model import DFlash2DraftModel as Oracle

    oracle = Oracle.from_pretrained(tmp_path).eval()
    _same_state(pair.model, oracle)
    assert oracle.target_layer_ids == list(pair.cfg.target_layer_ids)
    assert [a.self_attn.is_causal for a in oracle.layers] == [pair.cfg.layer_is_causal(i) for i in range(3)]
    assert [a.self_attn.sliding_window for a in oracle.layers] == [pair.cfg.layer_window(i) for i in range(3)]
    assert DFlash2DraftConfig.from_pretrained(tmp_path) == pair.cfg


def test_mismatched_checkpoint_names_every_problem_before_loading(tmp_path):
    pair = Pair(seed=8)
    pair.oracle.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["layers.1.mlp_conv.base_kernel"]
    state["layers.0.extra.weight"] = torch.zeros(2)
    state["fc.weight"] = torch.zeros(32, 64)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        load_draft_model(tmp_path)
    msg = str(e.value)
    assert "layers.1.mlp_conv.base_kernel" in msg and "missing" in msg
    assert "layers.0.extra.weight" in msg and "unexpected" in msg
    assert "fc.weight: checkpoint shape [32, 64], expected [32, 96]" in msg


def test_config_defaults_follow_dflash():
    raw = copy.deepcopy(RAW)
    del raw["dflash_config"]["target_layer_ids"], raw["layer_types"]
    raw["dflash_config"].pop("block_size")
    raw["max_window_layers"] = 1
    cfg = DFlash2DraftConfig.from_dict(raw)
    from dflash.model import DFlash2DraftModel as Oracle

    oracle = Oracle(Qwen3Config(**copy.deepcopy(raw)))
    assert list(cfg.target_layer_ids) == oracle.target_layer_ids == [1, 3, 5]
    assert cfg.block_size == oracle.block_size == 16
    assert cfg.layer_types == tuple(oracle.config.layer_types)
    assert cfg.tap_reduction == "hc_read"
    # fields may sit at the top level instead of dflash_config
    top = copy.deepcopy(RAW)
    top.update(top.pop("dflash_config"))
    assert DFlash2DraftConfig.from_dict(top) == DFlash2DraftConfig.from_dict(RAW)


@pytest.mark.parametrize("change, message", [
    ({"target_layer_ids": [1, 8]}, "target_layer_ids [8] do not exist in a target with 8 layers"),
    ({"target_layer_ids": [2, 2]}, "must be distinct"),
    ({"mask_token_id": 96}, "mask_token_id=96 is outside the vocabulary"),
    ({"conv_group_size": 5}, "conv_group_size=5 does not divide hidden_size=32"),
    ({"block_size": 1}, "block_size=1 drafts nothing"),
    ({"tap_reduction": "first"}, "tap_reduction='first'; use one of ['hc_read', 'stream_mean', 'stream0']"),
    ({"selector_rank": None}, "selector_rank is missing"),
])
def test_config_errors_name_the_field(change, message):
    with pytest.raises(DraftConfigError, match=None) as e:
        DFlash2DraftConfig.from_dict(raw_config(**change))
    assert message in str(e.value)


def test_sliding_layers_need_a_window():
    raw = raw_config()
    raw["use_sliding_window"] = False
    with pytest.raises(DraftConfigError, match="sliding_attention layers but no window"):
        DFlash2DraftConfig.from_dict(raw)


def test_check_target_rejects_another_width():
    cfg = DFlash2DraftConfig.from_dict(raw_config())
    with pytest.raises(DraftConfigError, match="hidden_size=32 but the target's is 64"):
        cfg.check_target(8, 64, 96)

"""ParallelConfig validation against the real geometry (tests/data) and the tiny config: legal layouts pass,
each illegal one raises ParallelConfigError naming the value and the fix."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from revolta.config import ModelConfig
from revolta.parallel import ParallelConfig, ParallelConfigError, check_world_size, validate_parallel

REAL = Path(__file__).resolve().parents[1] / "data" / "qwen3_8_flash_next_config.json"


@pytest.fixture(scope="module")
def real():
    return ModelConfig.from_pretrained(REAL)


@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 1), (4, 1), (4, 2), (8, 4)])
def test_legal_layouts_of_the_real_model(real, tp, dcp):
    validate_parallel(ParallelConfig(tp, dcp), real)


@pytest.mark.parametrize("tp,dcp,needle", [
    (3, 1, "does not divide text_config.linear_num_key_heads=16"),  # 24 query heads split 3 ways, 16 GDN key heads not
    (16, 1, "does not divide text_config.num_attention_heads=24"),
    (4, 4, "decode_context_parallel_size=4 exceeds tensor_parallel_size / num_key_value_heads = 4 / 2"),
    (2, 2, "use at most 1"),
])
def test_illegal_layouts_name_the_fix(real, tp, dcp, needle):
    with pytest.raises(ParallelConfigError) as e:
        validate_parallel(ParallelConfig(tp, dcp), real)
    assert needle in str(e.value)


def test_kv_heads_and_tp_must_divide_one_another(real):
    cfg = replace(real, text=replace(real.text, num_key_value_heads=3, num_attention_heads=24))
    with pytest.raises(ParallelConfigError, match="must divide one another"):
        validate_parallel(ParallelConfig(2), cfg)
    validate_parallel(ParallelConfig(1), cfg)  # tp=1 splits nothing


def test_a_dcp_group_shares_one_kv_head(real):
    # 4 KV heads at TP12: 3 ranks per head; DCP2 would pair a rank of head 0 with one of head 1 (a compress ratio of 6
    # so that DCP3 also stripes whole index groups)
    cfg = replace(real, text=replace(real.text, num_key_value_heads=4, linear_num_key_heads=12,
                                     linear_num_value_heads=48, moe_intermediate_size=648,
                                     shared_expert_intermediate_size=648, indexer_compress_ratio=6,
                                     indexer_budget=2046))
    validate_parallel(ParallelConfig(12, 3), cfg)
    with pytest.raises(ParallelConfigError, match="does not divide tensor_parallel_size / num_key_value_heads = 3"):
        validate_parallel(ParallelConfig(12, 2), cfg)


def test_dcp_must_divide_the_indexer_compress_ratio(real):
    """The DCP kernel gives each rank ratio / dcp tokens of every compressed index group: a dcp that does not divide
    the ratio is refused here, before weights load, naming the sizes that work (not at the first forward)."""
    validate_parallel(ParallelConfig(8, 4), real)  # ratio 4: DCP4 stripes one token of each group per rank
    cfg = replace(real, text=replace(real.text, indexer_compress_ratio=6, indexer_budget=2046))
    validate_parallel(ParallelConfig(8, 2), cfg)
    with pytest.raises(ParallelConfigError) as e:
        validate_parallel(ParallelConfig(8, 4), cfg)
    msg = str(e.value)
    assert "decode_context_parallel_size=4 does not divide" in msg and "indexer_compress_ratio=6" in msg
    assert msg.endswith("use a decode_context_parallel_size among 1, 2")


@pytest.mark.parametrize("kw,needle", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size=0 must be an integer >= 1"),
    (dict(decode_context_parallel_size=0), "decode_context_parallel_size=0 must be an integer >= 1"),
    (dict(tensor_parallel_size=4, decode_context_parallel_size=3), "pick a divisor of 4 (1, 2, 4)"),
    (dict(tensor_parallel_size=2.0), "must be an integer"),
])
def test_config_itself_rejects_nonsense(kw, needle):
    with pytest.raises(ParallelConfigError) as e:
        ParallelConfig(**kw)
    assert needle in str(e.value)


def test_quantized_split_keeps_whole_groups(real):
    from revolta.quant.config import QuantConfig, WeightScheme

    def with_group(g):
        rules = ((("*",), WeightScheme("awq", 4, g, False)),)
        return replace(real, quantization=QuantConfig(method="awq", rules=rules))

    validate_parallel(ParallelConfig(4), with_group(32))  # 640 / 4 = 160 = 5 groups of 32
    validate_parallel(ParallelConfig(4), with_group(-1))  # per-channel: no group to break
    with pytest.raises(ParallelConfigError, match="experts' down_proj's input .* parts of 160, not a multiple of"):
        validate_parallel(ParallelConfig(4), with_group(128))


def test_world_size_against_visible_devices():
    check_world_size(ParallelConfig(4, 2), 4)
    with pytest.raises(ParallelConfigError, match="needs 4 devices but 2 are visible"):
        check_world_size(ParallelConfig(4, 2), 2)

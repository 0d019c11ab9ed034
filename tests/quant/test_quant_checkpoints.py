"""Quantized checkpoints written by the tools (quant_checkpoints.py) load through `revolta.load_model`, keep their
weights packed, and give the logits of the same model with the tool-dequantized weights in fp32; unknown
formats and mismatched shapes fail before any weight is read.

Tolerances: against the tool-dequantized fp32 model, relative max error <= 1e-5 (the same products, a
different BLAS blocking); against the unquantized original (random weights, the worst case for 4-bit
formats: no structure, 64-wide layers), relative max error <= 0.3 and cosine >= 0.97 (measured 0.13-0.19
and >= 0.99 on this model).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from quant_checkpoints import FORMATS, write_quantized
from tiny_configs import T4_TEXT

from revolta.config import ConfigError, ModelConfig
from revolta.layers.linear import QuantLinear
from revolta.layers.quant_moe import QuantExperts
from revolta.model import FlashNextModel, init_random_weights, load_model
from revolta.weights import CheckpointError

TINY_MTP = dict(T4_TEXT, model_type="qwen4_exp_text", mtp_num_hidden_layers=1)


@pytest.fixture(scope="module")
def original():
    model = FlashNextModel(ModelConfig.from_dict(TINY_MTP)).eval()
    init_random_weights(model, seed=3)
    return model


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, T4_TEXT["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("fmt,fused", [(f, False) for f in FORMATS] + [("awq", True), ("modelopt-nvfp4", True)])
def test_loads_packed_and_matches_the_dequantized_model(original, ids, tmp_path, fmt, fused):
    oracle_state = write_quantized(original, tmp_path, fmt, fused_experts=fused)
    model = load_model(tmp_path, progress=False)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    experts = [m for m in model.modules() if isinstance(m, QuantExperts)]
    assert len(experts) == 5 and len(linears) > 20  # 4 trunk + 1 MTP expert banks; MTP fc_* quantized too
    assert model.mtp.fc_hidden in linears
    for m in linears:  # packed: no 16-bit weight anywhere (ModelOpt's uint8 codes are called `weight`)
        assert all(not t.is_floating_point() or t.numel() * 4 <= m.in_features * m.out_features
                   for t in m.packed().values())
    oracle = FlashNextModel(ModelConfig.from_dict(TINY_MTP)).eval()
    oracle.load_state_dict(oracle_state)
    with torch.no_grad():
        got, want, orig = model(ids), oracle(ids), original(ids)
        assert _rel(got, want) <= 1e-5
        assert _rel(got, orig) <= 0.3
        assert torch.nn.functional.cosine_similarity(got.flatten(), orig.flatten(), dim=0) >= 0.97
        hidden = torch.randn(3, model.cfg.text.wide_size, generator=torch.Generator().manual_seed(1))
        args = (hidden, ids[0, :3], torch.arange(3).expand(3, -1), [0, 3])
        from revolta.state import SequenceState
        assert _rel(model.mtp_forward(*args, [SequenceState()])[0], oracle.mtp_forward(*args, [SequenceState()])[0]) <= 1e-5


def test_fp16_model_keeps_checkpoint_dtypes_of_packed_tensors(original, tmp_path):
    write_quantized(original, tmp_path, "ct-nvfp4")
    model = load_model(tmp_path, dtype=torch.float16, progress=False)
    lin = model.model.language_model.layers[0].linear_attn.in_proj_qkv
    assert lin.weight_packed.dtype == torch.uint8 and lin.weight_scale.dtype == torch.float8_e4m3fn
    assert lin.weight_global_scale.dtype == torch.float32
    assert model.model.language_model.layers[0].linear_attn.in_proj_b.weight.dtype == torch.float16  # kept 16-bit


def _config(path):
    return json.loads((path / "config.json").read_text())


def test_unknown_quant_method_is_refused_at_configuration_time(original, tmp_path):
    write_quantized(original, tmp_path, "awq")
    raw = _config(tmp_path)
    raw["quantization_config"] = {"quant_method": "FP4-Local", "group_size": 16}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="'FP4-Local' is not supported.*'awq'.*'compressed-tensors'.*'modelopt'"):
        ModelConfig.from_pretrained(tmp_path)
    raw.pop("quantization_config")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP4-Local"}}))
    with pytest.raises(ConfigError, match="quant_algo='FP4-Local' is not supported.*NVFP4"):
        ModelConfig.from_pretrained(tmp_path)


def test_format_comes_from_the_config_not_the_directory_name(original, tmp_path):
    d = tmp_path / "Model-AWQ-int4"
    write_quantized(original, d, "ct-nvfp4")
    assert ModelConfig.from_pretrained(d).quantization.describe().startswith("compressed-tensors: ct-nvfp4")


def test_module_the_format_cannot_store_is_named_before_loading(original, tmp_path):
    write_quantized(original, tmp_path, "awq")
    raw = _config(tmp_path)
    raw["quantization_config"]["modules_to_not_convert"] = ["mlp.gate"]  # b/a (4 outputs) left quantized
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"layers\.0\.linear_attn\.in_proj_b \[4, 64\]: awq packs 8 output"):
        load_model(tmp_path, progress=False)


def test_mismatched_packed_shape_names_the_tensor_before_any_weight_moves(original, tmp_path, monkeypatch):
    write_quantized(original, tmp_path, "ct-int4")
    raw = _config(tmp_path)
    raw["text_config"]["moe_intermediate_size"] = 64  # the config disagrees with the stored experts
    (tmp_path / "config.json").write_text(json.dumps(raw))
    import revolta.weights as weights

    def no_copy(*a, **k):
        raise AssertionError("a weight was read before the checkpoint was checked")

    monkeypatch.setattr(weights, "_copy_piece", no_copy)
    with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.experts\.0\.gate_proj\.weight_packed: checkpoint "
                                              r"shape \[32, 8\], expected \[64, 8\]"):
        load_model(tmp_path, progress=False)


def test_llm_loads_each_format(original, tmp_path, monkeypatch):
    from revolta import LLM, SamplingParams

    monkeypatch.delenv("REVOLTA_SPLITK_FIXUP", raising=False)

    for fmt in ("awq", "ct-nvfp4"):
        d = tmp_path / fmt
        write_quantized(original, d, fmt)
        llm = LLM(model=str(d), seed=0, max_model_len=64, speculative_config={"method": None})
        out = llm.generate({"prompt_token_ids": [1, 2, 3, 4]}, SamplingParams(temperature=0, max_tokens=4),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        # the start-up table says how the packed kernels reduce their K slices (opt-in FIXUP: RESULTS.md K5l)
        rows = {name: (value, source) for name, value, source in llm.effective_config()}
        assert rows["packed split-K reduce"] == ("reduce launches", "default (opt-in: REVOLTA_SPLITK_FIXUP=1)")
        shutil.rmtree(d)


def test_greedy_speculation_equals_no_speculation_on_a_quantized_checkpoint(original, tmp_path):
    from revolta import LLM, SamplingParams

    write_quantized(original, tmp_path, "awq")
    params = SamplingParams(temperature=0, max_tokens=12)
    prompts = [{"prompt_token_ids": [5, 17, 300, 42, 8]}, {"prompt_token_ids": list(range(40, 60))}]
    spec = LLM(model=str(tmp_path), seed=0, max_model_len=64)  # MTP4: the checkpoint has a (quantized) MTP layer
    assert spec.speculative_config.enabled and isinstance(spec.model.mtp.fc_hidden, QuantLinear)
    a = spec.generate(prompts, params, use_tqdm=False)
    plain = LLM(model=str(tmp_path), seed=0, max_model_len=64, speculative_config={"method": None})
    b = plain.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert a[0].metrics.spec_decode.num_draft_tokens > 0


def test_info_prints_format_and_weight_bytes_per_gpu(original, tmp_path, capsys):
    from revolta.cli import main
    from revolta.layers.quantize import weight_bytes_per_gpu
    from revolta.quantized import meta_model

    write_quantized(original, tmp_path, "awq")
    # the tiny experts (width 32, one group of 32) cannot split at TP2: info says so in one line
    assert main(["info", str(tmp_path), "--tp", "2", "--gpu-memory", "4", "--max-model-len", "256"]) == 2
    assert "not a multiple of the checkpoint's quantization group 32" in capsys.readouterr().err
    assert main(["info", str(tmp_path), "--gpu-memory", "4", "--max-model-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "quantization: awq: awq int4, group size 32, zero points" in out
    cfg = ModelConfig.from_pretrained(tmp_path)
    sizes = {tp: weight_bytes_per_gpu(meta_model(cfg), tp) for tp in (1, 2, 4)}  # the estimate a split would give
    assert "weights per GPU at TP1:" in out
    assert "weights per GPU at TP2: cannot split (tensor_parallel_size=2 splits experts' down_proj" in out
    assert "weights per GPU at TP4: cannot split (tensor_parallel_size=4 does not divide" in out
    packed = sum(t.numel() * t.element_size() for n, t in load_model(tmp_path, progress=False).state_dict().items()
                 if n.endswith((".qweight", ".qzeros", ".scales")))
    assert sizes[1]["packed"] == packed and sizes[4]["packed"] == packed // 4
    assert sizes[2]["dense_replicated"] == sizes[1]["dense_replicated"] > 0  # HC and PLE modules on every rank
    from revolta.summary import human_bytes
    assert f"- weights {human_bytes(sizes[1]['total'])} -" in out  # the dry run plans with the packed bytes


def test_random_quantized_model_for_benchmarks():
    from revolta.quantized import random_quantized_model

    model = random_quantized_model(ModelConfig.from_dict(TINY_MTP), device="cpu", dtype=torch.float32)
    lin = model.model.language_model.layers[0].linear_attn.in_proj_qkv
    assert isinstance(lin, QuantLinear) and lin.qweight.dtype == torch.int32 and lin.qweight.device.type == "cpu"
    w = lin.dequantize()
    assert 0.5 * 64 ** -0.5 < w.std() < 2 * 64 ** -0.5  # about 1/sqrt(fan-in), like init_random_weights
    logits = model(torch.tensor([[1, 2, 3]]))
    assert logits.isfinite().all() and logits.std() > 0



def test_random_quantized_model_with_a_random_fp8_ple_table_in_host_memory():
    from revolta.ple.load import ple_embeddings
    from revolta.ple.random_table import attach_random_tables
    from revolta.ple.table import PLETable
    from revolta.quantized import random_quantized_model

    model = random_quantized_model(ModelConfig.from_dict(TINY_MTP), device="cpu", dtype=torch.float32,
                                   ple_table="host")
    embs = [e for _, _, e in ple_embeddings(model)]
    assert embs and not any("ngram_embedding" in n for n in model.state_dict())  # the 16-bit weight never existed
    for emb in embs:
        t = emb.table
        assert isinstance(t, PLETable) and t.placement == "host" and t.weight.dtype == torch.float8_e4m3fn
        assert t.weight.shape == (emb.num_rows, emb.head_dim) and float(t.scale) == 1.0
        assert 0.8 < t.weight.float().std() < 1.2  # ~N(0, 1) like init_random_weights' embeddings
    logits = model(torch.tensor([[1, 2, 3, 4, 5]]))
    assert logits.isfinite().all() and logits.std() > 0
    with pytest.raises(ValueError, match="needs table shards on disk"):
        attach_random_tables(model, "disk", "cpu")

def test_awq_layout_agrees_with_autoawq_and_the_description():
    import awq_reference

    from revolta.kernels.quant.awq import awq_dequantize_ref

    if awq_reference.autoawq_packing_utils() is None:
        pytest.skip("autoawq is not installed (.ci/run installs it with --no-deps)")
    w = torch.randn(40, 128, generator=torch.Generator().manual_seed(0))
    t = awq_reference.quantize(w, 32)
    theirs = awq_reference.dequantize_with_autoawq(t, 32)
    assert torch.equal(theirs, awq_reference.dequantize(t, 32))
    assert torch.equal(awq_dequantize_ref(t["qweight"], t["qzeros"], t["scales"], 32), theirs)
    assert (theirs - w).abs().max() <= t["scales"].float().max() / 2 + 1e-6  # within half a step

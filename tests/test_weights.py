"""Checkpoint I/O (revolta.weights): HF-saved tiny checkpoints, round trips, renames, FP8, errors, memory."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from revolta import weights
from revolta.weights import CheckpointError, dequantize_block_fp8, load_weights, materialize, save_checkpoint

T = "model.language_model."
PLE = T + "layers.1.ple.ple_embedding."
MULTIPLIERS = [23703573157769, 20109073645365, 8052911324071]  # spec §5.2: need all 64 bits


# ---------------------------------------------------------------------------------------------- helpers


class _NGram(nn.Module):
    """Stand-in for the PLE n-gram embedding: a table plus the three derived int64 buffers."""

    def __init__(self, rows: int, dim: int, hook: bool):
        super().__init__()
        self.ngram_embedding = nn.Embedding(rows, dim)
        self.register_buffer("layer_multipliers", torch.zeros(3, dtype=torch.int64))
        self.register_buffer("ngram_heads_vocab_sizes", torch.zeros(4, dtype=torch.int64))
        self.register_buffer("ngram_heads_offsets", torch.zeros(4, dtype=torch.int64))
        if hook:
            self.init_buffers = self._init_buffers
        if not self.layer_multipliers.is_meta:
            self._init_buffers()

    def _init_buffers(self) -> None:
        self.layer_multipliers.copy_(torch.tensor(MULTIPLIERS))
        self.ngram_heads_vocab_sizes.copy_(torch.tensor([11, 13, 17, 19]))
        self.ngram_heads_offsets.copy_(torch.tensor([0, 11, 24, 41]))


def _put(root: nn.Module, name: str, value: nn.Module | torch.Tensor, buffer: bool = False) -> None:
    *path, leaf = name.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if isinstance(value, nn.Module):
        mod.add_module(leaf, value)
    elif buffer:
        mod.register_buffer(leaf, value)
    else:
        mod.register_parameter(leaf, nn.Parameter(value))


def tiny_tree(*, mtp: bool = True, hook: bool = True, ple_rows: int = 48) -> nn.Module:
    """A small module tree with official-looking names: GDN fp32 params, grouped experts, PLE, lm_head, mtp."""
    m = nn.Module()
    _put(m, T + "embed_tokens.weight", torch.randn(64, 16))
    _put(m, T + "layers.0.linear_attn.A_log", torch.randn(4))
    _put(m, T + "layers.0.linear_attn.dt_bias", torch.randn(4))
    _put(m, T + "layers.0.linear_attn.in_proj_qkv.weight", torch.randn(24, 16))
    _put(m, T + "layers.0.mlp.experts.gate_up_proj", torch.randn(4, 16, 16))  # [E, 2I, H], I = 8
    _put(m, T + "layers.0.mlp.experts.down_proj", torch.randn(4, 16, 8))  # [E, H, I]
    _put(m, PLE[:-1], _NGram(ple_rows, 8, hook))
    _put(m, T + "hyper_connection_mixer.hc_norm.weight", torch.randn(64))
    _put(m, "lm_head.weight", torch.randn(64, 16))
    if mtp:
        _put(m, "mtp.fc_hidden.weight", torch.randn(16, 16))
    return m


def meta_tree(**kw) -> nn.Module:
    with torch.device("meta"):
        return tiny_tree(**kw)


def _disk(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for name, file in weights.checkpoint_files(path).items():
        with safe_open(file, framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# ---------------------------------------------------------------------------------------------- round trips


def test_round_trip_sharded_ple_into_meta_model(tmp_path):
    torch.manual_seed(0)
    src = tiny_tree()
    save_checkpoint(src, tmp_path, max_shard_bytes=2048, split_ngram_parts=3, progress=False)
    index = json.loads((tmp_path / weights.INDEX_FILE).read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2 and all((tmp_path / f).is_file() for f in files)
    assert not (tmp_path / weights.SINGLE_FILE).exists()
    names = set(index["weight_map"])
    assert {PLE + f"ngram_embedding.shard_{s}.weight" for s in range(3)} <= names
    assert PLE + "ngram_embedding.weight" not in names
    assert _disk(tmp_path)[PLE + "ngram_embedding.shard_1.weight"].shape == (16, 8)

    dst = meta_tree(hook=False)  # every buffer must come from disk
    load_weights(dst, tmp_path, dtype=torch.bfloat16, progress=False)
    out, ref = dst.state_dict(), src.state_dict()
    assert sorted(out) == sorted(ref)
    for k, v in out.items():
        if k.endswith(("A_log", "dt_bias")):
            assert v.dtype == torch.float32 and torch.equal(v, ref[k]), k
        elif ref[k].is_floating_point():
            assert v.dtype == torch.bfloat16 and torch.equal(v, ref[k].bfloat16()), k
        else:
            assert v.dtype == torch.int64 and torch.equal(v, ref[k]), k
    assert out[PLE + "layer_multipliers"].tolist() == MULTIPLIERS
    assert not any(t.is_meta for t in dst.state_dict().values())


def test_single_file_when_it_fits_and_stale_files_are_replaced(tmp_path):
    save_checkpoint(tiny_tree(), tmp_path, max_shard_bytes=2048, progress=False)
    assert (tmp_path / weights.INDEX_FILE).exists()
    torch.manual_seed(1)
    src = tiny_tree()
    save_checkpoint(src, tmp_path, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [weights.SINGLE_FILE]
    assert PLE + "ngram_embedding.shard_0.weight" in _disk(tmp_path)  # one part is still written as shard_0
    dst = tiny_tree()
    load_weights(dst, tmp_path / weights.SINGLE_FILE, progress=False)
    _assert_same(dst.state_dict(), src.state_dict())


def test_plain_table_lm_head_alias_and_ignored_mixer_inject(tmp_path):
    src = tiny_tree()
    sd = {k: v.detach().clone() for k, v in src.state_dict().items()}
    sd["model.lm_head.weight"] = sd.pop("lm_head.weight")  # some exports nest lm_head under model.
    sd[T + "hyper_connection_mixer.block_inject_weight.weight"] = torch.randn(4, 64)  # spec §2.3: unused
    save_file(sd, tmp_path / "model.safetensors")
    dst = tiny_tree()
    load_weights(dst, tmp_path, progress=False)
    _assert_same(dst.state_dict(), src.state_dict())


def test_tied_weights_round_trip(tmp_path):
    src = tiny_tree()
    src.lm_head.weight = src.model.language_model.embed_tokens.weight
    save_checkpoint(src, tmp_path, progress=False)
    dst = tiny_tree()
    dst.lm_head.weight = dst.model.language_model.embed_tokens.weight
    load_weights(dst, tmp_path, progress=False)
    _assert_same(dst.state_dict(), src.state_dict())
    assert dst.lm_head.weight is dst.model.language_model.embed_tokens.weight


def test_skip_prefixes(tmp_path):
    src = tiny_tree(mtp=True)
    save_checkpoint(src, tmp_path, progress=False)
    with pytest.raises(CheckpointError, match=r"1 unexpected tensors.*:\n  mtp\.fc_hidden\.weight$"):
        load_weights(tiny_tree(mtp=False), tmp_path, progress=False)
    dst = tiny_tree(mtp=False)
    load_weights(dst, tmp_path, skip_prefixes=("mtp.",), progress=False)
    assert torch.equal(dst.lm_head.weight, src.lm_head.weight)
    # a model with MTP, asked not to load it: nothing missing, the module is left alone
    dst = tiny_tree(mtp=True)
    before = dst.mtp.fc_hidden.weight.clone()
    load_weights(dst, tmp_path, skip_prefixes=("mtp.",), progress=False)
    assert torch.equal(dst.mtp.fc_hidden.weight, before)


def test_derived_int64_buffers_may_be_absent(tmp_path):
    src = tiny_tree()
    sd = {k: v for k, v in src.state_dict().items() if not k.startswith(PLE + "l") and "heads" not in k}
    save_file(sd, tmp_path / "model.safetensors")
    dst = meta_tree(hook=True)  # init_buffers re-derives them after materialising
    load_weights(dst, tmp_path, progress=False)
    assert dst.get_buffer(PLE + "layer_multipliers").tolist() == MULTIPLIERS
    # without a hook, a meta model has nothing to fall back on: they are missing
    with pytest.raises(CheckpointError, match="missing") as e:
        load_weights(meta_tree(hook=False), tmp_path, progress=False)
    assert "layer_multipliers" in str(e.value) and "ngram_heads_offsets" in str(e.value)


def test_materialize_casts_and_keeps_ties():
    m = meta_tree()
    m.lm_head.weight = m.model.language_model.embed_tokens.weight
    materialize(m, "cpu", torch.float16)
    sd = m.state_dict()
    assert m.lm_head.weight is m.model.language_model.embed_tokens.weight
    assert sd[T + "layers.0.linear_attn.A_log"].dtype == torch.float32
    assert sd[T + "embed_tokens.weight"].dtype == torch.float16
    assert sd[PLE + "layer_multipliers"].tolist() == MULTIPLIERS  # re-derived by the hook
    assert not any(t.is_meta for t in sd.values())


# ---------------------------------------------------------------------------------------------- errors


def test_missing_shard_file_is_named(tmp_path):
    save_checkpoint(tiny_tree(), tmp_path, max_shard_bytes=2048, progress=False)
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        load_weights(tiny_tree(), tmp_path, progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json or model.safetensors"):
        load_weights(tiny_tree(), tmp_path / "empty", progress=False)


def test_wrong_shape_names_both_shapes_and_loads_nothing(tmp_path):
    sd = dict(tiny_tree().state_dict())
    sd[T + "layers.0.linear_attn.in_proj_qkv.weight"] = torch.randn(25, 16)
    save_file(sd, tmp_path / "model.safetensors")
    dst = tiny_tree()
    before = dst.lm_head.weight.clone()
    with pytest.raises(CheckpointError) as e:
        load_weights(dst, tmp_path, progress=False)
    assert "layers.0.linear_attn.in_proj_qkv.weight: checkpoint shape [25, 16], expected [24, 16]" in str(e.value)
    assert torch.equal(dst.lm_head.weight, before)  # validation happens before any data is copied


def test_missing_and_unexpected_in_one_error(tmp_path):
    sd = dict(tiny_tree().state_dict())
    del sd[T + "hyper_connection_mixer.hc_norm.weight"]
    del sd[T + "layers.0.linear_attn.dt_bias"]
    sd["model.language_model.layers.0.linear_attn.bogus.weight"] = torch.zeros(2)
    sd[T + "layers.0.mlp.experts.gate_up_proj_extra"] = torch.zeros(2)
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        load_weights(tiny_tree(), tmp_path, progress=False)
    msg = str(e.value)
    assert "2 model tensors missing" in msg and "2 unexpected tensors" in msg
    for name in ("hyper_connection_mixer.hc_norm.weight", "linear_attn.dt_bias", "linear_attn.bogus.weight",
                 "experts.gate_up_proj_extra"):
        assert name in msg
    assert msg.index("hyper_connection_mixer.hc_norm") < msg.index("layers.0.linear_attn.dt_bias")  # sorted


def test_long_lists_are_truncated(tmp_path):
    sd = dict(tiny_tree().state_dict())
    for i in range(60):
        sd[f"extra.{i:03d}.weight"] = torch.zeros(1)
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"(?s)60 unexpected .*\n  extra\.000\.weight\n.*\n  \.\.\. and 35 more"):
        load_weights(tiny_tree(), tmp_path, progress=False)


def test_duplicate_names_and_ple_gaps(tmp_path):
    sd = {k: v.clone() for k, v in tiny_tree().state_dict().items()}
    sd["model.lm_head.weight"] = sd["lm_head.weight"].clone()
    table = sd.pop(PLE + "ngram_embedding.weight")
    sd[PLE + "ngram_embedding.shard_0.weight"] = table[:24].clone()
    sd[PLE + "ngram_embedding.shard_2.weight"] = table[24:].clone()
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        load_weights(tiny_tree(), tmp_path, progress=False)
    msg = str(e.value)
    assert "lm_head.weight <- ['lm_head.weight', 'model.lm_head.weight']" in msg
    assert "missing shard_[1]" in msg


def test_integer_buffer_stored_as_float_is_rejected(tmp_path):
    sd = dict(tiny_tree().state_dict())
    sd[PLE + "layer_multipliers"] = sd[PLE + "layer_multipliers"].float()  # what a careless converter does
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="layer_multipliers: checkpoint dtype torch.float32"):
        load_weights(tiny_tree(), tmp_path, progress=False)


# ---------------------------------------------------------------------------------------------- experts, FP8


def _reference_dequant(w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = torch.empty(w8.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1))
            out[rows, cols] = w8[rows, cols].float() * scale[i, j]
    return out


def _expert_model(E: int, H: int, I: int) -> nn.Module:
    m = nn.Module()
    _put(m, T + "layers.0.mlp.experts.gate_up_proj", torch.zeros(E, 2 * I, H, dtype=torch.bfloat16))
    _put(m, T + "layers.0.mlp.experts.down_proj", torch.zeros(E, H, I, dtype=torch.bfloat16))
    return m


@pytest.mark.parametrize("chunk", [None, 40_000])
def test_per_expert_split_keys_and_block_fp8(tmp_path, monkeypatch, chunk):
    if chunk:  # exercise row-chunked copies and mapping reopening on the same tensors
        monkeypatch.setattr(weights, "CHUNK_BYTES", chunk)
        monkeypatch.setattr(weights, "MAP_BYTES", chunk)
    torch.manual_seed(0)
    E, H, I = 3, 200, 260  # odd sizes: partial 128-blocks on both axes
    base = T + "layers.0.mlp.experts."
    bf = {f"{base}{e}.{p}.weight": torch.randn(shape).bfloat16()
          for e in range(E) for p, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I)))}
    # expert 1 gate and down exported as block FP8; the down scale sits in another shard file
    w8_gate = (torch.randn(I, H) * 40).to(torch.float8_e4m3fn)
    s_gate = torch.rand(math.ceil(I / 128), math.ceil(H / 128)) + 0.5
    w8_down = (torch.randn(H, I) * 40).to(torch.float8_e4m3fn)
    s_down = torch.rand(math.ceil(H / 128), math.ceil(I / 128)) + 0.5
    bf[f"{base}1.gate_proj.weight"] = w8_gate
    bf[f"{base}1.down_proj.weight"] = w8_down
    first = {k: v for k, v in bf.items() if ".0." in k or ".1." in k} | {f"{base}1.gate_proj.weight_scale_inv": s_gate}
    second = {k: v for k, v in bf.items() if k not in first} | {f"{base}1.down_proj.weight_scale_inv": s_down}
    save_file(first, tmp_path / "a.safetensors")
    save_file(second, tmp_path / "b.safetensors")
    wm = {k: "a.safetensors" for k in first} | {k: "b.safetensors" for k in second}
    (tmp_path / weights.INDEX_FILE).write_text(json.dumps({"weight_map": wm}))

    m = _expert_model(E, H, I)
    load_weights(m, tmp_path, progress=False)
    gate_up = m.get_parameter(base + "gate_up_proj")
    down = m.get_parameter(base + "down_proj")
    for e in (0, 2):
        assert torch.equal(gate_up[e, :I], bf[f"{base}{e}.gate_proj.weight"])  # gate rows first
        assert torch.equal(gate_up[e, I:], bf[f"{base}{e}.up_proj.weight"])
        assert torch.equal(down[e], bf[f"{base}{e}.down_proj.weight"])
    assert torch.equal(gate_up[1, :I], _reference_dequant(w8_gate, s_gate).bfloat16())
    assert torch.equal(gate_up[1, I:], bf[f"{base}1.up_proj.weight"])
    assert torch.equal(down[1], _reference_dequant(w8_down, s_down).bfloat16())


def test_more_experts_on_disk_than_in_the_model(tmp_path):
    base = T + "layers.0.mlp.experts."
    sd = {f"{base}{e}.{p}.weight": torch.zeros(shape) for e in range(3)
          for p, shape in (("gate_proj", (4, 6)), ("up_proj", (4, 6)), ("down_proj", (6, 4)))}
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"experts\.2\.gate_proj\.weight: .*proj\[2, 0:4\] is out of range"):
        load_weights(_expert_model(2, 6, 4), tmp_path, progress=False)


def test_fp8_grouped_expert_tensor_and_bad_scales(tmp_path):
    E, H, I = 2, 136, 72
    w8 = (torch.randn(E, 2 * I, H) * 10).to(torch.float8_e4m3fn)
    scale = torch.rand(E, math.ceil(2 * I / 128), math.ceil(H / 128)) + 0.5
    base = T + "layers.0.mlp.experts."
    down = torch.randn(E, H, I).bfloat16()
    save_file({base + "gate_up_proj": w8, base + "gate_up_proj_scale_inv": scale, base + "down_proj": down},
              tmp_path / "model.safetensors")
    m = _expert_model(E, H, I)
    load_weights(m, tmp_path, progress=False)
    for e in range(E):
        assert torch.equal(m.get_parameter(base + "gate_up_proj")[e], _reference_dequant(w8[e], scale[e]).bfloat16())
    assert torch.equal(dequantize_block_fp8(w8, scale, torch.float32)[1], _reference_dequant(w8[1], scale[1]))

    save_file({base + "gate_up_proj": w8, base + "down_proj": down}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="gate_up_proj: torch.float8_e4m3fn without .*gate_up_proj_scale_inv"):
        load_weights(_expert_model(E, H, I), tmp_path, progress=False)
    bad_scale = scale[:, :1].contiguous()
    save_file({base + "gate_up_proj": w8, base + "gate_up_proj_scale_inv": bad_scale, base + "down_proj": down},
              tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"gate_up_proj_scale_inv: shape \[2, 1, 2\], expected \[2, 2, 2\]"):
        load_weights(_expert_model(E, H, I), tmp_path, progress=False)


def test_large_ple_table_is_filled_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(weights, "CHUNK_BYTES", 1000)
    monkeypatch.setattr(weights, "MAP_BYTES", 1000)
    src = tiny_tree(ple_rows=96)
    save_checkpoint(src, tmp_path, split_ngram_parts=4, progress=False)
    dst = meta_tree(ple_rows=96)
    load_weights(dst, tmp_path, dtype=torch.float16, progress=False)
    assert torch.equal(dst.get_parameter(PLE + "ngram_embedding.weight"),
                       src.get_parameter(PLE + "ngram_embedding.weight").half())


# ---------------------------------------------------------------------------------------------- memory

_MEM_SCRIPT = textwrap.dedent("""
    import sys, torch
    from torch import nn
    from revolta.weights import load_weights

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    with torch.device("meta"):
        m = nn.Module()
        m.layers = nn.ModuleList(nn.Linear(1024, 1024, bias=False) for _ in range(24))
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM)
    base = status("VmRSS")
    load_weights(m, sys.argv[1], progress=False)
    print(status("VmHWM") - base)
""")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS accounting")
@pytest.mark.parametrize("shard_bytes", [1 << 30, 30 << 20])
def test_meta_load_peak_rss_below_1_5x_checkpoint(tmp_path, shard_bytes):
    m = nn.Module()
    m.layers = nn.ModuleList(nn.Linear(1024, 1024, bias=False) for _ in range(24))  # 96 MiB fp32
    save_checkpoint(m, tmp_path, max_shard_bytes=shard_bytes, progress=False)
    size = sum(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
    del m
    out = subprocess.run([sys.executable, "-c", _MEM_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         check=True)
    peak = int(out.stdout.strip().splitlines()[-1])
    assert peak < 1.5 * size, f"peak RSS increase {peak / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB checkpoint"


# ---------------------------------------------------------------------------------------------- HF oracle


def _hf_config(split_ngram_parts: int):
    transformers = pytest.importorskip("transformers")
    tc = dict(vocab_size=512, eos_token_id=511, hidden_size=64, num_hidden_layers=4,
              layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4,
              num_key_value_heads=2, head_dim=32,
              rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                   mrope_section=[2, 1, 1], mrope_interleaved=True),
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
              hc_lowrank=16, ple_layer_ids=[2], ple_embed_dim=64, heads_per_ngram=2, ngram_vocab_size_base=97,
              make_ngram_vocab_size_divisible_by=8, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
              indexer_budget=8, indexer_compress_ratio=4, split_ngram_parts=split_ngram_parts,
              output_gate_type="sigmoid")
    vc = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, num_position_embeddings=16, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64)
    return transformers, transformers.Qwen4ExpConfig(
        text_config=tc, vision_config=vc, image_token_id=500, video_token_id=501, vision_start_token_id=502,
        vision_end_token_id=503)


@pytest.fixture(scope="module", params=[1, 3], ids=["ple1", "ple3"])
def hf_checkpoint(request, tmp_path_factory):
    """A tiny HF Qwen4Exp checkpoint written by save_pretrained in 200 KB shards (408 PLE rows: 3 | 408)."""
    transformers, cfg = _hf_config(request.param)
    torch.manual_seed(0)
    model = transformers.Qwen4ExpForConditionalGeneration(cfg)
    path = tmp_path_factory.mktemp(f"hf{request.param}")
    model.save_pretrained(path, max_shard_size="200KB")
    return transformers, cfg, path, {k: v.clone() for k, v in model.state_dict().items()}


def test_hf_save_pretrained_layout(hf_checkpoint):
    _, cfg, path, _ = hf_checkpoint
    names = set(json.loads((path / weights.INDEX_FILE).read_text())["weight_map"])
    parts = cfg.text_config.split_ngram_parts
    assert {PLE + f"ngram_embedding.shard_{s}.weight" for s in range(parts)} <= names  # shard_0 even for 1 part
    assert PLE + "ngram_embedding.weight" not in names
    assert T + "layers.0.mlp.experts.7.up_proj.weight" in names  # HF writes per-expert split keys
    assert T + "layers.0.mlp.experts.gate_up_proj" not in names
    assert PLE + "layer_multipliers" in names and len(list(path.glob("model-*.safetensors"))) > 3


def test_hf_checkpoint_into_hf_model(hf_checkpoint):
    transformers, cfg, path, ref = hf_checkpoint
    torch.manual_seed(1)
    model = transformers.Qwen4ExpForConditionalGeneration(cfg)
    load_weights(model, path, progress=False)
    _assert_same(model.state_dict(), ref)

    load_weights(model, path, dtype=torch.bfloat16, progress=False)
    sd = model.state_dict()
    assert sd[T + "layers.0.linear_attn.A_log"].dtype == torch.float32
    assert torch.equal(sd[T + "layers.0.linear_attn.A_log"], ref[T + "layers.0.linear_attn.A_log"])
    experts = T + "layers.2.mlp.experts.gate_up_proj"
    assert torch.equal(sd[experts], ref[experts].bfloat16())
    assert sd[PLE + "ngram_heads_offsets"].dtype == torch.int64


def test_hf_checkpoint_round_trips_through_save_checkpoint(hf_checkpoint, tmp_path):
    transformers, cfg, path, ref = hf_checkpoint
    save_checkpoint(ref, tmp_path, max_shard_bytes=300_000, split_ngram_parts=cfg.text_config.split_ngram_parts,
                    progress=False)
    model = transformers.Qwen4ExpForConditionalGeneration(cfg)
    load_weights(model, tmp_path, progress=False)
    _assert_same(model.state_dict(), ref)


def test_hf_meta_model_without_buffer_hooks_is_refused(hf_checkpoint):
    transformers, cfg, path, _ = hf_checkpoint
    with torch.device("meta"):
        model = transformers.Qwen4ExpForConditionalGeneration(cfg)
    with pytest.raises(CheckpointError, match=r"(?s)non-persistent buffers .*init_buffers\(\).*inv_freq"):
        load_weights(model, path, progress=False)


def _flash_next():
    from revolta.config import ModelConfig
    from revolta.model import FlashNextModel

    return FlashNextModel, ModelConfig


def test_hf_checkpoint_into_flash_next_model(hf_checkpoint):
    FlashNextModel, ModelConfig = _flash_next()
    _, _, path, ref = hf_checkpoint
    with torch.device("meta"):
        model = FlashNextModel(ModelConfig.from_pretrained(path))
    load_weights(model, path, progress=False)  # raises on any missing or unexpected name
    _assert_same(model.state_dict(), ref)


def test_flash_next_derives_ple_buffers_when_absent(hf_checkpoint, tmp_path):
    FlashNextModel, ModelConfig = _flash_next()
    _, _, path, ref = hf_checkpoint
    sd = {k: v for k, v in ref.items() if not k.startswith((PLE + "layer_", PLE + "ngram_heads_"))}
    assert len(sd) == len(ref) - 3
    save_checkpoint(sd, tmp_path, progress=False)
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with torch.device("meta"):
        model = FlashNextModel(ModelConfig.from_pretrained(tmp_path))
    load_weights(model, tmp_path, progress=False)
    _assert_same(model.state_dict(), ref)

"""Model configuration: one frozen description of a Qwen3.8-Flash-Next checkpoint.

`ModelConfig.from_pretrained(dir)` reads `config.json` in any of the layouts that ship
(spec/model.md §1.1): the composite `qwen3_8_flash_next` / legacy `qwen4_exp` config with
nested `text_config` and `vision_config`, and text-only exports whose text fields sit at
the top level. Every field is read from the file (class defaults of other libraries differ
from the real model), derived sizes are properties, and the consistency rules of
spec/model.md §12.4 are checked once, with errors that name the field and the fix.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .config_error import ConfigError

TOP_MODEL_TYPES = ("qwen3_8_flash_next", "qwen4_exp")
TEXT_MODEL_TYPES = ("qwen3_8_flash_next_text", "qwen4_exp_text")
VISION_MODEL_TYPES = ("qwen4_exp_vision", "qwen4_exp", "qwen3_8_flash_next", "qwen3_8_flash_next_vision")
ARCHITECTURES = (
    "Qwen4ExpForConditionalGeneration",
    "Qwen4ExpForCausalLM",
    "Qwen3_8_FlashNextForConditionalGeneration",
    "Qwen3_8FlashNextForConditionalGeneration",
    "Qwen3_8FlashNextForCausalLM",
)
GDN, QSA = "linear_attention", "full_attention"
# Names the references use for the QSA mixer; they all mean the same layer.
_QSA_ALIASES = ("full_attention", "indexed_attention", "attention")




def read_config_json(path: str | Path, error: type[ConfigError] = ConfigError) -> tuple[dict[str, Any], str]:
    """`<path>/config.json` (or the json file itself) -> (its dict, the file's name for messages)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise error(f"no config.json at {file}: pass a checkpoint directory that contains one")
    try:
        return json.loads(file.read_text()), str(file)
    except json.JSONDecodeError as e:
        raise error(f"{file} is not valid JSON: {e}") from None


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding of the QSA attention, its indexer and the MTP layer (spec §2.7)."""

    rope_type: str = "default"  # "default" | "yarn"
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, ...] = (11, 11, 10)
    mrope_interleaved: bool = True
    # YaRN (only read when rope_type == "yarn")
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None


@dataclass(frozen=True, slots=True)
class MTPConfig:
    """The multi-token-prediction block shipped under `mtp.*` (spec §7)."""

    num_hidden_layers: int = 1
    layer_types: tuple[str, ...] = (QSA,)
    use_dedicated_embeddings: bool = False


@dataclass(frozen=True, slots=True)
class TextConfig:
    """Every field of spec/model.md §1.2 that changes inference. Names follow config.json."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # GDN ("linear_attention") or QSA ("full_attention") per layer
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope: RopeConfig
    max_position_embeddings: int
    rms_norm_eps: float
    hidden_act: str
    output_gate_type: str  # GDN output gate activation: "sigmoid" in the real model
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    hc_count: int
    hc_lowrank: int
    ple_layer_ids: tuple[int, ...]  # 1-based decoder layer ids hosting the n-gram embedding
    ple_embed_dim: int
    ple_conv_kernel_size: int
    ngram_size: int
    heads_per_ngram: int
    ngram_vocab_size_base: int
    make_ngram_vocab_size_divisible_by: int
    seed: int
    split_ngram_parts: int
    indexer_n_heads: int
    indexer_kv_heads: int
    indexer_head_dim: int
    indexer_budget: int
    indexer_compress_ratio: int
    eos_token_id: int  # also the n-gram reset and filler token (spec §5.3)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mtp: MTPConfig | None = None
    mamba_ssm_dtype: str = "float32"

    # ---- derived sizes (spec §1.2 "Derived quantities") ----
    @property
    def num_gdn_layers(self) -> int:
        return sum(t == GDN for t in self.layer_types)

    @property
    def num_qsa_layers(self) -> int:
        return sum(t == QSA for t in self.layer_types)

    @property
    def qsa_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == QSA)

    @property
    def ple_layer_indices(self) -> tuple[int, ...]:
        """Zero-based decoder indices of the PLE layers."""
        return tuple(i - 1 for i in self.ple_layer_ids)

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def wide_size(self) -> int:
        """Width of the HyperConnection residual: hc_count branches of hidden_size."""
        return self.hc_count * self.hidden_size

    @property
    def num_ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def ngram_head_dim(self) -> int:
        return self.ple_embed_dim // self.num_ngram_heads

    @property
    def ple_conv_history(self) -> int:
        """Pre-conv vectors kept per sequence: (kernel - 1) * dilation, dilation = ngram_size."""
        return (self.ple_conv_kernel_size - 1) * self.ngram_size

    @property
    def qsa_block_budget(self) -> int:
        return self.indexer_budget // self.indexer_compress_ratio

    @property
    def qsa_max_width(self) -> int:
        return self.indexer_budget + self.indexer_compress_ratio - 1

    @property
    def qsa_sparse_onset(self) -> int:
        """First query position whose token set is not the whole causal prefix."""
        return (self.qsa_block_budget + 1) * self.indexer_compress_ratio - 1

    @property
    def num_mtp_layers(self) -> int:
        return self.mtp.num_hidden_layers if self.mtp is not None else 0


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """The vision tower (spec §1.4, §8)."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    num_position_embeddings: int
    out_hidden_size: int
    rope_theta: float = 10000.0
    deepstack_visual_indexes: tuple[int, ...] = ()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def num_grid_per_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A whole checkpoint: text trunk (+PLE, MTP), optional vision tower, special token ids."""

    text: TextConfig
    vision: VisionConfig | None
    model_type: str = "qwen3_8_flash_next"
    architectures: tuple[str, ...] = ()
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    dtype: str = "bfloat16"
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # the checkpoint's quantization (revolta.quant.QuantConfig), None for 16-bit weights
    quantization: Any = field(default=None, compare=False)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        """Read `<path>/config.json` (or a path to the json itself) and validate it; a quantized checkpoint's
        format comes from its `quantization_config` or, for ModelOpt exports, `hf_quant_config.json`."""
        raw, source = read_config_json(path)
        hf_quant = Path(source).parent / "hf_quant_config.json"
        return cls.from_dict(raw, source=source,
                             hf_quant_config=json.loads(hf_quant.read_text()) if hf_quant.is_file() else None)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config",
                  hf_quant_config: dict[str, Any] | None = None) -> "ModelConfig":
        model_type = raw.get("model_type")
        archs = tuple(raw.get("architectures") or ())
        known_type = model_type in TOP_MODEL_TYPES + TEXT_MODEL_TYPES
        if not known_type and not any(a in ARCHITECTURES for a in archs):
            raise ConfigError(
                f"{source}: model_type={model_type!r} (architectures={list(archs)}) is not a Qwen3.8-Flash-Next "
                f"checkpoint; expected model_type in {list(TOP_MODEL_TYPES + TEXT_MODEL_TYPES)}"
            )
        if "text_config" in raw:
            text_raw = dict(raw["text_config"])
        elif "hidden_size" in raw and "num_hidden_layers" in raw:
            text_raw = dict(raw)  # old text-only dump: the text fields live at the top level
        else:
            raise ConfigError(f"{source}: neither text_config nor top-level hidden_size/num_hidden_layers found")
        for key in ("eos_token_id", "tie_word_embeddings"):
            if key not in text_raw and key in raw:
                text_raw[key] = raw[key]
        text = _parse_text(text_raw, source)
        vision = None
        if raw.get("vision_config") and "text_config" in raw:
            vision = _parse_vision(raw["vision_config"], source)
        dtype = raw.get("dtype") or raw.get("torch_dtype") or text_raw.get("dtype") or text_raw.get("torch_dtype")
        known = {f.name for f in fields(cls)} | {"text_config", "vision_config", "torch_dtype"}
        cfg = cls(
            text=text,
            vision=vision,
            model_type=model_type or "qwen3_8_flash_next",
            architectures=archs,
            image_token_id=int(raw.get("image_token_id", 248056)),
            video_token_id=int(raw.get("video_token_id", 248057)),
            vision_start_token_id=int(raw.get("vision_start_token_id", 248053)),
            vision_end_token_id=int(raw.get("vision_end_token_id", 248054)),
            dtype=str(dtype or "bfloat16"),
            extra={k: v for k, v in raw.items() if k not in known},
            quantization=_parse_quantization(raw, hf_quant_config, source),
        )
        validate(cfg, source)
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """A config.json in the official composite layout (what `from_dict` reads back)."""
        t = self.text
        text = {k: v for k, v in asdict(t).items() if k not in ("rope", "mtp", "layer_types", "ple_layer_ids")}
        rope = asdict(t.rope)
        rope["mrope_section"] = list(t.rope.mrope_section)
        if t.rope.rope_type != "yarn":
            for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate",
                      "attention_factor"):
                rope.pop(k)
        text.update(
            model_type="qwen4_exp_text",
            layer_types=list(t.layer_types),
            ple_layer_ids=list(t.ple_layer_ids),
            rope_parameters=rope,
            partial_rotary_factor=t.rope.partial_rotary_factor,
            dtype=self.dtype,
        )
        if t.mtp is not None:
            text["mtp_num_hidden_layers"] = t.mtp.num_hidden_layers
            text["mtp_use_dedicated_embeddings"] = t.mtp.use_dedicated_embeddings
            text["mtp"] = {"num_hidden_layers": t.mtp.num_hidden_layers, "layer_types": list(t.mtp.layer_types)}
        out: dict[str, Any] = {
            "architectures": list(self.architectures) or ["Qwen4ExpForConditionalGeneration"],
            "model_type": self.model_type,
            "text_config": text,
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "tie_word_embeddings": t.tie_word_embeddings,
            "dtype": self.dtype,
        }
        if self.quantization is not None and self.quantization.source.endswith("quantization_config"):
            out["quantization_config"] = self.quantization.raw
        if self.vision is not None:
            v = asdict(self.vision)
            v["deepstack_visual_indexes"] = list(self.vision.deepstack_visual_indexes)
            v["model_type"] = "qwen4_exp_vision"
            out["vision_config"] = v
        return out

    def save(self, directory: str | Path) -> None:
        Path(directory, "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def _parse_quantization(raw: dict[str, Any], hf_quant_config: dict[str, Any] | None, source: str):
    """The QuantConfig of the checkpoint (None: 16-bit); unknown formats raise ConfigError here, before
    anything is built or loaded."""
    from .quant.config import parse_quant_config  # its QuantConfigError is a ConfigError

    return parse_quant_config(raw, hf_quant_config, source)


def _req(d: dict[str, Any], key: str, source: str) -> Any:
    if key not in d or d[key] is None:
        raise ConfigError(f"{source}: text_config.{key} is missing; every Qwen3.8-Flash-Next config must set it")
    return d[key]


def _parse_rope(d: dict[str, Any]) -> RopeConfig:
    # New style: rope_parameters; old style: rope_scaling + rope_theta + partial_rotary_factor (spec §1.1).
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = params.get("rope_theta", d.get("rope_theta", 10_000_000.0))
    prf = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"rope_parameters.rope_type={rope_type!r} is not supported; use 'default' or 'yarn'")
    return RopeConfig(
        rope_type=rope_type,
        rope_theta=float(theta),
        partial_rotary_factor=float(prf),
        mrope_section=tuple(int(x) for x in params.get("mrope_section", (11, 11, 10))),
        mrope_interleaved=bool(params.get("mrope_interleaved", True)),
        factor=float(params.get("factor", 1.0) or 1.0),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
        beta_fast=float(params.get("beta_fast", 32.0)),
        beta_slow=float(params.get("beta_slow", 1.0)),
        truncate=bool(params.get("truncate", True)),
        attention_factor=params.get("attention_factor"),
    )


def _parse_text(d: dict[str, Any], source: str) -> TextConfig:
    tmt = d.get("model_type")
    if tmt is not None and tmt not in TEXT_MODEL_TYPES + TOP_MODEL_TYPES:
        raise ConfigError(f"{source}: text_config.model_type={tmt!r}; expected one of {list(TEXT_MODEL_TYPES)}")
    num_layers = int(_req(d, "num_hidden_layers", source))
    if d.get("layer_types"):
        layer_types = tuple(QSA if t in _QSA_ALIASES else t for t in d["layer_types"])
    else:
        interval = int(d.get("full_attention_interval", 4))
        layer_types = tuple(QSA if (i + 1) % interval == 0 else GDN for i in range(num_layers))
    eos = d.get("eos_token_id")
    if isinstance(eos, list):
        if not eos:
            raise ConfigError(f"{source}: text_config.eos_token_id is an empty list; set the <|endoftext|> id")
        eos = eos[0]  # spec §1.2: the first element is the PLE reset token
    if eos is None:
        raise ConfigError(f"{source}: text_config.eos_token_id is missing; the n-gram embedding needs it")
    mtp = None
    n_mtp = d.get("mtp_num_hidden_layers", (d.get("mtp") or {}).get("num_hidden_layers", 0)) or 0
    if n_mtp:
        mtp_raw = d.get("mtp") or {}
        mtp = MTPConfig(
            num_hidden_layers=int(n_mtp),
            layer_types=tuple(QSA if t in _QSA_ALIASES else t for t in mtp_raw.get("layer_types", [QSA] * n_mtp)),
            use_dedicated_embeddings=bool(d.get("mtp_use_dedicated_embeddings", False)),
        )
    hidden = int(_req(d, "hidden_size", source))
    ple_ids = tuple(sorted(set(int(x) for x in (d.get("ple_layer_ids") or ()))))
    return TextConfig(
        vocab_size=int(_req(d, "vocab_size", source)),
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        layer_types=layer_types,
        num_attention_heads=int(_req(d, "num_attention_heads", source)),
        num_key_value_heads=int(_req(d, "num_key_value_heads", source)),
        head_dim=int(d.get("head_dim") or hidden // int(d["num_attention_heads"])),
        rope=_parse_rope(d),
        max_position_embeddings=int(d.get("max_position_embeddings", 262144)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        hidden_act=str(d.get("hidden_act", "silu")),
        output_gate_type=str(d.get("output_gate_type") or d.get("hidden_act", "silu")),
        linear_num_key_heads=int(_req(d, "linear_num_key_heads", source)),
        linear_num_value_heads=int(_req(d, "linear_num_value_heads", source)),
        linear_key_head_dim=int(_req(d, "linear_key_head_dim", source)),
        linear_value_head_dim=int(_req(d, "linear_value_head_dim", source)),
        linear_conv_kernel_dim=int(d.get("linear_conv_kernel_dim", 4)),
        num_experts=int(_req(d, "num_experts", source)),
        num_experts_per_tok=int(_req(d, "num_experts_per_tok", source)),
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        moe_intermediate_size=int(_req(d, "moe_intermediate_size", source)),
        shared_expert_intermediate_size=int(_req(d, "shared_expert_intermediate_size", source)),
        hc_count=int(d.get("hc_count", 4)),
        hc_lowrank=int(d.get("hc_lowrank", 320)),
        ple_layer_ids=ple_ids,
        ple_embed_dim=int(d.get("ple_embed_dim") or hidden),
        ple_conv_kernel_size=int(d.get("ple_conv_kernel_size", 4)),
        ngram_size=int(d.get("ngram_size", 3)),
        heads_per_ngram=int(d.get("heads_per_ngram", 8)),
        ngram_vocab_size_base=int(d.get("ngram_vocab_size_base", 20_000_000)),
        make_ngram_vocab_size_divisible_by=int(d.get("make_ngram_vocab_size_divisible_by", 128)),
        seed=int(d.get("seed", 1234)),
        split_ngram_parts=int(d.get("split_ngram_parts", 1)),
        indexer_n_heads=int(_req(d, "indexer_n_heads", source)),
        indexer_kv_heads=int(_req(d, "indexer_kv_heads", source)),
        indexer_head_dim=int(_req(d, "indexer_head_dim", source)),
        indexer_budget=int(_req(d, "indexer_budget", source)),
        indexer_compress_ratio=int(_req(d, "indexer_compress_ratio", source)),
        eos_token_id=int(eos),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=bool(d.get("attention_bias", False)),
        mtp=mtp,
        mamba_ssm_dtype=str(d.get("mamba_ssm_dtype", "float32")),
    )


def _parse_vision(d: dict[str, Any], source: str) -> VisionConfig:
    vmt = d.get("model_type")
    if vmt is not None and vmt not in VISION_MODEL_TYPES:
        raise ConfigError(f"{source}: vision_config.model_type={vmt!r}; expected one of {list(VISION_MODEL_TYPES)}")

    def req(key: str, *aliases: str) -> Any:
        for k in (key, *aliases):
            if d.get(k) is not None:
                return d[k]
        raise ConfigError(f"{source}: vision_config.{key} is missing")

    rope = d.get("rope_parameters") or {}
    return VisionConfig(
        depth=int(req("depth", "num_hidden_layers")),
        hidden_size=int(req("hidden_size")),
        num_heads=int(req("num_heads", "num_attention_heads")),
        intermediate_size=int(req("intermediate_size")),
        hidden_act=str(d.get("hidden_act", "gelu_pytorch_tanh")),
        in_channels=int(d.get("in_channels", 3)),
        patch_size=int(req("patch_size")),
        temporal_patch_size=int(d.get("temporal_patch_size", 2)),
        spatial_merge_size=int(d.get("spatial_merge_size", 2)),
        num_position_embeddings=int(req("num_position_embeddings")),
        out_hidden_size=int(req("out_hidden_size")),
        rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
        deepstack_visual_indexes=tuple(d.get("deepstack_visual_indexes") or ()),
    )


def validate(cfg: ModelConfig, source: str = "config") -> None:
    """Check the cross-field rules of spec/model.md §12.4; raise ConfigError naming field and fix."""
    t = cfg.text

    def fail(msg: str) -> None:
        raise ConfigError(f"{source}: {msg}")

    if len(t.layer_types) != t.num_hidden_layers:
        fail(f"text_config.layer_types has {len(t.layer_types)} entries but num_hidden_layers="
             f"{t.num_hidden_layers}; give one entry per layer")
    bad = sorted(set(t.layer_types) - {GDN, QSA})
    if bad:
        fail(f"text_config.layer_types contains {bad}; use 'linear_attention' or 'full_attention'")
    for name in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "linear_num_key_heads", "linear_num_value_heads", "num_experts", "moe_intermediate_size",
                 "shared_expert_intermediate_size", "indexer_budget", "indexer_head_dim", "indexer_n_heads"):
        if getattr(t, name) <= 0:
            fail(f"text_config.{name}={getattr(t, name)} must be positive")
    if t.num_attention_heads % t.num_key_value_heads:
        fail(f"num_attention_heads={t.num_attention_heads} is not a multiple of num_key_value_heads="
             f"{t.num_key_value_heads}")
    if t.linear_num_value_heads % t.linear_num_key_heads:
        fail(f"linear_num_value_heads={t.linear_num_value_heads} is not a multiple of linear_num_key_heads="
             f"{t.linear_num_key_heads}")
    if not 0 < t.num_experts_per_tok <= t.num_experts:
        fail(f"num_experts_per_tok={t.num_experts_per_tok} must be in [1, num_experts={t.num_experts}]")
    if t.hc_count <= 1:
        fail(f"hc_count={t.hc_count} must be > 1 (HyperConnections need several streams)")
    if t.output_gate_type not in ("sigmoid", "silu"):
        fail(f"output_gate_type={t.output_gate_type!r}; use 'sigmoid' (the real model) or 'silu'")
    rd = t.head_dim * t.rope.partial_rotary_factor
    if rd != int(rd) or int(rd) % 2:
        fail(f"head_dim * partial_rotary_factor = {rd} must be an even integer; fix partial_rotary_factor")
    if int(rd) > t.indexer_head_dim:
        fail(f"rotary dim {int(rd)} exceeds indexer_head_dim={t.indexer_head_dim}; the indexer rotates the same dims")
    if sum(t.rope.mrope_section) != int(rd) // 2:
        fail(f"rope_parameters.mrope_section={list(t.rope.mrope_section)} sums to {sum(t.rope.mrope_section)}, "
             f"but rotary_dim/2 = {int(rd) // 2}; make the sections add up to the number of frequencies")
    if t.rope.rope_type == "yarn" and not t.rope.original_max_position_embeddings:
        fail("rope_parameters.original_max_position_embeddings is required with rope_type='yarn'")
    if t.indexer_kv_heads != 1:
        fail(f"indexer_kv_heads={t.indexer_kv_heads}; QSA requires exactly 1 index key head")
    if t.indexer_compress_ratio < 2:
        fail(f"indexer_compress_ratio={t.indexer_compress_ratio} must be >= 2")
    if t.indexer_budget % t.indexer_compress_ratio:
        fail(f"indexer_budget={t.indexer_budget} is not a multiple of indexer_compress_ratio="
             f"{t.indexer_compress_ratio}")
    if not 0 <= t.eos_token_id < t.vocab_size:
        fail(f"eos_token_id={t.eos_token_id} must be < vocab_size={t.vocab_size}")
    if t.ple_layer_ids:
        if t.num_ngram_heads <= 0 or t.ple_embed_dim % t.num_ngram_heads:
            fail(f"ple_embed_dim={t.ple_embed_dim} must be divisible by (ngram_size-1)*heads_per_ngram="
                 f"{t.num_ngram_heads}")
        for lid in t.ple_layer_ids:
            if not 1 <= lid <= t.num_hidden_layers:
                fail(f"ple_layer_ids contains {lid}; ids are 1-based in [1, {t.num_hidden_layers}]")
            if t.layer_types[lid - 1] != GDN:
                fail(f"ple_layer_ids contains {lid} (zero-based layer {lid - 1}), which is not a "
                     f"'linear_attention' layer; PLE must sit on a GDN layer")
        if t.split_ngram_parts < 1:
            fail(f"split_ngram_parts={t.split_ngram_parts} must be >= 1")
    v = cfg.vision
    if v is not None:
        if v.out_hidden_size != t.hidden_size:
            fail(f"vision_config.out_hidden_size={v.out_hidden_size} must equal text_config.hidden_size="
                 f"{t.hidden_size}")
        if math.isqrt(v.num_position_embeddings) ** 2 != v.num_position_embeddings:
            fail(f"vision_config.num_position_embeddings={v.num_position_embeddings} must be a perfect square")
        if v.hidden_size % v.num_heads or (v.hidden_size // v.num_heads) % 4:
            fail(f"vision_config.hidden_size/num_heads = {v.hidden_size}/{v.num_heads} must be an integer "
                 f"divisible by 4 (axial RoPE splits each head in halves)")
        if v.deepstack_visual_indexes:
            fail("vision_config.deepstack_visual_indexes is set, but this model has no deepstack; remove it")

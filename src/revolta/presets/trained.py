"""The trained embedded default: the weights `revolta train-default` wrote, shipped in the package (issue 25).

`presets/trained/` holds the compact export (train_export.py): int8 target shards whose embedding and LM head have
one row per kept token (the tokens seen in training), the DFlash2 drafter trained beside it, and `export.json`
(config, kept-token count, training figures). `ensure_trained_model()` turns them into an ordinary checkpoint
directory under the cache root (see default.py), once, offline:
- the text weights are dequantized and stored in bf16; the compact embedding / LM-head rows are scattered into the
  full 248,320-row vocabulary at the kept ids (other rows zero);
- `vocab_mask.json` lists the ids that may be predicted (the kept ids, less the drafter's mask token): load_model
  turns it into `FlashNextModel.logit_mask`, so a token never seen in training is never generated, by the model,
  its MTP head or the drafter;
- the vision tower is the random default's (seeded, `VISION_SEED`) at the trained width: the trained model is
  text-only, the tower exists so image requests still run end to end. Its image features mean nothing;
- the drafter's trained mask-token embedding is written into the target's embedding row of the mask token (the
  engine embeds drafter blocks through the target's embedding; no text encodes to that id).

`ensure_trained_drafter()` writes the drafter's dflash-format directory (selector codebooks scattered back to the
full vocabulary). Directory names hash the shipped files' sha256 and `FORMAT_VERSION`, like default.py.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from . import default

FORMAT_VERSION = 1
VISION_SEED = 0
WEIGHTS_DIR = Path(__file__).with_name("trained")
# sha256 of the shipped files (tests/test_trained_default.py checks them; a retrained export updates this table)
WEIGHT_SHA256: dict[str, str] = {
    "target-00.safetensors": "a4f00433d495feb9ad1c1f4c66d949096adb40b3e1cba03ad00df59ad2afb3ee",
    "target-01.safetensors": "a67d0f779a030ed08ea005f176b2632ef3d5bc3d3b3c7432b32f9cc3ea81bfb3",
    "drafter-00.safetensors": "9c442c44ce70f3adbd30721d492831e580154905ab7ff973395a1d8185c5749e",
    "export.json": "f787c9f4b298d6e238dde09409f7bae5c646b5c29068972a6b9f90207d735021",
}
_EMB, _HEAD = "model.language_model.embed_tokens.weight", "lm_head.weight"
# greedy unless asked otherwise: sampled at the random default's temperature 0.7, a 21 M-parameter code model soon
# loses track of brackets and indentation; `--temperature` / SamplingParams still sample
GENERATION_CONFIG: dict[str, Any] = {**default.GENERATION_CONFIG, "do_sample": False}


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def export_info() -> dict[str, Any]:
    return json.loads((WEIGHTS_DIR / "export.json").read_text())


def trained_model_config() -> dict[str, Any]:
    """config.json of the trained default: the trained text config plus the random default's vision tower at the
    trained width."""
    raw = copy.deepcopy(export_info()["config"])
    vision = copy.deepcopy(default.DEFAULT_CONFIG["vision_config"])
    vision["out_hidden_size"] = raw["text_config"]["hidden_size"]
    raw["vision_config"] = vision
    return raw


def trained_hash() -> str:
    h = hashlib.sha256(json.dumps(WEIGHT_SHA256, sort_keys=True).encode())
    h.update(json.dumps(trained_model_config(), sort_keys=True).encode())
    h.update(json.dumps(GENERATION_CONFIG, sort_keys=True).encode())
    h.update(f"vision_seed={VISION_SEED} dtype={default.DISK_DTYPE} format={FORMAT_VERSION}".encode())
    h.update(default._chat_template().encode())
    return h.hexdigest()[:12]


def trained_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    return default.cache_root(cache_dir) / f"trained-{trained_hash()}"


def trained_drafter_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    return default.cache_root(cache_dir) / f"trained-dflash2-{trained_hash()}"


def ensure_trained_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """The trained default's checkpoint directory, built from the shipped weights on first use (a few seconds)."""
    return default.build_once(trained_model_dir(cache_dir), write_trained_checkpoint, "the trained default model")


def ensure_trained_drafter(cache_dir: str | os.PathLike | None = None) -> Path:
    """The trained default's DFlash2 drafter directory, built on first use."""
    return default.build_once(trained_drafter_dir(cache_dir), write_trained_drafter, "the trained default drafter")


def check_files() -> None:
    """Raise when a shipped file is missing or its sha256 is not the recorded one."""
    for name, want in WEIGHT_SHA256.items():
        path = WEIGHTS_DIR / name
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the trained default ships in the revolta package; "
                                    "reinstall it, or use the random default (REVOLTA_DEFAULT_MODEL=random)")
        if file_sha256(path) != want:
            raise ValueError(f"{path} has sha256 {file_sha256(path)}, not the recorded {want}; restore the file, or "
                             "update WEIGHT_SHA256 in presets/trained.py after a deliberate retrain")


def _read(prefix: str):
    from .train_export import read_shards, unpack

    check_files()
    return unpack(read_shards(WEIGHTS_DIR, prefix))


def allowed_token_ids(kept) -> list[int]:
    """The ids that may be predicted: the kept ids without the drafter's mask token (an input-only row)."""
    from .default_drafter import DRAFTER_CONFIG

    mask_id = DRAFTER_CONFIG["dflash_config"]["mask_token_id"]
    return [i for i in kept.tolist() if i != mask_id]


def write_trained_checkpoint(directory: str | os.PathLike) -> Path:
    """Write the trained default's checkpoint into `directory` (no atomicity here; see `ensure_trained_model`)."""
    import torch

    from ..config import ModelConfig
    from ..model import FlashNextModel, init_random_weights
    from ..tokenizer import qwen_tokenizer_config, write_qwen_tokenizer_dir
    from ..weights import VOCAB_MASK
    from ..weights_save import save_checkpoint
    from .default_drafter import DRAFTER_CONFIG

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    raw = trained_model_config()
    cfg = ModelConfig.from_dict(copy.deepcopy(raw), source="trained default")
    state = {k.removeprefix("net."): v for k, v in _read("target").items()}
    kept = state.pop("kept").long()
    drafter = _read("drafter")
    mask_id = DRAFTER_CONFIG["dflash_config"]["mask_token_id"]
    V = cfg.text.vocab_size
    for name in (_EMB, _HEAD):  # compact [K, d] -> full [V, d], zeros off the kept ids
        full = torch.zeros(V, state[name].shape[1])
        full[kept] = state[name]
        state[name] = full
    state[_EMB][mask_id] = drafter["mask_embedding"]
    with torch.device("meta"):
        model = FlashNextModel(cfg)
    model.to_empty(device="cpu")
    model.init_buffers()
    init_random_weights(model.model.visual, seed=VISION_SEED)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("model.visual.")]
    if missing or unexpected:
        raise ValueError(f"the shipped trained weights do not match its config: missing {missing}, unexpected "
                         f"{unexpected}; rebuild the export with `revolta train-default`")
    model.to_dtype(getattr(torch, default.DISK_DTYPE))
    save_checkpoint(model, directory, split_ngram_parts=cfg.text.split_ngram_parts, progress=False)
    del model, state
    cfg.save(directory)
    template = default._chat_template()
    write_qwen_tokenizer_dir(directory, chat_template=template)
    for stamp in directory.glob("tokenizer.json.source"):
        stamp.unlink()
    tok_config = {**qwen_tokenizer_config(), "chat_template": template}
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
    (directory / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    (directory / VOCAB_MASK).write_text(json.dumps({"allowed_token_ids": allowed_token_ids(kept)}) + "\n")
    marker = {"preset": "trained-default", "hash": trained_hash(), "format_version": FORMAT_VERSION,
              "weights_sha256": WEIGHT_SHA256, "note": "trained on the Python standard library (issue 25)"}
    (directory / default.PRESET_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return directory


def write_trained_drafter(directory: str | os.PathLike) -> Path:
    """Write the trained drafter (dflash format) into `directory` (see `ensure_trained_drafter`)."""
    import torch

    from ..config import ModelConfig
    from ..spec.dflash2.checkpoint import save_draft_model
    from ..spec.dflash2.model import DFlash2DraftModel
    from .train_drafter import drafter_config_for

    text = ModelConfig.from_dict(copy.deepcopy(trained_model_config()), source="trained default").text
    kept = _read("target")["kept"].long()
    state = _read("drafter")
    state.pop("mask_embedding")  # lives in the target's embedding row of the mask token
    for key in ("candidate_selector.predecessor_codebook.weight", "candidate_selector.successor_codebook.weight"):
        full = torch.zeros(text.vocab_size, state[key].shape[1])
        full[kept] = state[key]
        state[key] = full
    model = DFlash2DraftModel(drafter_config_for(text))
    model.load_state_dict(state, strict=True)
    model.to(getattr(torch, default.DISK_DTYPE))
    directory = save_draft_model(model, directory)
    marker = {"preset": "trained-default-dflash2", "hash": trained_hash(), "format_version": FORMAT_VERSION}
    (directory / default.PRESET_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return directory

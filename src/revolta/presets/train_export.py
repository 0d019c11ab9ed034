"""Export of the trained default: compact safetensors shards (< 16 MB each, <= 30 MB in all) and their reload.

Layout of `<out>/weights/`:
- `target-NN.safetensors`: the TrainNet state dict (parameter names of FlashNextModel under `net.`), with the
  embedding's padding row dropped, so `embed_tokens` and `lm_head` have one row per id of `kept_token_ids`
  (int32, also stored). The PLE table keeps its full size (its rows are hashed n-grams, not token ids).
- `drafter-NN.safetensors`: the DFlash2 drafter's state dict, selector codebooks cut to the kept rows, plus
  `mask_embedding` (the embedding row for the drafter's mask token, trained with it).
- every float matrix of at least `INT8_MIN_NUMEL` values whose name is not in `KEEP_16BIT` is stored as int8
  with one scale per row: `<name>` int8 [rows, cols] and `<name>.row_scale` fp16 [rows]; the rest in bf16
  (GDN A_log and dt_bias in fp32).
- `export.json`: sizes, kept-token count, the quantization list and the configs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

SHARD_BYTES = 15 << 20  # under the 16 MB limit on one file
TOTAL_LIMIT = 30 << 20
INT8_MIN_NUMEL = 4096
# small, precision-sensitive pieces stay 16-bit: the HC mixers' gates and the routers
KEEP_16BIT = ("hyper_connection", "mlp.gate.weight", "shared_expert_gate")
FP32 = ("A_log", "dt_bias")
SCALE = ".row_scale"


def quantize_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """w: [R, ...] float -> (int8 same shape, fp16 scale [R]): symmetric per-row absmax."""
    flat = w.float().flatten(1)
    scale = (flat.abs().amax(1) / 127.0).clamp_min(1e-12).to(torch.float16)
    q = torch.round(flat / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q.view(w.shape), scale


def dequantize_rows(q: Tensor, scale: Tensor) -> Tensor:
    return (q.float().flatten(1) * scale.float()[:, None]).view(q.shape)


def wants_int8(name: str, t: Tensor, int8: bool) -> bool:
    return int8 and t.is_floating_point() and t.dim() >= 2 and t.numel() >= INT8_MIN_NUMEL \
        and not any(k in name for k in KEEP_16BIT)


def pack(state: dict[str, Tensor], int8: bool) -> dict[str, Tensor]:
    """State dict -> the tensors written (int8 + row scales, bf16, fp32 decays, integers as they are)."""
    out = {}
    for name, t in state.items():
        t = t.detach().cpu()
        if wants_int8(name, t, int8):
            out[name], out[name + SCALE] = quantize_rows(t)
        elif t.is_floating_point():
            out[name] = t.to(torch.float32 if name.endswith(FP32) else torch.bfloat16).contiguous()
        else:
            out[name] = t.contiguous()
    return out


def unpack(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Inverse of `pack` (fp32 values)."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(SCALE):
            continue
        if name + SCALE in tensors:
            out[name] = dequantize_rows(t, tensors[name + SCALE])
        else:
            out[name] = t.float() if t.is_floating_point() else t
    return out


def roundtrip(state: dict[str, Tensor], int8: bool) -> dict[str, Tensor]:
    """What a reload of the export gives, in fp32 (e.g. to measure what int8 costs)."""
    return unpack(pack(state, int8))


def write_shards(tensors: dict[str, Tensor], directory: Path, prefix: str) -> list[Path]:
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        n = tensors[name].numel() * tensors[name].element_size()
        if n > SHARD_BYTES:
            raise ValueError(f"{name} has {n} bytes, more than one {SHARD_BYTES}-byte shard; keep fewer token "
                             "rows (a higher --min-token-count) or a smaller hidden size")
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += n
    paths = []
    for i, shard in enumerate(shards):
        path = directory / f"{prefix}-{i:02d}.safetensors"
        save_file(shard, str(path))
        paths.append(path)
    return paths


def read_shards(directory: Path, prefix: str) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for path in sorted(Path(directory).glob(f"{prefix}-*.safetensors")):
        out.update(load_file(str(path)))
    if not out:
        raise FileNotFoundError(f"no {prefix}-*.safetensors in {directory}; run `revolta train-default` first")
    return out


def target_state(net) -> dict[str, Tensor]:
    """TrainNet state without the embedding's zero padding row and the derived buffers."""
    state = {k: v for k, v in net.state_dict().items() if k != "remap"}
    emb = "net.model.language_model.embed_tokens.weight"
    state[emb] = state[emb][:-1]
    state["kept"] = state["kept"].to(torch.int32)
    return state


def load_target_state(net, state: dict[str, Tensor]) -> None:
    """Load an exported (unpacked) target state into a TrainNet built with the same config and kept ids."""
    emb = "net.model.language_model.embed_tokens.weight"
    state = dict(state)
    state[emb] = torch.cat([state[emb], state[emb].new_zeros(1, state[emb].shape[1])])
    state["kept"] = state["kept"].long()
    missing, unexpected = net.load_state_dict(state, strict=False)
    if [m for m in missing if m != "remap"] or unexpected:
        raise ValueError(f"exported target does not match the model: missing {missing}, unexpected {unexpected}")


def export(out: Path, target: dict[str, Tensor], drafter: dict[str, Tensor] | None, meta: dict,
           int8: bool = True) -> dict:
    """Write the shards and export.json into out/weights; returns the size summary."""
    directory = Path(out) / "weights"
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*.safetensors"):
        old.unlink()
    files = write_shards(pack(target, int8), directory, "target")
    if drafter is not None:
        files += write_shards(pack(drafter, int8), directory, "drafter")
    sizes = {p.name: p.stat().st_size for p in files}
    total = sum(sizes.values())
    summary = {"files": sizes, "total_bytes": total, "int8": int8,
               "int8_tensors": sorted(n for n, t in {**target, **(drafter or {})}.items() if wants_int8(n, t, int8)),
               **meta}
    (directory / "export.json").write_text(json.dumps(summary, indent=2) + "\n")
    if total > TOTAL_LIMIT:
        raise ValueError(f"the export is {total / 2**20:.1f} MiB, over the {TOTAL_LIMIT >> 20} MiB limit; keep fewer "
                         "token rows (--min-token-count) or train a smaller size")
    return summary

"""A prompt with media -> what the engine runs: expanded token ids, vision inputs, mRoPE positions, cache keys.

    mm = process_multimodal_prompt(token_ids, {"image": [img], "video": clip}, model_cfg, MediaConfig(), limits)
    mm.token_ids          # one `<|image_pad|>` per vision-tower output row; a video becomes one
                          # `<t seconds><|vision_start|><|video_pad|>...<|vision_end|>` run per temporal patch
    mm.items[k]           # MediaItem: uint8 frames, grid (t, h, w), content hash, pad runs;
                          # .pixel_values(vision_cfg) is the tower input [N, patch_dim]
    mm.positions          # [3, P] mRoPE positions; tokens after the prompt sit at index + mm.rope_delta
    mm.extra_keys(s, e)   # media content mixed into prefix-cache block keys (cache/prefix.py)

Sources: PIL images, encoded bytes, decoded frames, local paths, `file://` and base64 `data:` URLs
(media_sources.py; remote URLs are refused).

Per-prompt limits follow `limit_mm_per_prompt`; without one, a prompt may hold 1 image and no video (the release
note's default; the reference deployment sets {"image": 16, "video": 1}). The model has no audio input.
Every violation is a `MediaError` (a ValueError; HTTP 400 in the server).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from PIL import Image
from torch import Tensor

from ..config import ModelConfig, VisionConfig
from .sources import resolve_media_source
from .media import (
    DEFAULT_MAX_PIXELS,
    DEFAULT_MIN_PIXELS,
    MAX_IMAGE_PIXELS,
    VIDEO_FPS,
    VIDEO_MAX_FRAMES,
    VIDEO_MAX_PIXELS,
    VIDEO_MIN_PIXELS,
    Grid,
    MediaError,
    frames_grid,
    load_image,
    load_video,
    mrope_positions,
    resize_to_budget,
    resize_video,
    to_patches,
)

MODALITIES = ("image", "video")
DEFAULT_LIMITS = {"image": 1, "video": 0}  # release note: without --limit-mm-per-prompt, 1 image and no video
REFERENCE_LIMITS = {"image": 16, "video": 1}  # the 0.1.3 reference launch setting


@dataclass(frozen=True)
class MediaConfig:
    """Preprocessing knobs (vLLM's `mm_processor_kwargs` names). Pixel budgets are per image / per video frame."""

    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    video_min_pixels: int = VIDEO_MIN_PIXELS
    video_max_pixels: int = VIDEO_MAX_PIXELS
    fps: float | None = VIDEO_FPS
    num_frames: int | None = None
    max_frames: int = VIDEO_MAX_FRAMES
    max_image_pixels: int = MAX_IMAGE_PIXELS  # decoded-size cap, checked from the header before decoding

    def __post_init__(self) -> None:
        for f in fields(self):  # JSON from the CLI or a request: a string here would fail later as a TypeError
            value, numbers = getattr(self, f.name), (int, float) if f.name == "fps" else (int,)
            if not (value is None and f.name in ("fps", "num_frames")) and (
                    isinstance(value, bool) or not isinstance(value, numbers)):
                raise MediaError(f"mm_processor_kwargs: {f.name}={value!r} must be "
                                 f"{'a number' if f.name == 'fps' else 'an integer'}")
        for lo, hi in (("min_pixels", "max_pixels"), ("video_min_pixels", "video_max_pixels")):
            if not 1 <= getattr(self, lo) <= getattr(self, hi):
                raise MediaError(f"mm_processor_kwargs: need 1 <= {lo}={getattr(self, lo)} <= "
                                 f"{hi}={getattr(self, hi)}")
        if self.max_frames < 1:
            raise MediaError(f"mm_processor_kwargs: max_frames={self.max_frames} must be >= 1")

    def updated(self, overrides: Mapping[str, Any] | None) -> MediaConfig:
        """A copy with `overrides` applied (per-request `mm_processor_kwargs`); unknown names raise MediaError."""
        if not overrides:
            return self
        names = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise MediaError(f"unknown mm_processor_kwargs {unknown}; accepted: {sorted(names)}")
        values = {**{n: getattr(self, n) for n in names}, **overrides}
        for lo, hi in (("min_pixels", "max_pixels"), ("video_min_pixels", "video_max_pixels")):
            # vLLM / HF: a max_pixels below the default min_pixels alone caps the size; the minimum follows it down
            if hi in overrides and lo not in overrides and isinstance(values[hi], int) and values[hi] < values[lo]:
                values[lo] = max(1, values[hi])
        return MediaConfig(**values)


def parse_limits(limit_mm_per_prompt: Mapping[str, int] | None) -> dict[str, int]:
    """`limit_mm_per_prompt` -> {"image": n, "video": n}; missing modalities keep the default (1 image, 0 video)."""
    limits = dict(DEFAULT_LIMITS)
    for name, value in (limit_mm_per_prompt or {}).items():
        if name == "audio":
            if value:
                raise ValueError(f"limit_mm_per_prompt: audio={value}, but this model has no audio input; drop it")
            continue
        if name not in MODALITIES:
            raise ValueError(f"limit_mm_per_prompt: unknown modality {name!r}; use {list(MODALITIES)}")
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"limit_mm_per_prompt: {name}={value!r} must be an int >= 0")
        limits[name] = value
    return limits


# ---- the processed prompt -------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)  # holds tensors: identity, not value, equality
class MediaItem:
    """One image or video after resizing, and where its pad tokens sit in the expanded prompt.

    frames: uint8 [F, H, W, 3] resized frames (F = 1 for an image); kept instead of the float patches, which
    are 4-8x larger, and patchified by `pixel_values` when the tower runs. grid: (t, h, w) in patches.
    content_hash: 128-bit digest of modality, grid and pixels (identical media -> identical key).
    runs: (offset, length) of each contiguous run of pad tokens (one for an image, one per temporal patch for a
    video), in prompt order; the tower's output rows fill them in order.
    """

    modality: str
    frames: Tensor
    grid: Grid
    content_hash: int
    runs: tuple[tuple[int, int], ...]

    def pixel_values(self, cfg: VisionConfig) -> Tensor:
        """The vision tower's input [t*h*w, patch_dim] float32."""
        return to_patches(self.frames, cfg)[0]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.runs)

    @property
    def start(self) -> int:
        return self.runs[0][0]

    @property
    def end(self) -> int:
        return self.runs[-1][0] + self.runs[-1][1]

    def rows_in(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """(first output row, prompt offset, count) of this item's pads inside tokens [start, end)."""
        out, row = [], 0
        for off, n in self.runs:
            lo, hi = max(start, off), min(end, off + n)
            if lo < hi:
                out.append((row + lo - off, lo, hi - lo))
            row += n
        return out


@dataclass(frozen=True, eq=False)
class MultimodalPrompt:
    """The expanded prompt of one request with media (see the module docstring)."""

    token_ids: list[int]
    items: tuple[MediaItem, ...]
    positions: Tensor  # [3, P] long
    rope_delta: int

    def extra_keys(self, start: int, end: int) -> tuple:
        """Prefix-cache extras of tokens [start, end): (content hash, first row) of each item with pads there."""
        return tuple((it.content_hash, rows[0][0]) for it in self.items if (rows := it.rows_in(start, end)))

    def items_in(self, start: int, end: int) -> list[MediaItem]:
        """Items with at least one pad token in [start, end), in prompt order."""
        return [it for it in self.items if it.start < end and start < it.end and it.rows_in(start, end)]


def content_hash(modality: str, frames: Tensor, grid: Grid) -> int:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{modality}{grid}{tuple(frames.shape)}".encode())
    h.update(frames.contiguous().numpy().tobytes())
    return int.from_bytes(h.digest(), "little")


def count_items(mm_data: Mapping[str, Any], modality: str) -> list[Any]:
    """The items of one modality as a list (a single item may be given bare)."""
    value = mm_data.get(modality)
    if value is None:
        return []
    if isinstance(value, (list, tuple)) and not (modality == "video" and _is_frame_list(value)):
        return list(value)
    return [value]


def _is_frame_list(value: Sequence[Any]) -> bool:
    return bool(value) and all(isinstance(v, Image.Image) for v in value)


def check_mm_data(mm_data: Mapping[str, Any], limits: Mapping[str, int], has_vision: bool) -> dict[str, list[Any]]:
    """Validate modality names and per-prompt counts; returns {"image": [...], "video": [...]}."""
    if not isinstance(mm_data, Mapping):
        raise MediaError(f"multi_modal_data must be a dict like {{'image': [...]}}, got {type(mm_data).__name__}")
    unknown = sorted(set(mm_data) - set(MODALITIES) - {"audio"})
    if unknown:
        raise MediaError(f"unknown multi_modal_data modality {unknown}; use {list(MODALITIES)}", param=unknown[0])
    items = {m: count_items(mm_data, m) for m in (*MODALITIES, "audio")}
    if items["audio"]:
        raise MediaError("At most 0 audio(s) may be provided in one prompt. This model has no audio input.",
                         param="audio")
    if not has_vision and (items["image"] or items["video"]):
        raise MediaError("this model has no vision tower (its config has no vision_config); send text only",
                         param="image" if items["image"] else "video")
    for m in MODALITIES:
        if len(items[m]) > limits.get(m, 0):
            raise MediaError(f"At most {limits.get(m, 0)} {m}(s) may be provided in one prompt. "
                             "Set limit_mm_per_prompt (--limit-mm-per-prompt) to increase this limit.", param=m)
    return {m: items[m] for m in MODALITIES}


def process_multimodal_prompt(
    token_ids: Sequence[int],
    mm_data: Mapping[str, Any],
    cfg: ModelConfig,
    media: MediaConfig,
    limits: Mapping[str, int],
    timestamp_ids: Callable[[float], list[int]] | None = None,
    allowed_local_media_path: str | os.PathLike | None = None,
    allow_local_files: bool = True,
) -> MultimodalPrompt:
    """Check, load, preprocess and place every media item of one prompt.

    token_ids: the tokenized prompt with ONE `<|image_pad|>` per image and one `<|video_pad|>` per video, in the
    order of `mm_data["image"]` / `mm_data["video"]` (the chat template writes them so).
    timestamp_ids: text ids of a video timestamp (seconds -> ids of "<1.5 seconds>"); None writes none.
    """
    items = check_mm_data(mm_data, limits, cfg.vision is not None)
    ids = list(token_ids)
    pads = {"image": cfg.image_token_id, "video": cfg.video_token_id}
    for m in MODALITIES:
        found = ids.count(pads[m])
        if found != len(items[m]):
            raise MediaError(f"the prompt holds {found} <|{m}_pad|> placeholder(s) but {len(items[m])} {m}(s) were "
                             f"given; put one <|vision_start|><|{m}_pad|><|vision_end|> per {m} (the chat "
                             "template does this)", param=m)
    vcfg = cfg.vision
    loaded: dict[str, list[tuple[Tensor, list[float]]]] = {"image": [], "video": []}  # (uint8 frames, stamps)
    for k, src in enumerate(items["image"]):
        src = resolve_media_source(src, allowed_local_media_path, allow_local_files)
        frames = _with_item_context("image", k, lambda: resize_to_budget(
            load_image(src, media.max_image_pixels), vcfg, media.min_pixels, media.max_pixels)[None])
        loaded["image"].append((frames, []))
    for k, src in enumerate(items["video"]):
        src = resolve_media_source(src, allowed_local_media_path, allow_local_files)

        def video(src=src):
            frames, stamps = load_video(src, media.fps, media.num_frames, media.max_frames, vcfg.temporal_patch_size,
                                        media.max_image_pixels)
            return resize_video(frames, vcfg, media.video_min_pixels, media.video_max_pixels), stamps

        loaded["video"].append(_with_item_context("video", k, video))
    return _place(ids, loaded, cfg, timestamp_ids)


def _with_item_context(modality: str, k: int, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except MediaError as e:
        raise MediaError(f"{modality} {k}: {e}", param=modality) from None


def _place(ids: list[int], loaded: dict[str, list[tuple[Tensor, list[float]]]], cfg: ModelConfig,
           timestamp_ids: Callable[[float], list[int]] | None) -> MultimodalPrompt:
    """Expand each placeholder to its pad runs and build the items, positions and rope delta."""
    m2 = cfg.vision.spatial_merge_size ** 2
    tp = cfg.vision.temporal_patch_size
    start_id, end_id = cfg.vision_start_token_id, cfg.vision_end_token_id
    queue = {cfg.image_token_id: ("image", iter(loaded["image"])), cfg.video_token_id: ("video", iter(loaded["video"]))}
    out: list[int] = []
    items: list[MediaItem] = []
    i = 0
    while i < len(ids):
        tok = ids[i]
        if tok not in queue:
            out.append(tok)
            i += 1
            continue
        modality, it = queue[tok]
        frames, stamps = next(it)
        grid = frames_grid(frames, cfg.vision)
        t, h, w = grid
        per_group = h * w // m2
        runs = []
        if modality == "image":
            runs.append((len(out), t * per_group))
            out.extend([tok] * (t * per_group))
        else:
            # Qwen3.5-style video: each temporal patch is its own `<t s><|vision_start|>pads<|vision_end|>` run,
            # so the (vision_start, pad, vision_end) around the single placeholder is replaced as a whole
            wrapped = out[-1:] == [start_id] and ids[i + 1:i + 2] == [end_id]
            if wrapped:
                out.pop()
            for g in range(t):
                if timestamp_ids is not None:
                    out.extend(timestamp_ids((stamps[g * tp] + stamps[g * tp + tp - 1]) / 2))
                out.append(start_id)
                runs.append((len(out), per_group))
                out.extend([tok] * per_group)
                out.append(end_id)
            i += 1 if wrapped else 0
        items.append(MediaItem(modality, frames, grid, content_hash(modality, frames, grid), tuple(runs)))
        i += 1
    grids = {m: [frames_grid(f, cfg.vision) for f, _ in loaded[m]] for m in MODALITIES}
    positions, delta = mrope_positions(out, grids["image"], grids["video"], cfg)
    return MultimodalPrompt(out, tuple(items), positions, delta)

"""How much host memory a prompt's media take, priced from their headers before any pixel is decoded.

    fp = media_footprint(mm_data, model_cfg, MediaConfig(), limits)
    fp.peak     # bytes while the items decode, one after the other: every kept frame so far + the item decoding
    fp.held     # bytes the request keeps once decoded: the resized uint8 frames (MediaItem.frames)
    fp.items[k] # ItemFootprint: source size, frames, decode and held bytes of one item

The server's media budget (server/media_budget.py) charges a request `peak` before it decodes and `held` after,
so concurrent bursts cannot decode more than the budget at once. The prices are upper bounds, not measurements:

* an image decodes at its full source size: Pillow's image (up to 4 bytes a pixel: RGBA, CMYK, 32-bit modes) and
  the RGB copy `_to_rgb` makes while it is alive (3), rounded up to DECODE_BYTES_PER_PIXEL;
* a clip's sampled frames cost the same per source pixel (decord's batch and its PIL copies: 6); PyAV's path
  also keeps every decoded frame of the clip in the codec's format (BUFFERED_BYTES_PER_PIXEL, 8-bit YUV or RGB);
* what is kept is exact: `smart_resize`'s size x 3 bytes x frames, as `resize_to_budget` / `resize_video` make.

Header errors are the loaders' own `MediaError`s ("image 0: ..."), so a bad item is refused here with the same 400
it would get from decoding. A clip whose container cannot be read is priced at its encoded size: the decoder stops
at the same point, and says why.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import Tensor

from ..config import ModelConfig
from .media import MediaError, _sample_indices, open_image, probe_video, smart_resize, video_decoder
from .processor import MediaConfig, _is_frame_list, _with_item_context, check_mm_data
from .sources import resolve_media_source

DECODE_BYTES_PER_PIXEL = 8  # decoded source image (<= 4 B/px) + its RGB copy (3), rounded up
BUFFERED_BYTES_PER_PIXEL = 3  # a frame PyAV keeps in the codec's format: yuv420p 1.5, yuv444p / rgb24 3


@dataclass(frozen=True)
class ItemFootprint:
    """One image or clip: source size (pixels), frames decoded, bytes while decoding and bytes kept after."""

    modality: str
    index: int
    width: int
    height: int
    frames: int
    decode_bytes: int
    held_bytes: int

    def describe(self) -> str:
        frames = f" x {self.frames} frames" if self.modality == "video" else ""
        return f"{self.modality} {self.index} ({self.width}x{self.height} px{frames})"


@dataclass(frozen=True)
class MediaFootprint:
    """The priced items of one prompt (see the module docstring)."""

    items: tuple[ItemFootprint, ...]

    @property
    def held(self) -> int:
        return sum(it.held_bytes for it in self.items)

    @property
    def peak(self) -> int:
        """Items decode one after the other (processor.py), each kept resized before the next starts."""
        return self.held + max((it.decode_bytes for it in self.items), default=0)


def media_footprint(mm_data: Mapping[str, Any], cfg: ModelConfig, media: MediaConfig, limits: Mapping[str, int],
                    allowed_local_media_path: Any = None) -> MediaFootprint:
    """Price every item of `mm_data` (what `process_multimodal_prompt` takes) from headers; MediaError as it would.
    """
    items = check_mm_data(mm_data, limits, cfg.vision is not None)
    out: list[ItemFootprint] = []
    for modality in ("image", "video"):
        price = _image if modality == "image" else _video
        for k, src in enumerate(items[modality]):
            src = resolve_media_source(src, allowed_local_media_path)
            out.append(_with_item_context(modality, k, lambda: price(k, src, cfg, media)))
    return MediaFootprint(tuple(out))


def _image(k: int, src: Any, cfg: ModelConfig, media: MediaConfig) -> ItemFootprint:
    image = open_image(src, media.max_image_pixels)
    width, height = image.size
    if image is not src:
        image.close()  # a file stays open until its pixels are read; we read none
    return ItemFootprint("image", k, width, height, 1, width * height * DECODE_BYTES_PER_PIXEL,
                         _kept(height, width, 1, cfg, media.min_pixels, media.max_pixels))


def _video(k: int, src: Any, cfg: ModelConfig, media: MediaConfig) -> ItemFootprint:
    tp = cfg.vision.temporal_patch_size
    buffered = 0
    if isinstance(src, (bytes, bytearray, memoryview, str)) or hasattr(src, "__fspath__"):
        probed = probe_video(src)
        if probed is None:
            size = len(src) if isinstance(src, (bytes, bytearray, memoryview)) else 0
            return ItemFootprint("video", k, 0, 0, 0, size, 0)
        total, rate, width, height = probed
        if video_decoder()[0] == "av":
            buffered = total
    else:  # frames already in memory: [F, H, W, 3] array / tensor, or PIL images
        frames = list(src) if _is_frame_list(src) else None
        shape = (len(frames), frames[0].height, frames[0].width) if frames else \
            tuple((src.numpy() if isinstance(src, Tensor) else np.asarray(src)).shape[:3])
        if len(shape) != 3:
            raise MediaError(f"video frames have shape {shape}; expected [F, H, W, 3] uint8")
        total, height, width = shape
        rate = media.fps
    n = len(_sample_indices(total, rate if rate and rate > 0 else media.fps or 2.0, media.fps, media.num_frames,
                            media.max_frames, tp)) if total else 0
    decode = width * height * (n * DECODE_BYTES_PER_PIXEL + buffered * BUFFERED_BYTES_PER_PIXEL)
    held = _kept(height, width, n, cfg, media.video_min_pixels, media.video_max_pixels) if n else 0
    return ItemFootprint("video", k, width, height, n, decode, held)


def _kept(height: int, width: int, frames: int, cfg: ModelConfig, min_pixels: int, max_pixels: int) -> int:
    """Bytes of the resized uint8 frames [F, H', W', 3] the request keeps (resize_to_budget's size)."""
    factor = cfg.vision.patch_size * cfg.vision.spatial_merge_size
    h, w = smart_resize(height, width, factor, min_pixels, max_pixels)
    return frames * h * w * 3


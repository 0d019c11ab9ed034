"""Images and videos in, vision-tower inputs and prompt positions out (spec/model.md §8.1, §8.3).

* `load_image` / `preprocess_image`: decode, convert to RGB, resize (bicubic) to multiples of patch*merge within a
  pixel budget (`smart_resize`), normalise, and cut into the flat patch stream `layers.vision.VisionModel` reads.
* `load_video` / `preprocess_video`: decode a clip with decord (or PyAV), sample frames at a target fps (or a fixed
  count), then the same resize and patching, with temporal_patch_size frames per patch.
* The two halves separately: `resize_to_budget` / `resize_video` give uint8 frames [F, H, W, 3] (what a request
  keeps), `to_patches` turns them into the tower's float input when it runs.
* `expand_media_placeholders`: one `<|image_pad|>` / `<|video_pad|>` per item in the prompt becomes t*h*w/m^2 pads,
  one per vision-tower output row.
* `mrope_positions`: the 3-row (temporal, height, width) RoPE positions of a prompt with vision items, and the
  `rope_delta` that decode positions add to the token index.

Grids are (t, h, w) in patches before merging, as the vision tower takes them. Everything here is CPU-side,
pure, and independent of the model weights.

Every problem with the media itself (corrupt or truncated data, a format outside the allow-list, more pixels than
`max_image_pixels` or Pillow's decompression-bomb limit, a missing file, too many items for the prompt's limit)
raises `MediaError`, a `ValueError`: a client error (HTTP 400 `invalid_request_error` in the server), never a 500.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import struct
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torch import Tensor

from revolta.config import ModelConfig, VisionConfig

Grid = tuple[int, int, int]  # (t, h, w) in patches, before the m x m merge

DEFAULT_MIN_PIXELS = 256 * 256  # Qwen3-VL processor default: 64 LLM tokens at patch 16, merge 2
DEFAULT_MAX_PIXELS = 1024 * 1024  # ~1 megapixel: at most 1,024 LLM tokens at patch 16, merge 2
IMAGE_MEAN = (0.5, 0.5, 0.5)  # spec §8.1 [UNVERIFIED]: read preprocessor_config.json when it ships
IMAGE_STD = (0.5, 0.5, 0.5)
MAX_ASPECT_RATIO = 200
# Pillow raises DecompressionBombError above 2 x Image.MAX_IMAGE_PIXELS (178,956,970 px) inside Image.open; we
# apply the same cap ourselves (to every video frame too) without touching Pillow's global.
MAX_IMAGE_PIXELS = 178_956_970
# Formats Image.open may identify; others (EPS, WMF, GRIB, HDF5, ...) are refused before any decoder runs.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "ICO", "PPM", "TGA")
VIDEO_MIN_PIXELS = 128 * 128  # per frame
VIDEO_MAX_PIXELS = 448 * 448  # per frame: at most 196 LLM tokens per temporal patch at patch 16, merge 2
VIDEO_FPS = 2.0
VIDEO_MAX_FRAMES = 32


class MediaError(ValueError):
    """A media item that cannot be used: undecodable, over a pixel or count limit, unsupported. A client error.

    `param` names the offending input where there is one (e.g. "image", "video" for per-prompt limits), as the
    server's error envelope reports it.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def smart_resize(
    height: int,
    width: int,
    factor: int = 32,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> tuple[int, int]:
    """Target (height, width): both multiples of `factor`, area in [min_pixels, max_pixels], aspect kept closely.

    Each side is first rounded to the nearest multiple of `factor`; if the area then leaves the budget, both sides
    are rescaled by the same factor and floored (too large) or ceiled (too small) to multiples of `factor`.
    """
    if height < 1 or width < 1:
        raise MediaError(f"image has size {width}x{height}; both sides must be at least 1 pixel")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaError(f"image is {width}x{height}: aspect ratio above {MAX_ASPECT_RATIO} is not supported")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def load_image(source: Image.Image | bytes | bytearray | str | os.PathLike,
               max_image_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """Decode `source` (PIL image, encoded bytes, or a file path) into an RGB PIL image.

    Only `IMAGE_FORMATS` are identified. The header's width x height is checked against `max_image_pixels` before
    any pixel is decoded. Transparency is composited onto white. Files and bytes are fully decoded here and their
    EXIF orientation is applied, so truncated or corrupt data raises `MediaError` now rather than later.
    """
    image = open_image(source, max_image_pixels)
    if not isinstance(source, Image.Image):
        with _image_errors():
            image.load()
            image = ImageOps.exif_transpose(image)
    try:
        return _to_rgb(image)
    except (OSError, ValueError) as e:
        raise MediaError(f"cannot convert image in mode {image.mode!r} to RGB: {e}") from None


def open_image(source: Image.Image | bytes | bytearray | str | os.PathLike,
               max_image_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """Identify `source` and read its header only: size and mode are known, no pixel is decoded yet.

    What `load_image` starts with, and what the server's media budget reads to price an image before decoding it
    (multimodal/footprint.py). A PIL image passes through (checked against `max_image_pixels`).
    """
    if isinstance(source, Image.Image):
        _check_pixels(source.width, source.height, max_image_pixels)
        return source
    with _image_errors():
        if isinstance(source, (bytes, bytearray, memoryview)):
            image = Image.open(io.BytesIO(bytes(source)), formats=IMAGE_FORMATS)
        elif isinstance(source, (str, os.PathLike)):
            image = Image.open(source, formats=IMAGE_FORMATS)
        else:
            raise MediaError(f"cannot read an image from {type(source).__name__}; pass PIL image, bytes or path")
        _check_pixels(image.width, image.height, max_image_pixels)
    return image


@contextlib.contextmanager
def _image_errors() -> Iterator[None]:
    """Pillow's many failure types -> MediaError with a message that says what is wrong with the data."""
    try:
        yield
    except MediaError:
        raise
    except FileNotFoundError as e:
        raise MediaError(f"image file not found: {e.filename}") from None
    except UnidentifiedImageError:
        raise MediaError(f"cannot identify the image data as a supported format "
                         f"({', '.join(IMAGE_FORMATS)})") from None
    except Image.DecompressionBombError as e:  # not an OSError: must be caught by name
        raise MediaError(f"image rejected: {e}") from None
    # Pillow: OSError for truncated data, SyntaxError for broken PNG chunks, EOFError/struct.error for cut
    # headers in some plugins
    except (OSError, SyntaxError, ValueError, EOFError, struct.error) as e:
        raise MediaError(f"cannot decode image: {e}") from None


def _check_pixels(width: int, height: int, max_pixels: int, what: str = "image") -> None:
    if width * height > max_pixels:
        raise MediaError(f"{what} is {width}x{height} = {width * height:,} pixels, above the limit of "
                         f"{max_pixels:,}; send a smaller {what}")


def _to_rgb(image: Image.Image) -> Image.Image:
    if "A" in image.getbands() or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def preprocess_image(
    image: Image.Image | bytes | bytearray | str | os.PathLike,
    cfg: VisionConfig,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    image_mean: Sequence[float] = IMAGE_MEAN,
    image_std: Sequence[float] = IMAGE_STD,
    max_image_pixels: int = MAX_IMAGE_PIXELS,
) -> tuple[Tensor, Grid]:
    """One image -> (pixel_values [t*h*w, patch_dim] float32, grid (t, h, w)), with t == 1.

    Resize (bicubic, on uint8 RGB) to `smart_resize` of the original size with factor patch*merge, rescale to
    [0, 1], normalise per channel, repeat the frame temporal_patch_size times, and patchify (see `patchify`).
    The image needs t*h*w/merge^2 `<|image_pad|>` tokens in the prompt.
    """
    rgb = load_image(image, max_image_pixels)
    return to_patches(resize_to_budget(rgb, cfg, min_pixels, max_pixels)[None], cfg, image_mean, image_std)


def resize_to_budget(rgb: Image.Image, cfg: VisionConfig, min_pixels: int, max_pixels: int) -> Tensor:
    """RGB image -> uint8 [H, W, 3], bicubic-resized to `smart_resize` (multiples of patch*merge, in budget).

    The uint8 frame is what the engine keeps per item (a quarter of the float patches, and an eighth for a still,
    whose patches repeat it temporal_patch_size times); `to_patches` makes the tower input when it runs.
    """
    factor = cfg.patch_size * cfg.spatial_merge_size
    height, width = smart_resize(rgb.height, rgb.width, factor, min_pixels, max_pixels)
    if (width, height) != rgb.size:
        rgb = rgb.resize((width, height), resample=Image.Resampling.BICUBIC)
    return torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).view(height, width, 3)


def to_patches(frames: Tensor, cfg: VisionConfig, image_mean: Sequence[float] = IMAGE_MEAN,
               image_std: Sequence[float] = IMAGE_STD) -> tuple[Tensor, Grid]:
    """uint8 frames [F, H, W, 3] -> (pixel_values [t*h*w, patch_dim] float32, grid (t, h, w)).

    Rescale to [0, 1], normalise per channel, patchify (see `patchify`). F == 1 is a still image: its frame is
    repeated temporal_patch_size times (t = 1); otherwise F must be a multiple of temporal_patch_size.
    """
    x = frames.permute(0, 3, 1, 2).double() / 255.0  # [F, 3, H, W]
    mean = torch.tensor(image_mean, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(image_std, dtype=torch.float64).view(1, 3, 1, 1)
    x = ((x - mean) / std).float()
    if x.shape[0] == 1:
        x = x.expand(cfg.temporal_patch_size, -1, -1, -1)  # [tp, 3, H, W]: a still is tp equal frames
    return patchify(x, cfg.patch_size, cfg.temporal_patch_size, cfg.spatial_merge_size)


def frames_grid(frames: Tensor, cfg: VisionConfig) -> Grid:
    """The (t, h, w) patch grid `to_patches` gives for uint8 frames [F, H, W, 3]."""
    num_frames, height, width, _ = frames.shape
    t = 1 if num_frames == 1 else num_frames // cfg.temporal_patch_size
    return t, height // cfg.patch_size, width // cfg.patch_size


VideoSource = str | os.PathLike | bytes | bytearray | Any  # path, encoded bytes, [F, H, W, 3] uint8 array, PIL frames


def load_video(
    source: VideoSource,
    fps: float | None = VIDEO_FPS,
    num_frames: int | None = None,
    max_frames: int = VIDEO_MAX_FRAMES,
    frame_multiple: int = 2,
    max_image_pixels: int = MAX_IMAGE_PIXELS,
    source_fps: float | None = None,
) -> tuple[list[Image.Image], list[float]]:
    """Decode and sample a clip -> (RGB frames, timestamp in seconds of each frame).

    source: a file path or encoded bytes (decoded with decord, else PyAV), or already-decoded frames: an array/tensor
    [F, H, W, 3] uint8 or a list of PIL images (then `source_fps`, default `fps`, dates them).
    Sampling: `num_frames` evenly spaced frames when given, else one frame every 1/fps seconds; the count is
    clamped to [frame_multiple, max_frames] and rounded down to a multiple of `frame_multiple` (the temporal
    patch size). A clip shorter than that repeats frames. Every frame must fit `max_image_pixels`.
    """
    if num_frames is not None and num_frames < 1:
        raise MediaError(f"num_frames={num_frames} must be >= 1")
    if fps is not None and not fps > 0:
        raise MediaError(f"fps={fps} must be > 0")
    if isinstance(source, (str, os.PathLike, bytes, bytearray, memoryview)):
        return _decode_video_file(source, fps, num_frames, max_frames, frame_multiple, max_image_pixels)
    frames = _frames_from_arrays(source, max_image_pixels)
    rate = source_fps or fps or VIDEO_FPS
    idx = _sample_indices(len(frames), rate, fps, num_frames, max_frames, frame_multiple)
    return [frames[i] for i in idx], [i / rate for i in idx]


def _frames_from_arrays(source: Any, max_image_pixels: int) -> list[Image.Image]:
    if isinstance(source, Sequence) and source and all(isinstance(f, Image.Image) for f in source):
        frames = list(source)
    else:
        try:
            arr = source.numpy() if isinstance(source, Tensor) else np.asarray(source)
        except (TypeError, ValueError) as e:
            raise MediaError(f"cannot read a video from {type(source).__name__} ({e}); pass a path, bytes, a "
                             "[F, H, W, 3] uint8 array or a list of PIL images") from None
        if arr.ndim != 4 or arr.shape[-1] != 3 or arr.shape[0] < 1 or str(arr.dtype) != "uint8":
            raise MediaError(f"video frames have shape {tuple(arr.shape)} and dtype {arr.dtype}; expected "
                             "[F, H, W, 3] uint8")
        frames = [Image.fromarray(f) for f in arr]
    for f in frames:
        _check_pixels(f.width, f.height, max_image_pixels, "video frame")
    return [_to_rgb(f) for f in frames]


def _decode_video_file(source: Any, fps: float | None, num_frames: int | None, max_frames: int,
                       frame_multiple: int, max_image_pixels: int) -> tuple[list[Image.Image], list[float]]:
    """Decode with decord when it is installed, else PyAV (decord has no wheels for recent Pythons)."""
    if isinstance(source, (str, os.PathLike)) and not os.path.isfile(source):
        raise MediaError(f"video file not found: {os.fspath(source)}")
    if isinstance(source, (bytes, bytearray, memoryview)) and len(source) == 0:
        raise MediaError("cannot decode video: the data is empty")
    name, module = video_decoder()
    decode = _decode_with_decord if name == "decord" else _decode_with_av
    return decode(module, source, fps, num_frames, max_frames, frame_multiple, max_image_pixels)


def video_decoder() -> tuple[str, Any]:
    """("decord", module) when decord is installed, else ("av", module); neither is a MediaError naming the fix."""
    try:
        import decord

        return "decord", decord
    except ImportError:
        pass
    try:
        import av

        return "av", av
    except ImportError:
        raise MediaError("video input needs a video decoder: pip install 'revolta[video]' (decord or PyAV)") from None


def probe_video(source: str | os.PathLike | bytes | bytearray) -> tuple[int, float, int, int] | None:
    """(frame count, frames per second, width, height) of an encoded clip, from its container (at most one frame
    is decoded); None when the container cannot be read (the decoder then refuses it with the reason)."""
    name, module = video_decoder()
    data = io.BytesIO(bytes(source)) if isinstance(source, (bytes, bytearray, memoryview)) else None
    try:
        if name == "decord":
            reader = module.VideoReader(data if data is not None else os.fspath(source), ctx=module.cpu(0),
                                        num_threads=1)
            height, width = reader[0].shape[:2] if len(reader) else (0, 0)
            return len(reader), float(reader.get_avg_fps()), int(width), int(height)
        with module.open(data if data is not None else os.fspath(source)) as container:
            stream = container.streams.video[0]
            # PyAV's path decodes every frame, so the count matters; containers that do not state it are counted
            # packet by packet (demuxing reads no pixels)
            total = stream.frames or sum(1 for p in container.demux(stream) if p.size)
            rate = float(stream.average_rate or 0)
            return total, rate, stream.codec_context.width, stream.codec_context.height
    except Exception:  # noqa: BLE001  any failure here is reported by the decoder itself, with its message
        return None


def _decode_with_decord(decord: Any, source: Any, fps: float | None, num_frames: int | None, max_frames: int,
                        frame_multiple: int, max_image_pixels: int) -> tuple[list[Image.Image], list[float]]:
    try:
        reader = decord.VideoReader(io.BytesIO(bytes(source)) if isinstance(source, (bytes, bytearray, memoryview))
                                    else os.fspath(source), ctx=decord.cpu(0), num_threads=1)
        total, rate = len(reader), float(reader.get_avg_fps())
        if total < 1:
            raise MediaError("the video has no frames")
        first = reader[0].shape  # (H, W, 3)
        _check_pixels(int(first[1]), int(first[0]), max_image_pixels, "video frame")
        idx = _sample_indices(total, rate if rate > 0 else VIDEO_FPS, fps, num_frames, max_frames, frame_multiple)
        batch = reader.get_batch(idx).asnumpy()  # [F, H, W, 3] uint8
    except MediaError:
        raise
    except (decord._ffi.base.DECORDError, RuntimeError, OSError, ValueError) as e:
        raise MediaError(f"cannot decode video: {_decord_message(e)}") from None
    rate = rate if rate > 0 else VIDEO_FPS
    return [Image.fromarray(f) for f in batch], [i / rate for i in idx]


def _decode_with_av(av: Any, source: Any, fps: float | None, num_frames: int | None, max_frames: int,
                    frame_multiple: int, max_image_pixels: int) -> tuple[list[Image.Image], list[float]]:
    """The same sampling as decord's path: frame indices from the frame count and the average rate.

    Every frame is decoded (the codec needs its predecessors anyway), but only the sampled ones are
    converted to RGB; a container that does not state its frame count is counted by decoding it.
    """
    try:
        with av.open(io.BytesIO(bytes(source)) if isinstance(source, (bytes, bytearray, memoryview))
                     else os.fspath(source)) as container:
            if not container.streams.video:
                raise MediaError("cannot decode video: the data has no video stream")
            stream = container.streams.video[0]
            _check_pixels(stream.codec_context.width, stream.codec_context.height, max_image_pixels, "video frame")
            rate = float(stream.average_rate or 0) or VIDEO_FPS
            frames = list(container.decode(stream))  # av.VideoFrame, still in the codec's pixel format
        if not frames:
            raise MediaError("the video has no frames")
        idx = _sample_indices(len(frames), rate, fps, num_frames, max_frames, frame_multiple)
        rgb = [Image.fromarray(frames[i].to_ndarray(format="rgb24")) for i in idx]  # each [H, W, 3] uint8
    except MediaError:
        raise
    except (av.FFmpegError, OSError, ValueError, EOFError) as e:
        reason = getattr(e, "strerror", None) or str(e)  # FFmpeg's reason, without the errno and file name
        raise MediaError(f"cannot decode video: {' '.join(reason.split())[:300]}") from None
    for f in rgb:  # a stream may change size mid-way; the header only told the first
        _check_pixels(f.width, f.height, max_image_pixels, "video frame")
    return rgb, [i / rate for i in idx]


def _decord_message(e: Exception) -> str:
    """decord's error text without its log prefixes and without the echoed input (bytes would be pasted in)."""
    msg = re.sub(r"\[[\d:]+\] \S+:\d+: ", " ", str(e))
    msg = re.sub(r"ERROR opening: .*?, ", "cannot open the data: ", msg, flags=re.S)
    return " ".join(msg.split())[:300]


def _sample_indices(total: int, rate: float, fps: float | None, num_frames: int | None, max_frames: int,
                    multiple: int) -> list[int]:
    """Evenly spaced frame indices into a clip of `total` frames recorded at `rate` fps."""
    want = num_frames if num_frames is not None else max(1, round(total / rate * (fps or rate)))
    want = min(max(multiple, want), max_frames) // multiple * multiple  # max_frames is a cap, never exceeded
    if want < 1:
        raise MediaError(f"max_frames={max_frames} leaves no room for one temporal patch of {multiple} frames; "
                         f"set max_frames >= {multiple}")
    if want == 1:
        return [0]
    return [round(i * (total - 1) / (want - 1)) for i in range(want)]


def preprocess_video(
    frames: Sequence[Image.Image],
    cfg: VisionConfig,
    min_pixels: int = VIDEO_MIN_PIXELS,
    max_pixels: int = VIDEO_MAX_PIXELS,
    image_mean: Sequence[float] = IMAGE_MEAN,
    image_std: Sequence[float] = IMAGE_STD,
) -> tuple[Tensor, Grid]:
    """Sampled RGB frames (a multiple of temporal_patch_size, all one size) -> (pixel_values, grid (t, h, w)).

    Each frame is resized like an image within the per-frame pixel budget; consecutive groups of
    temporal_patch_size frames form one temporal patch (t = F / tp). Needs t*h*w/merge^2 `<|video_pad|>` tokens.
    """
    return to_patches(resize_video(frames, cfg, min_pixels, max_pixels), cfg, image_mean, image_std)


def resize_video(frames: Sequence[Image.Image], cfg: VisionConfig, min_pixels: int = VIDEO_MIN_PIXELS,
                 max_pixels: int = VIDEO_MAX_PIXELS) -> Tensor:
    """Sampled RGB frames -> uint8 [F, H, W, 3], each resized within the per-frame budget (see preprocess_video)."""
    tp = cfg.temporal_patch_size
    if not frames or len(frames) % tp:
        raise MediaError(f"a video needs a positive multiple of temporal_patch_size={tp} frames, got {len(frames)}")
    if len({f.size for f in frames}) != 1:
        raise MediaError(f"video frames differ in size: {sorted({f.size for f in frames})}")
    return torch.stack([resize_to_budget(f, cfg, min_pixels, max_pixels) for f in frames])


def patchify(frames: Tensor, patch_size: int, temporal_patch_size: int, merge_size: int) -> tuple[Tensor, Grid]:
    """frames [F, C, H, W] -> (patches [t*h*w, C*tp*p*p], (t, h, w)) with t = F/tp, h = H/p, w = W/p.

    Patches are listed in merge-block order (t, h/m, w/m, m, m): the m x m neighbours that merge into one LLM
    token are consecutive. Each patch is flattened (channel, frame, row, col), the Conv3d weight's layout.
    """
    num_frames, c, height, width = frames.shape
    p, tp, m = patch_size, temporal_patch_size, merge_size
    if num_frames % tp or height % (p * m) or width % (p * m):
        raise ValueError(f"frames {tuple(frames.shape)}: need F % {tp} == 0 and H, W multiples of {p * m}")
    t, h, w = num_frames // tp, height // p, width // p
    x = frames.reshape(t, tp, c, h // m, m, p, w // m, m, p)
    # dims: 0 t, 1 tp, 2 C, 3 block row, 4 row in block, 5 pixel row, 6 block col, 7 col in block, 8 pixel col
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [t, h/m, w/m, m, m, C, tp, p, p]
    return x.reshape(t * h * w, c * tp * p * p), (t, h, w)


def expand_media_placeholders(
    token_ids: Sequence[int],
    grids: Sequence[Sequence[int]] | Tensor,
    image_token_id: int,
    video_token_id: int,
    merge_size: int,
) -> list[int]:
    """Replace the single pad token of each media item by t*h*w/merge^2 copies of it.

    `grids` lists the (t, h, w) of every image and video in the order their `<|image_pad|>`/`<|video_pad|>`
    tokens appear in `token_ids` (each pad token is one item). Returns the expanded token ids.
    """
    grid_list = _grid_list(grids)
    out: list[int] = []
    item = 0
    for tok in token_ids:
        if tok != image_token_id and tok != video_token_id:
            out.append(tok)
            continue
        if item == len(grid_list):
            raise ValueError(f"token_ids hold more media placeholders than the {len(grid_list)} grids given")
        t, h, w = grid_list[item]
        if h % merge_size or w % merge_size:
            raise ValueError(f"grid {grid_list[item]}: h and w must be multiples of merge_size={merge_size}")
        out.extend([tok] * (t * h * w // merge_size**2))
        item += 1
    if item != len(grid_list):
        raise ValueError(f"{len(grid_list)} grids given but token_ids hold {item} media placeholders")
    return out


def mrope_positions(
    token_ids: Sequence[int],
    image_grids: Sequence[Sequence[int]] | Tensor | None,
    video_grids: Sequence[Sequence[int]] | Tensor | None,
    cfg: ModelConfig,
) -> tuple[Tensor, int]:
    """3-row mRoPE positions of an (already expanded) prompt: (positions LongTensor [3, T], rope_delta).

    Walking the prompt with a running start s = 0:
    * a text token (vision_start/end included) gets s on all three rows; s += 1;
    * a vision item with merged grid (t', h', w') = (t, h/m, w/m) covers the next t'*h'*w' pad tokens; token
      (tau, i, j) in row-major order gets (s + tau, s + i, s + j); then s += max(h', w').
    Images are consumed from `image_grids` in order. A video (t, h, w) acts as t items of grid (1, h, w), one
    per temporal patch group, as with Qwen3.5-style prompts where timestamps separate the groups; contiguous
    groups are placed one after the other. rope_delta = max position + 1 - T; decode token index n is at n + delta.
    """
    image_list = _grid_list(image_grids)
    video_list = [(1, h, w) for t, h, w in _grid_list(video_grids) for _ in range(t)]
    queues = {cfg.image_token_id: image_list, cfg.video_token_id: video_list}
    used = {cfg.image_token_id: 0, cfg.video_token_id: 0}
    if (image_list or video_list) and cfg.vision is None:
        raise ValueError("vision grids given, but the model config has no vision_config")
    m = cfg.vision.spatial_merge_size if cfg.vision is not None else 1
    num_tokens = len(token_ids)
    positions = torch.empty(3, num_tokens, dtype=torch.long)
    s = i = 0
    while i < num_tokens:
        tok = token_ids[i]
        if tok not in queues:  # a text run
            j = i
            while j < num_tokens and token_ids[j] not in queues:
                j += 1
            positions[:, i:j] = torch.arange(s, s + j - i)
            s, i = s + j - i, j
            continue
        k = used[tok]
        if k == len(queues[tok]):
            kind = "image" if tok == cfg.image_token_id else "video frame-group"
            raise ValueError(f"token {i} starts {kind} item {k + 1}, but only {len(queues[tok])} grids were given")
        t, h, w = queues[tok][k]
        used[tok] += 1
        gt, gh, gw = t, h // m, w // m
        n = gt * gh * gw
        if i + n > num_tokens or any(x != tok for x in token_ids[i : i + n]):
            raise ValueError(f"grid {(t, h, w)} needs {n} consecutive pad tokens (id {tok}) from token {i}; "
                             f"expand placeholders with expand_media_placeholders first")
        tau, row, col = torch.meshgrid(torch.arange(gt), torch.arange(gh), torch.arange(gw), indexing="ij")
        positions[:, i : i + n] = s + torch.stack([tau.flatten(), row.flatten(), col.flatten()])
        s, i = s + max(gh, gw), i + n
    for tok, grids in queues.items():
        if used[tok] != len(grids):
            raise ValueError(f"{len(grids)} grids given for token id {tok}, but the prompt uses {used[tok]}")
    rope_delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, rope_delta


def _grid_list(grids: Sequence[Sequence[int]] | Tensor | None) -> list[Grid]:
    if grids is None:
        return []
    rows = grids.tolist() if isinstance(grids, Tensor) else grids
    return [(int(t), int(h), int(w)) for t, h, w in rows]

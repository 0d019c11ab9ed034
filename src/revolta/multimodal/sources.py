"""Where media come from: URL strings and chat content parts -> bytes, paths or in-memory media.

* `resolve_media_source`: base64 `data:` URLs are decoded (strictly), `file://` URLs and plain paths are allowed
  (optionally only under `allowed_local_media_path`), remote `http(s)://` URLs are refused at once with a
  `MediaError`: revolta does not download (no network in the reference deployment, where retrying a failed fetch
  can never succeed). PIL images, bytes and frame arrays pass through.
* `media_from_messages`: the images and videos of a chat conversation's content parts, in template order.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from .media import MediaError


def resolve_media_source(source: Any, allowed_local_media_path: str | os.PathLike | None = None,
                         allow_local_files: bool = True) -> Any:
    """A URL string -> bytes or a local path; anything else (PIL image, bytes, arrays, paths) passes through.

    `data:` URLs must be base64 (decoded strictly). `http(s)://` is refused (no downloads). `file://` URLs and
    plain paths are allowed when `allow_local_files`, and then only under `allowed_local_media_path` if one is set.
    """
    if isinstance(source, Path):
        return _check_local(source, allowed_local_media_path, allow_local_files)
    if not isinstance(source, str):
        return source
    # Path("") is the working directory: "Is a directory: '.'" would name the wrong problem
    if not (source[len("file://"):] if source.lower().startswith("file://") else source).strip():
        raise MediaError(f"the media source {source!r} is empty; pass a data: URL, a local path or the media itself")
    if source.startswith("data:"):
        return _decode_data_url(source)
    scheme = source.split(":", 1)[0].lower() if "://" in source else ""
    if scheme in ("http", "https"):
        raise MediaError(f"remote media URLs are not fetched (downloading is disabled): {source[:100]}; send the "
                         "media inline as a base64 data: URL")
    if scheme == "file":
        return _check_local(Path(unquote(source[len("file://"):])), allowed_local_media_path, allow_local_files)
    if scheme:
        raise MediaError(f"unsupported media URL scheme {scheme!r}; use a data: URL or a local file")
    return _check_local(Path(source), allowed_local_media_path, allow_local_files)


def _decode_data_url(url: str) -> bytes:
    head, sep, data = url[len("data:"):].partition(",")
    if not sep:
        raise MediaError("malformed data: URL (no comma); expected data:<media type>;base64,<data>")
    if not head.split(";")[-1:] == ["base64"]:
        raise MediaError("only base64 data: URLs are supported; expected data:<media type>;base64,<data>")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"invalid base64 in data: URL ({e})") from None


def _check_local(path: Path, allowed: str | os.PathLike | None, allow_local_files: bool) -> Path:
    if not allow_local_files and allowed is None:
        raise MediaError("local media files are not allowed here: no allowed directory is set (allowed_local_media_path, "
                         "--allowed-local-media-path for the server); send the media as a base64 data: URL")
    if allowed is not None:
        root = Path(allowed).resolve()
        if not path.resolve().is_relative_to(root):
            raise MediaError(f"local media path {str(path)!r} is outside the allowed directory {str(root)!r} "
                             "(--allowed-local-media-path)")
    return path


_IMAGE_PARTS = {"image_url": "image_url", "image": "image", "image_pil": "image_pil", "input_image": "image_url"}
_VIDEO_PARTS = {"video_url": "video_url", "video": "video"}
_AUDIO_PARTS = ("input_audio", "audio_url", "audio")


def media_from_messages(messages: Sequence[Mapping[str, Any]],
                        allowed_local_media_path: str | os.PathLike | None = None,
                        allow_local_files: bool = True) -> dict[str, list[Any]]:
    """The images and videos of a conversation's content parts, in the order the chat template places them.

    Parts: OpenAI `{"type": "image_url", "image_url": {"url": U}}` (or a bare URL string), `{"type": "image",
    "image": PIL image | bytes | path | URL}`, `{"type": "video_url", "video_url": {"url": U}}`, `{"type": "video",
    "video": path | bytes | frames}`. URLs are resolved here (`resolve_media_source`); audio parts are refused.
    """
    out: dict[str, list[Any]] = {"image": [], "video": []}
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, str) or not isinstance(content, Sequence):
            continue
        for part in content:
            if not isinstance(part, Mapping):
                continue
            kind, modality = _part_kind(part)
            if kind in _AUDIO_PARTS:
                raise MediaError("At most 0 audio(s) may be provided in one prompt. This model has no audio input.",
                                 param="audio")
            if modality is None:
                continue
            key = (_IMAGE_PARTS if modality == "image" else _VIDEO_PARTS)[kind]
            value = part.get(key, part.get(modality))
            if isinstance(value, Mapping):  # {"url": ...} (OpenAI), detail= is ignored
                value = value.get("url")
            if value is None:
                raise MediaError(f"a {kind!r} content part has no {key!r} value", param=modality)
            try:
                out[modality].append(resolve_media_source(value, allowed_local_media_path, allow_local_files))
            except MediaError as e:  # named like the decoding errors of mm_processor: "image 2: ..."
                raise MediaError(f"{modality} {len(out[modality])}: {e}", param=modality) from None
    return out


def _part_kind(part: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(part type, "image" | "video" | None) of one content part; a part without "type" is known by its key."""
    kind = part.get("type") or next((k for k in (*_IMAGE_PARTS, *_VIDEO_PARTS, *_AUDIO_PARTS) if k in part), None)
    return kind, "image" if kind in _IMAGE_PARTS else "video" if kind in _VIDEO_PARTS else None


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[Any]:
    """`messages` with every image / video part as the chat template's own `{"type": "image"}` / `{"type":
    "video"}` (what vLLM hands the template): a checkpoint's template knows only `image` / `image_url` / `video`
    parts, so `image_pil` and friends would fail there after `media_from_messages` accepted them."""
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, str) or not isinstance(content, Sequence):
            out.append(message)
            continue
        parts = [{"type": m} if isinstance(p, Mapping) and (m := _part_kind(p)[1]) else p for p in content]
        out.append({**message, "content": parts})
    return out

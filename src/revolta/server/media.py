"""Media parts of a request: URL -> bytes -> a decoded image, with every failure a 400 naming the part.

Only `data:` URLs (base64) and files under --allowed-local-media-path are read; the server makes no
outbound fetches. Decoding goes through `revolta.multimodal.load_image`, which turns Pillow's
decompression-bomb, truncation and format errors into MediaError.
"""

from __future__ import annotations

import base64
import binascii
import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from PIL import Image

from ..multimodal import MediaError, load_image
from .errors import bad_request


def read_media_url(url: str, where: str, allowed_local_path: str | None) -> bytes:
    """The bytes behind `url` (`where` names the part in messages, e.g. "messages[0].content[1]")."""
    if not isinstance(url, str) or not url:
        raise bad_request(f"{where}: the media URL is missing or not a string")
    if url.startswith("data:"):
        header, sep, payload = url[5:].partition(",")
        if not sep:
            raise bad_request(f"{where}: malformed data URL (no ',' before the payload)")
        if not header.split(";")[-1].strip().lower() == "base64":
            raise bad_request(f"{where}: only base64 data URLs are supported (data:<type>;base64,<data>)")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request(f"{where}: the data URL's payload is not valid base64") from None
    scheme = urlparse(url).scheme.lower()
    if scheme == "file":
        if allowed_local_path is None:
            raise bad_request(f"{where}: file:// URLs need the server to run with --allowed-local-media-path")
        path = Path(unquote(urlparse(url).path)).resolve()
        root = Path(allowed_local_path).resolve()
        if root not in (path, *path.parents):
            raise bad_request(f"{where}: {path.name} is outside --allowed-local-media-path")
        try:
            return path.read_bytes()
        except OSError as e:
            raise bad_request(f"{where}: cannot read the file: {os.strerror(e.errno or 0)}") from None
    if scheme in ("http", "https"):
        raise bad_request(f"{where}: this server does not download media (offline); send the image as a "
                          "data:image/...;base64 URL")
    raise bad_request(f"{where}: unsupported media URL scheme {scheme or url[:16]!r}; use a data: URL")


def decode_image(data: bytes, where: str) -> Image.Image:
    try:
        return load_image(data)
    except MediaError as e:
        raise bad_request(f"{where}: failed to load image: {e}") from None

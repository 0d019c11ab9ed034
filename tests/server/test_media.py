"""spec/server.md §7 G: media parts are checked (limits, URLs, decoding) with a 400 naming the part;
this engine takes no media yet, so even a valid image is a 400 saying so. The engine keeps serving."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import httpx
import pytest
from PIL import Image

from .conftest import MODEL


def png(size: int = 64) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def bomb_png() -> bytes:
    """A header-only PNG declaring 20000 x 20000 pixels (400 Mpx, above Pillow's bomb limit)."""
    ihdr = struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)
    chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def zeroed_chunk(data: bytes) -> bytes:
    return data[:33] + b"\0" * 8 + data[41:]  # the chunk header after IHDR


def chat_with(server, *parts: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                                                   *parts]}]})


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize("url,says", [
    (data_url(png()[: len(png()) // 2]), "failed to load image"),
    (data_url(zeroed_chunk(png())), "failed to load image"),
    (data_url(bomb_png()), "failed to load image"),
    (data_url(b"\x13\x37" * 100), "failed to load image"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("data:image/png,abc", "only base64 data URLs"),
    ("file:///etc/passwd", "--allowed-local-media-path"),
    ("http://example.com/cat.png", "does not download media"),
    (data_url(png()), "does not take image input yet"),
])
def test_bad_and_unsupported_images_are_400(server, url, says):
    r = chat_with(server, image(url))
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert says in message and "messages[0].content[1]" in message
    assert chat_with(server).status_code == 200  # text-only: still serving


@pytest.mark.parametrize("parts,says", [
    ([image(data_url(png()))] * 2, "At most 1 image(s) may be provided in one prompt."),
    ([{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}], "At most 0 video(s)"),
    ([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}], "At most 0 audio(s)"),
    ([{"type": "hologram"}], "Unsupported chat content part type"),
])
def test_media_limits_and_part_types(server, parts, says):
    r = chat_with(server, *parts)
    assert r.status_code == 400 and says in r.json()["error"]["message"]


def test_anthropic_and_responses_images(server):
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png()[:40]).decode()}}
    r = httpx.post(server.url + "/v1/messages", json={"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": [block, {"type": "text", "text": "x"}]}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "failed to load image" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "max_output_tokens": 1, "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(bomb_png())}]}]})
    assert r.status_code == 400 and "failed to load image" in r.json()["error"]["message"]

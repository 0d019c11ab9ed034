"""spec/server.md §5 and §7 G39-G42: images and video through the server, on the embedded default (random
weights, a real 2-block vision tower). Valid media give 200 on all three chat-like APIs with the expanded
placeholder tokens counted in usage and by the token counters; every bad item is a 400 in the route's envelope
with the loader's message, and the engine keeps serving. Media are generated here: PNGs with pillow, a clip as a
YUV4MPEG2 stream (raw frames that decord reads, like tests/test_mm_llm.py), and an MP4 encoded with PyAV.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib

import httpx
import numpy as np
import pytest
from PIL import Image

from .conftest import MODEL, run_server

LIMITS = {"image": 16, "video": 1}  # the 0.1.3 reference launch setting


def png(size: int = 64, seed: int = 0) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def bomb_png() -> bytes:
    """A header-only PNG declaring 20000 x 20000 pixels (400 Mpx, above Pillow's bomb limit)."""
    ihdr = struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)
    chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def y4m(num_frames: int = 4, height: int = 32, width: int = 32, fps: int = 4) -> bytes:
    rng = np.random.default_rng(5)
    out = [f"YUV4MPEG2 W{width} H{height} F{fps}:1 Ip A1:1 C444\n".encode()]
    for _ in range(num_frames):
        out += [b"FRAME\n", rng.integers(16, 236, (3, height, width), dtype=np.uint8).tobytes()]
    return b"".join(out)


def mp4(codec: str = "mpeg4", num_frames: int = 8, height: int = 64, width: int = 64, fps: int = 4) -> bytes:
    """A short MP4 clip of random frames, encoded with one of the encoders PyAV's FFmpeg bundles."""
    import av

    rng = np.random.default_rng(7)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for _ in range(num_frames):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())  # flush the encoder
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def zeroed_chunk(data: bytes) -> bytes:
    return data[:33] + b"\0" * 8 + data[41:]  # the chunk header after IHDR


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def video(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def chat_with(server, *parts: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                                                   *parts]}]})


def responses_with(server, url: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/responses", timeout=60, json={"model": MODEL, "max_output_tokens": 1, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "x"}, {"type": "input_image", "image_url": url}]}]})


def anthropic_block(data: bytes) -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": base64.b64encode(data).decode()}}


def messages_with(server, block: dict, path: str = "/v1/messages") -> httpx.Response:
    return httpx.post(server.url + path, timeout=60, json={"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": [block, {"type": "text", "text": "x"}]}]})


def pads(size: int, video: bool = False) -> int:
    """Pad tokens of one size x size image (or of one temporal group of a video) under the default processor."""
    from revolta.multimodal import media as mm
    from revolta.config import ModelConfig
    from revolta.presets.default import ensure_default_model

    vision = ModelConfig.from_pretrained(ensure_default_model(progress=False)).vision
    factor = vision.patch_size * vision.spatial_merge_size
    budget = (mm.VIDEO_MIN_PIXELS, mm.VIDEO_MAX_PIXELS) if video else (mm.DEFAULT_MIN_PIXELS, mm.DEFAULT_MAX_PIXELS)
    h, w = mm.smart_resize(size, size, factor, *budget)
    return h * w // factor**2


def image_tokens(size: int) -> int:
    """What one image adds to a prompt: its pads and its <|vision_start|>/<|vision_end|>."""
    return pads(size) + 2


# (url, what the 400 says): G40, each on chat completions, responses and messages
BAD_IMAGES = {
    "truncated png": (data_url(png()[: len(png()) // 2]), "cannot decode image"),
    "zeroed chunk header": (data_url(zeroed_chunk(png())), "cannot identify the image data"),
    "400 Mpx bomb": (data_url(bomb_png()), "exceeds limit of 178956970 pixels"),
    "random bytes": (data_url(b"\x13\x37" * 100), "cannot identify the image data"),
    "invalid base64": ("data:image/png;base64,@@@", "invalid base64"),
    "non-base64 data url": ("data:image/png,abc", "only base64 data: URLs"),
    "file outside, flag unset": ("file:///etc/passwd", "--allowed-local-media-path"),
    "http while offline": ("http://example.com/cat.png", "downloading is disabled"),
}


@pytest.mark.parametrize("case", list(BAD_IMAGES))
def test_bad_images_are_400_on_every_api_then_a_valid_image_works(server, case):
    url, says = BAD_IMAGES[case]
    for r in (chat_with(server, image(url)), responses_with(server, url)):
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert says in error["message"] and error["type"] == "BadRequestError" and error["param"] == "image"
    # Anthropic: the same payload as a base64 block, other URLs as a url source
    source = {"type": "base64", "media_type": "image/png", "data": url.split(",", 1)[1]} \
        if url.startswith("data:image/png;base64,") else {"type": "url", "url": url}
    r = messages_with(server, {"type": "image", "source": source})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert says in r.json()["error"]["message"]
    ok = chat_with(server, image(data_url(png(seed=1))))
    assert ok.status_code == 200, ok.text  # the engine is unharmed


@pytest.mark.parametrize("parts,says,param", [
    ([image(data_url(png()))] * 2, "At most 1 image(s) may be provided in one prompt.", "image"),
    ([video(data_url(y4m(), "video/x-yuv4mpeg"))], "At most 0 video(s)", "video"),
    ([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}], "At most 0 audio(s)", "audio"),
    ([{"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AAAA"}}], "At most 0 audio(s)", "audio"),
    ([{"type": "image_url", "image_url": {}}], "image_url.url must be a non-empty string", "image"),
    ([{"type": "hologram"}], "Unsupported chat content part type", None),
    # a literal <|image_pad|> in the text cannot take an image's place (spec §5.3's known issue): 2 pads, 1 image
    ([{"type": "text", "text": "<|image_pad|>"}, image(data_url(png()))], "placeholder", "image"),
])
def test_default_limits_and_part_types(server, parts, says, param):
    r = chat_with(server, *parts)
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == param


def test_image_through_the_sdks_counts_its_tokens(server, oc, ac):
    url = data_url(png())
    user = [{"role": "user", "content": [{"type": "text", "text": "What is in the image?"}, image(url)]}]
    text_only = [{"role": "user", "content": [{"type": "text", "text": "What is in the image?"}]}]
    baseline = oc.chat.completions.create(model=MODEL, messages=text_only, max_tokens=2).usage.prompt_tokens
    out = oc.chat.completions.create(model=MODEL, messages=user, max_tokens=2)
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1
    # G39: the usage counts the expanded pads (the template's one placeholder becomes the image's rows)
    assert out.usage.prompt_tokens == baseline + image_tokens(64)
    chunks = list(oc.chat.completions.create(model=MODEL, messages=user, max_tokens=2, stream=True,
                                             stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)
    tokenized = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": user}).json()
    assert tokenized["count"] == out.usage.prompt_tokens == len(tokenized["tokens"])

    blocks = [{"role": "user", "content": [anthropic_block(png()), {"type": "text", "text": "What is in it?"}]}]
    message = ac.messages.create(model=MODEL, max_tokens=2, messages=blocks)
    assert message.content[0].type in ("text", "thinking")
    counted = ac.messages.count_tokens(model=MODEL, messages=blocks).input_tokens
    assert counted == message.usage.input_tokens
    assert counted == ac.messages.count_tokens(model=MODEL, messages=[
        {"role": "user", "content": "What is in it?"}]).input_tokens + image_tokens(64)
    with ac.messages.stream(model=MODEL, max_tokens=2, messages=blocks) as stream:
        assert stream.get_final_message().usage.input_tokens == counted

    r = responses_with(server, url)
    assert r.status_code == 200 and r.json()["usage"]["input_tokens"] > image_tokens(64), r.text


def test_count_tokens_with_a_bad_image_is_an_anthropic_400(server):
    r = messages_with(server, anthropic_block(bomb_png()), "/v1/messages/count_tokens")
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and "exceeds limit" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def media_server(tmp_path_factory):
    """--limit-mm-per-prompt at the reference setting, and a directory file:// URLs may read."""
    root = tmp_path_factory.mktemp("media")
    (root / "cat.png").write_bytes(png(seed=3))
    with run_server("--sse-keep-alive-interval", "0", "--limit-mm-per-prompt", json.dumps(LIMITS),
                    "--allowed-local-media-path", str(root)) as s:
        yield s, root


def test_video_and_raised_limits(media_server):
    import openai

    server, root = media_server
    oc = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    clip = data_url(y4m(), "video/x-yuv4mpeg")
    # G42: a short clip in a video_url part -> 200, its temporal groups counted; a corrupt clip -> 400
    text = [{"type": "text", "text": "What happens?"}]
    out = oc.chat.completions.create(model=MODEL, max_tokens=2, messages=[
        {"role": "user", "content": [video(clip), *text]}])
    baseline = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": [
        {"role": "user", "content": text}]}).json()["count"]
    assert out.usage.prompt_tokens >= baseline + pads(32, video=True) + 2  # + its timestamp's text
    bad = chat_with(server, video(data_url(y4m()[:70], "video/mp4")))
    assert bad.status_code == 400 and "cannot decode video" in bad.json()["error"]["message"], bad.text
    # G41 with {"image": 16, "video": 1}
    r = chat_with(server, video(clip), video(clip))
    assert r.status_code == 400 and "At most 1 video(s) may be provided in one prompt." in r.json()["error"]["message"]
    r = chat_with(server, *[image(data_url(png(32, seed=k))) for k in range(17)])
    assert r.status_code == 400 and "At most 16 image(s) may be provided in one prompt." in r.json()["error"]["message"]
    r = chat_with(server, *[image(data_url(png(32, seed=k))) for k in range(16)], video(clip))
    assert r.status_code == 200, r.text
    audio = chat_with(server, {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}})
    assert audio.status_code == 400 and "At most 0 audio(s)" in audio.json()["error"]["message"]
    assert r.json()["usage"]["prompt_tokens"] > 16 * image_tokens(32)
    # file:// only below --allowed-local-media-path
    assert chat_with(server, image(f"file://{root}/cat.png")).status_code == 200
    r = chat_with(server, image("file:///etc/passwd"))
    assert r.status_code == 400 and "outside the allowed directory" in r.json()["error"]["message"]
    r = chat_with(server, image(f"file://{root}/missing.png"))
    assert r.status_code == 400 and "not found" in r.json()["error"]["message"]


def test_mp4_video(media_server):
    """G42: an MP4 in a video_url part -> 200 with its pads counted; a corrupt one -> 400 naming the part, and the
    engine keeps serving."""
    import openai

    server, _ = media_server
    oc = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    text = [{"type": "text", "text": "What happens?"}]
    baseline = oc.chat.completions.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": text}])
    clip = mp4()  # 8 frames of 64 x 64 at 4 fps: 2 s, sampled at 2 fps -> 4 frames, 2 temporal groups
    out = oc.chat.completions.create(model=MODEL, max_tokens=2, messages=[
        {"role": "user", "content": [video(data_url(clip, "video/mp4")), *text]}])
    assert out.choices[0].finish_reason in ("stop", "length")
    # 2 groups of pads, each with its vision start/end and a timestamp's text
    assert out.usage.prompt_tokens >= baseline.usage.prompt_tokens + 2 * (pads(64, video=True) + 2)
    for name, bad in {"truncated": clip[: len(clip) // 2], "random bytes": np.random.default_rng(1).bytes(4000),
                      "zeroed moov": clip[:-600] + bytes(600)}.items():
        r = chat_with(server, video(data_url(bad, "video/mp4")))
        assert r.status_code == 400, (name, r.text)
        error = r.json()["error"]
        assert error["param"] == "video" and error["message"].startswith("video 0: cannot decode video"), (name, error)
        ok = oc.chat.completions.create(model=MODEL, max_tokens=1, messages=[
            {"role": "user", "content": [video(data_url(clip, "video/mp4")), *text]}])
        assert ok.usage.prompt_tokens == out.usage.prompt_tokens


@pytest.mark.parametrize("codec", ["mpeg4", "libx264"])
def test_pyav_fallback_decodes_like_decord(codec, monkeypatch):
    """Without decord, load_video decodes with PyAV: the same sampled frames and timestamps as decord (the oracle);
    corrupt data is a MediaError either way; with neither installed the error says what to install."""
    import sys

    from revolta.multimodal import media as mm

    clip = mp4(codec, num_frames=10, fps=5)
    frames, stamps = mm.load_video(clip, fps=2.0)  # decord: 2 s at 2 fps -> 4 frames
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "decord", None)  # `import decord` raises ImportError
        av_frames, av_stamps = mm.load_video(clip, fps=2.0)
        assert av_stamps == stamps and len(av_frames) == len(frames) == 4
        for a, b in zip(av_frames, frames):
            assert a.size == b.size == (64, 64) and np.array_equal(np.asarray(a), np.asarray(b))
        with pytest.raises(mm.MediaError, match="cannot decode video: Invalid data"):
            mm.load_video(clip[: len(clip) // 2])
        with pytest.raises(mm.MediaError, match="above the limit"):
            mm.load_video(clip, max_image_pixels=1000)
        m.setitem(sys.modules, "av", None)
        with pytest.raises(mm.MediaError, match=r"pip install 'revolta\[video\]' \(decord or PyAV\)"):
            mm.load_video(clip)

"""LLM.generate / LLM.chat with images and video on the embedded default (its vision tower has 2 blocks).

Bad media must be a client error (`MediaError`, a ValueError) that leaves nothing queued, and a valid request
right after must succeed. Test media are generated here: PNGs with pillow, a clip as a YUV4MPEG2 file (a raw
format ffmpeg, and so decord, reads).
"""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from revolta import LLM, SamplingParams
from revolta.multimodal.media import MediaError

GREEDY = SamplingParams(temperature=0, max_tokens=4)


def png_bytes(height=40, width=56, seed=0) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, media_type="image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def bomb_png(width=20000, height=20000) -> bytes:
    """A header-only PNG declaring width x height pixels (400 Mpx: above Pillow's decompression-bomb limit)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def y4m_bytes(num_frames=6, height=48, width=64, fps=10) -> bytes:
    rng = np.random.default_rng(5)
    out = [f"YUV4MPEG2 W{width} H{height} F{fps}:1 Ip A1:1 C444\n".encode()]
    for _ in range(num_frames):
        out += [b"FRAME\n", rng.integers(16, 236, (3, height, width), dtype=np.uint8).tobytes()]
    return b"".join(out)


@pytest.fixture(scope="module")
def llm(default_dir):
    return LLM(model=str(default_dir), limit_mm_per_prompt={"image": 3, "video": 1})


def user(*parts):
    return [{"role": "user", "content": list(parts)}]


def text_part(t="Describe it."):
    return {"type": "text", "text": t}


def test_chat_with_image_and_video(llm, tmp_path):
    clip = tmp_path / "clip.y4m"
    clip.write_bytes(y4m_bytes())
    msgs = user({"type": "image_url", "image_url": {"url": data_url(png_bytes())}},
                {"type": "video", "video": str(clip)}, text_part())
    out = llm.chat(msgs, GREEDY, use_tqdm=False)[0]
    ids = out.prompt_token_ids
    cfg = llm.cfg
    assert ids.count(cfg.image_token_id) > 1 and ids.count(cfg.video_token_id) > 1  # placeholders expanded
    assert len(out.outputs[0].token_ids) == 4
    text_only = llm.chat(user(text_part()), GREEDY, use_tqdm=False)[0]
    assert len(ids) > len(text_only.prompt_token_ids)
    # the same image as a PIL part, a file path and raw bytes through generate: one prompt, the same tokens
    path = tmp_path / "img.png"
    path.write_bytes(png_bytes())
    pil = Image.open(io.BytesIO(png_bytes()))
    a = llm.chat(user({"type": "image", "image": pil}, text_part()), GREEDY, use_tqdm=False)[0]
    b = llm.chat(user({"type": "image_url", "image_url": {"url": f"file://{path}"}}, text_part()), GREEDY,
                 use_tqdm=False)[0]
    c = llm.generate({"prompt": llm.render_chat(user({"type": "image"}, text_part())),
                      "multi_modal_data": {"image": png_bytes()}}, GREEDY, use_tqdm=False)[0]
    assert a.prompt_token_ids == b.prompt_token_ids == c.prompt_token_ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    two = llm.generate({"prompt": llm.render_chat(user({"type": "image"}, text_part())),
                        "multi_modal_data": {"image": [pil]}}, SamplingParams(n=2, temperature=0, max_tokens=4),
                       use_tqdm=False)[0]
    assert [o.token_ids for o in two.outputs] == [c.outputs[0].token_ids] * 2
    # process_prompt: the expanded ids without queuing anything; generating from its result is the same request
    processed = llm.process_prompt(llm.chat_prompt(user({"type": "image", "image": pil}, text_part())))
    assert processed.prompt_token_ids == a.prompt_token_ids and not llm.has_unfinished_requests()
    assert llm.generate(processed, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == a.outputs[0].token_ids
    assert len(llm.engine.encoder_cache) == 0


BAD_IMAGES = {
    "truncated png": data_url(png_bytes()[:300]),
    "400 Mpx header": data_url(bomb_png()),
    "random bytes": data_url(np.random.default_rng(1).integers(0, 256, 2000, dtype=np.uint8).tobytes()),
    "invalid base64": "data:image/png;base64,@@@",
    "non-base64 data url": "data:image/png,abc",
    "remote url": "http://example.com/cat.png",
    "missing file": "file:///nonexistent/cat.png",
}


@pytest.mark.parametrize("case", list(BAD_IMAGES))
def test_bad_image_is_a_client_error_then_a_valid_request_works(llm, case):
    with pytest.raises(MediaError) as err:
        llm.chat(user({"type": "image_url", "image_url": {"url": BAD_IMAGES[case]}}, text_part()), GREEDY,
                 use_tqdm=False)
    assert isinstance(err.value, ValueError) and str(err.value)
    assert not llm.has_unfinished_requests() and not llm.engine.allocator._seqs
    ok = llm.chat(user({"type": "image_url", "image_url": {"url": data_url(png_bytes(seed=2))}}, text_part()),
                  GREEDY, use_tqdm=False)[0]
    assert len(ok.outputs[0].token_ids) == 4
    assert len(llm.engine.encoder_cache) == 0


def test_limits_audio_and_corrupt_video(llm):
    four = [{"type": "image_url", "image_url": {"url": data_url(png_bytes(seed=k))}} for k in range(4)]
    with pytest.raises(MediaError, match=r"At most 3 image\(s\) may be provided in one prompt") as err:
        llm.chat(user(*four, text_part()), GREEDY, use_tqdm=False)
    assert err.value.param == "image"
    clip = data_url(y4m_bytes(), "video/x-yuv4mpeg")
    with pytest.raises(MediaError, match=r"At most 1 video\(s\)"):
        llm.chat(user({"type": "video_url", "video_url": {"url": clip}}, {"type": "video_url", "video_url": {
            "url": clip}}, text_part()), GREEDY, use_tqdm=False)
    with pytest.raises(MediaError, match=r"At most 0 audio\(s\)"):
        llm.chat(user({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}), GREEDY,
                 use_tqdm=False)
    with pytest.raises(MediaError, match="cannot decode video"):
        llm.chat(user({"type": "video_url", "video_url": {"url": data_url(y4m_bytes()[:70], "video/mp4")}}),
                 GREEDY, use_tqdm=False)
    with pytest.raises(MediaError, match="placeholder"):  # two pads, one image
        llm.generate({"prompt": "<|image_pad|><|image_pad|>", "multi_modal_data": {"image": png_bytes()}}, GREEDY,
                     use_tqdm=False)
    assert not llm.has_unfinished_requests()
    ok = llm.chat(user(*four[:3], {"type": "video_url", "video_url": {"url": clip}}, text_part()), GREEDY,
                  use_tqdm=False)[0]
    assert len(ok.outputs[0].token_ids) == 4 and len(llm.engine.encoder_cache) == 0



def test_every_accepted_image_part_renders_through_the_chat_template(llm):
    """Parts `media_from_messages` accepts (vLLM's `image_pil`, the Responses `input_image`, a bare `image` key)
    must render as the same one placeholder, not fail in the template."""
    pil = Image.open(io.BytesIO(png_bytes(seed=4)))
    parts = [{"type": "image_pil", "image_pil": pil}, {"type": "input_image", "image_url": data_url(png_bytes(seed=4))},
             {"image": pil}, {"type": "image_url", "image_url": {"url": data_url(png_bytes(seed=4))}}]
    outs = [llm.chat(user(p, text_part()), GREEDY, use_tqdm=False)[0] for p in parts]
    assert len({tuple(o.prompt_token_ids) for o in outs}) == 1
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1

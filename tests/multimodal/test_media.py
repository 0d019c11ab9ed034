"""Image preprocessing, placeholder expansion and mRoPE positions (spec/model.md §8.1, §8.3)."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from revolta.config import ModelConfig, VisionConfig
from revolta.multimodal.sources import resolve_media_source
from revolta.multimodal.processor import MediaConfig, check_mm_data, parse_limits
from revolta.multimodal.media import (
    MediaError,
    expand_media_placeholders,
    load_image,
    load_video,
    mrope_positions,
    patchify,
    preprocess_image,
    preprocess_video,
    smart_resize,
)

IMG, VID, VS, VE = 500, 501, 502, 503  # image pad, video pad, vision start, vision end
V_TINY = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, num_position_embeddings=16, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64)
TEXT_T4 = dict(vocab_size=512, eos_token_id=511, hidden_size=64, num_hidden_layers=4,
               layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4,
               num_key_value_heads=2, head_dim=32,
               rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                    mrope_section=[2, 1, 1], mrope_interleaved=True),
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
               num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
               hc_lowrank=16, ple_layer_ids=[2], ple_embed_dim=64, heads_per_ngram=2, ngram_vocab_size_base=97,
               make_ngram_vocab_size_divisible_by=8, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
               indexer_budget=8, indexer_compress_ratio=4, split_ngram_parts=1, output_gate_type="sigmoid")


def vision_cfg() -> VisionConfig:
    return VisionConfig(hidden_act="gelu_pytorch_tanh", in_channels=3, **V_TINY)


def model_cfg() -> ModelConfig:
    raw = dict(model_type="qwen4_exp", text_config=dict(TEXT_T4, model_type="qwen4_exp_text"),
               vision_config=dict(V_TINY, model_type="qwen4_exp_vision"), image_token_id=IMG, video_token_id=VID,
               vision_start_token_id=VS, vision_end_token_id=VE)
    return ModelConfig.from_dict(raw)


def random_image(height: int, width: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    arr = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(arr[..., 0] if mode == "L" else arr, mode)


# ---------------------------------------------------------------- smart_resize / preprocess_image


@pytest.mark.parametrize("size", [(37, 53), (9, 11), (300, 200), (20, 900), (1024, 768), (4000, 3000), (32, 32)])
def test_smart_resize_bounds(size):
    height, width = size
    min_pixels, max_pixels = 64 * 64, 512 * 512
    h, w = smart_resize(height, width, factor=32, min_pixels=min_pixels, max_pixels=max_pixels)
    assert h % 32 == 0 and w % 32 == 0
    assert min_pixels <= h * w <= max_pixels
    assert abs(math.log((h / w) / (height / width))) < 0.7  # aspect kept (up to rounding to 32)


def test_smart_resize_matches_hf():
    pytest.importorskip("transformers")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    rng = np.random.default_rng(0)
    for _ in range(300):
        height, width = (int(x) for x in rng.integers(16, 5000, 2))
        if max(height, width) / min(height, width) > 200:
            continue
        for lo, hi in ((256 * 256, 1024 * 1024), (56 * 56, 28 * 28 * 1280)):
            assert smart_resize(height, width, 32, lo, hi) == hf_smart_resize(height, width, 32, lo, hi)


def test_preprocess_grid_and_patch_order():
    cfg = vision_cfg()
    p, m, tp = cfg.patch_size, cfg.spatial_merge_size, cfg.temporal_patch_size
    image = random_image(37, 53)
    pixel_values, grid = preprocess_image(image, cfg, min_pixels=256, max_pixels=4096)
    t, h, w = grid
    H, W = smart_resize(37, 53, p * m, 256, 4096)
    assert grid == (1, H // p, W // p) and 256 <= H * W <= 4096
    assert pixel_values.shape == (t * h * w, 3 * tp * p * p) and pixel_values.dtype == torch.float32
    # direct formula: normalised image, then patch k = (block row, block col, row in block, col in block)
    ref = (np.asarray(image.resize((W, H), Image.Resampling.BICUBIC), dtype=np.float64) / 255.0 - 0.5) / 0.5
    ref = torch.from_numpy(ref).permute(2, 0, 1).float()  # [3, H, W]
    k = 0
    for bh in range(h // m):
        for bw in range(w // m):
            for ih in range(m):
                for iw in range(m):
                    r, c = bh * m + ih, bw * m + iw
                    patch = pixel_values[k].view(3, tp, p, p)  # (channel, frame, row, col)
                    for f in range(tp):
                        torch.testing.assert_close(patch[:, f], ref[:, r * p:(r + 1) * p, c * p:(c + 1) * p])
                    k += 1
    assert k == h * w


@pytest.mark.parametrize("size,mode", [((37, 53), "RGB"), ((20, 90), "RGBA"), ((64, 64), "L"), ((300, 200), "RGB")])
def test_preprocess_matches_hf_processor(size, mode):
    pytest.importorskip("transformers")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image = random_image(*size, mode=mode)
    proc = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3, min_pixels=256, max_pixels=4096)
    ref = proc(images=[image], return_tensors="pt")
    pixel_values, grid = preprocess_image(image, vision_cfg(), min_pixels=256, max_pixels=4096)
    assert [list(grid)] == ref["image_grid_thw"].tolist()
    torch.testing.assert_close(pixel_values, ref["pixel_values"].float(), rtol=0, atol=1e-6)


def test_preprocess_from_bytes_and_transparency():
    rgba = Image.new("RGBA", (16, 8), (0, 0, 0, 0))  # fully transparent -> white
    buf = io.BytesIO()
    rgba.save(buf, format="PNG")
    pixel_values, grid = preprocess_image(buf.getvalue(), vision_cfg(), min_pixels=64, max_pixels=4096)
    assert grid == (1, 2, 4)
    torch.testing.assert_close(pixel_values, torch.ones_like(pixel_values))  # (1 - 0.5) / 0.5


def test_patchify_video_frames():
    frames = torch.randn(4, 3, 8, 8)  # 4 frames -> t = 2
    patches, grid = patchify(frames, patch_size=4, temporal_patch_size=2, merge_size=2)
    assert grid == (2, 2, 2) and patches.shape == (8, 96)
    # patch 4 is the first patch of the second temporal group: frames 2..3, top-left 4x4
    torch.testing.assert_close(patches[4].view(3, 2, 4, 4), frames[2:4, :, :4, :4].transpose(0, 1))


def test_media_errors(tmp_path):
    png = io.BytesIO()
    random_image(32, 32).save(png, format="PNG")
    truncated = png.getvalue()[: len(png.getvalue()) // 2]
    for bad in (b"definitely not an image", b"", truncated, tmp_path / "missing.png"):
        with pytest.raises(MediaError):
            preprocess_image(bad, vision_cfg())
    with pytest.raises(MediaError, match="aspect"):
        preprocess_image(Image.new("RGB", (2000, 5)), vision_cfg())
    with pytest.raises(MediaError):
        load_image(12345)
    assert issubclass(MediaError, ValueError)


def _png_with_zeroed_chunk_header() -> bytes:
    buf = io.BytesIO()
    random_image(64, 64).save(buf, format="PNG", compress_level=0)
    data = bytearray(buf.getvalue())
    idat = data.index(b"IDAT") - 4  # the IDAT chunk's length field
    data[idat:idat + 8] = bytes(8)  # zero its length and type
    return bytes(data)


def _header_only_png(width: int, height: int) -> bytes:
    import struct
    import zlib

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        chunk(b"IEND", b"")


def test_corrupt_and_oversize_images_are_media_errors():
    with pytest.raises(MediaError, match="decompression bomb"):
        load_image(_header_only_png(20000, 20000))  # 400 Mpx: Pillow's own limit, inside Image.open
    with pytest.raises(MediaError, match="above the limit"):
        load_image(_header_only_png(3000, 2000), max_image_pixels=5_000_000)  # ours, from the header
    with pytest.raises(MediaError):
        load_image(_png_with_zeroed_chunk_header())
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n"
    with pytest.raises(MediaError, match="supported format"):
        load_image(eps)  # EPS would run Ghostscript: not on the allow-list
    with pytest.raises(MediaError, match="above the limit"):
        load_image(Image.new("RGB", (100, 100)), max_image_pixels=9999)


def _y4m(path, frames):
    num, height, width, _ = frames.shape
    with open(path, "wb") as f:
        f.write(f"YUV4MPEG2 W{width} H{height} F10:1 Ip A1:1 C444\n".encode())
        for _ in range(num):
            f.write(b"FRAME\n" + np.full((3, height, width), 128, np.uint8).tobytes())
    return path


def test_video_sampling_and_patching(tmp_path):
    clip = _y4m(tmp_path / "clip.y4m", np.zeros((13, 24, 40, 3), np.uint8))  # 1.3 s at 10 fps
    frames, stamps = load_video(clip, fps=2.0)  # 1.3 s * 2 fps = 3 frames -> rounded down to 2
    assert len(frames) == 2 and stamps == [0.0, 1.2] and frames[0].size == (40, 24)
    frames, stamps = load_video(clip.read_bytes(), fps=None, num_frames=5)  # from bytes; 5 -> 4
    assert len(frames) == 4 and stamps == pytest.approx([0.0, 0.4, 0.8, 1.2])
    frames, _ = load_video(clip, fps=10.0, max_frames=6)
    assert len(frames) == 6
    pixel_values, grid = preprocess_video(frames, vision_cfg(), min_pixels=64, max_pixels=24 * 40)
    assert grid == (3, 6, 10) and pixel_values.shape == (3 * 6 * 10, 96)
    # decoded frames given directly: a [F, H, W, 3] array dated by source_fps
    arr = np.random.default_rng(0).integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
    frames, stamps = load_video(arr, fps=None, num_frames=4, source_fps=2.0)
    assert len(frames) == 4 and stamps == [0.0, 0.5, 0.5, 1.0]  # a short clip repeats frames
    assert np.array_equal(np.asarray(frames[1]), arr[1])
    with pytest.raises(MediaError, match="not found"):
        load_video(tmp_path / "missing.mp4")
    with pytest.raises(MediaError, match="cannot decode video"):
        load_video(b"\x00\x00\x00\x18ftypmp42" + bytes(200))  # an mp4 header with nothing behind it
    with pytest.raises(MediaError, match="above the limit"):
        load_video(clip, max_image_pixels=500)
    with pytest.raises(MediaError, match="uint8"):
        load_video(np.zeros((2, 8, 8, 3), np.float32))
    with pytest.raises(MediaError, match="max_frames=1 leaves no room"):  # not 2 frames above the cap
        load_video(arr, fps=None, num_frames=4, max_frames=1)


def test_sources_limits_and_processor_kwargs(tmp_path):
    assert resolve_media_source("data:image/png;base64,AAEC") == b"\x00\x01\x02"
    for bad, why in [("data:image/png;base64,@@", "base64"), ("data:image/png,abc", "base64"),
                     ("data:image/png;base64", "comma"), ("https://example.com/a.png", "not fetched"),
                     ("ftp://host/a.png", "scheme")]:
        with pytest.raises(MediaError, match=why):
            resolve_media_source(bad)
    inside = tmp_path / "media" / "a.png"
    assert resolve_media_source(f"file://{inside}", tmp_path / "media") == inside
    assert resolve_media_source("file:///tmp/a%20b.png") == Path("/tmp/a b.png")
    with pytest.raises(MediaError, match="outside the allowed directory"):
        resolve_media_source("file:///etc/passwd", tmp_path / "media")
    with pytest.raises(MediaError, match="not allowed"):
        resolve_media_source("/etc/passwd", allow_local_files=False)
    assert parse_limits(None) == {"image": 1, "video": 0}  # the release note's default
    assert parse_limits({"image": 16, "video": 1, "audio": 0}) == {"image": 16, "video": 1}
    for bad in ({"audio": 16}, {"pointcloud": 1}, {"image": -1}):
        with pytest.raises(ValueError):
            parse_limits(bad)
    limits = parse_limits(None)
    with pytest.raises(MediaError, match=r"At most 1 image\(s\)"):
        check_mm_data({"image": [b"a", b"b"]}, limits, True)
    with pytest.raises(MediaError, match=r"At most 0 video\(s\)"):
        check_mm_data({"video": b"x"}, limits, True)
    with pytest.raises(MediaError, match="no vision tower"):
        check_mm_data({"image": b"a"}, limits, False)
    assert MediaConfig().updated({"max_pixels": 512 * 512}).max_pixels == 512 * 512
    with pytest.raises(MediaError, match="unknown mm_processor_kwargs"):
        MediaConfig().updated({"max_pixel": 4096})
    with pytest.raises(MediaError, match="min_pixels"):
        MediaConfig(min_pixels=10, max_pixels=5)



def test_processor_kwargs_types_lone_max_pixels_and_empty_sources():
    for bad in ({"max_pixels": "4096"}, {"fps": "2"}, {"num_frames": 2.5}, {"max_frames": True}):
        with pytest.raises(MediaError, match=f"{next(iter(bad))}=.* must be"):  # not a TypeError from a comparison
            MediaConfig().updated(bad)
    # vLLM-style {"max_pixels": N} below the default minimum caps the size: the minimum follows it down
    small = MediaConfig().updated({"max_pixels": 128 * 128, "video_max_pixels": 64 * 64})
    assert (small.min_pixels, small.max_pixels) == (128 * 128, 128 * 128)
    assert (small.video_min_pixels, small.video_max_pixels) == (64 * 64, 64 * 64)
    assert MediaConfig().updated({"max_pixels": 512 * 512}).min_pixels == MediaConfig().min_pixels
    with pytest.raises(MediaError, match="min_pixels"):  # both given: still a contradiction to report
        MediaConfig().updated({"min_pixels": 4096, "max_pixels": 1024})
    for empty in ("", "  ", "file://"):
        with pytest.raises(MediaError, match="empty"):
            resolve_media_source(empty)

# ---------------------------------------------------------------- placeholders


def test_expand_media_placeholders():
    ids = [1, VS, IMG, VE, 2, VS, VID, VE, 3]
    out = expand_media_placeholders(ids, [(1, 4, 4), (2, 4, 6)], IMG, VID, merge_size=2)
    assert out == [1, VS] + [IMG] * 4 + [VE, 2, VS] + [VID] * 12 + [VE, 3]
    with pytest.raises(ValueError):
        expand_media_placeholders(ids, [(1, 4, 4)], IMG, VID, 2)
    with pytest.raises(ValueError):
        expand_media_placeholders(ids, [(1, 4, 4)] * 3, IMG, VID, 2)


# ---------------------------------------------------------------- mRoPE positions


def test_mrope_text_only():
    positions, delta = mrope_positions([5, 6, 7], None, None, model_cfg())
    assert positions.tolist() == [[0, 1, 2]] * 3 and delta == 0


def test_mrope_formula():
    # text(2) + image merged grid 1x2x3 + text(1): image at s = 3 (after vision_start)
    ids = [1, VS] + [IMG] * 6 + [VE]
    positions, delta = mrope_positions(ids, [(1, 4, 6)], None, model_cfg())
    assert positions[:, :2].tolist() == [[0, 1]] * 3
    assert positions[0, 2:8].tolist() == [2] * 6
    assert positions[1, 2:8].tolist() == [2, 2, 2, 3, 3, 3]
    assert positions[2, 2:8].tolist() == [2, 3, 4, 2, 3, 4]
    assert positions[:, 8].tolist() == [5, 5, 5]  # s = 2 + max(2, 3)
    assert delta == 6 - 9


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.Qwen4ExpConfig(text_config=TEXT_T4, vision_config=V_TINY, image_token_id=IMG,
                                         video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE)
    ours, theirs = model_cfg(), ModelConfig.from_dict(hf_cfg.to_dict())
    assert (theirs.vision, theirs.image_token_id, theirs.video_token_id) == (ours.vision, IMG, VID)
    return transformers.Qwen4ExpForConditionalGeneration(hf_cfg).model


def _hf_positions(hf_model, ids, image_grids, video_grids):
    """HF prefill positions [3, T] via compute_3d_position_ids (-> get_rope_index), which also stores rope_deltas."""
    input_ids = torch.tensor([ids])
    mm_types = torch.zeros_like(input_ids, dtype=torch.int32)
    mm_types[input_ids == IMG], mm_types[input_ids == VID] = 1, 2
    hf_model.rope_deltas = None
    positions = hf_model.compute_3d_position_ids(
        input_ids=input_ids, inputs_embeds=None, mm_token_type_ids=mm_types,
        image_grid_thw=torch.tensor(image_grids) if image_grids else None,
        video_grid_thw=torch.tensor(video_grids) if video_grids else None,
    )
    return positions[:, 0], int(hf_model.rope_deltas[0, 0])


CASES = {
    "text+image+text": ([10, 11, VS, IMG, VE, 12, 13, 14], [(1, 4, 4)], []),
    "two images": ([10, VS, IMG, VE, 11, 12, VS, IMG, VE, 13], [(1, 4, 4), (1, 6, 8)], []),
    "image first, wide": ([VS, IMG, VE, 7], [(1, 2, 10)], []),
    # a video of 2 temporal groups; like Qwen3.5 prompts, a timestamp token separates the groups
    "image+video": ([10, VS, IMG, VE, 11, 90, VS, VID, VE, 91, VS, VID, VE, 12], [(1, 4, 4)], [(2, 4, 6)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_mrope_matches_hf(hf_model, case):
    ids, image_grids, video_grids = CASES[case]
    # expand the single placeholder per item (per temporal group for the video)
    grids_in_order, queue_img, queue_vid = [], list(image_grids), [(1, h, w) for t, h, w in video_grids
                                                                 for _ in range(t)]
    for tok in ids:
        if tok == IMG:
            grids_in_order.append(queue_img.pop(0))
        elif tok == VID:
            grids_in_order.append(queue_vid.pop(0))
    ids = expand_media_placeholders(ids, grids_in_order, IMG, VID, merge_size=2)
    positions, delta = mrope_positions(ids, image_grids, video_grids, model_cfg())
    ref, ref_delta = _hf_positions(hf_model, ids, image_grids, video_grids)
    assert positions.shape == (3, len(ids)) and positions.dtype == torch.long
    assert torch.equal(positions, ref)
    assert delta == ref_delta <= 0

    # decode: HF's compute_3d_position_ids puts token index n at n + rope_delta on all rows
    class Cache:
        def get_seq_length(self):
            return len(ids)

    decode = hf_model.compute_3d_position_ids(
        input_ids=torch.tensor([[1, 2]]), inputs_embeds=torch.zeros(1, 2, 64), past_key_values=Cache(),
    )
    expected = torch.arange(len(ids), len(ids) + 2) + delta
    assert torch.equal(decode[:, 0], expected.expand(3, 2))
    assert int(positions.max()) + 1 == expected[0]  # decode continues right after the prompt's last position


def test_mrope_rejects_mismatched_grids():
    cfg = model_cfg()
    with pytest.raises(ValueError):
        mrope_positions([1, IMG, IMG, IMG, 2], [(1, 4, 4)], None, cfg)  # needs 4 pads
    with pytest.raises(ValueError):
        mrope_positions([1, 2], [(1, 4, 4)], None, cfg)  # unused grid
    with pytest.raises(ValueError):
        mrope_positions([1] + [IMG] * 4, None, None, cfg)  # pads without a grid

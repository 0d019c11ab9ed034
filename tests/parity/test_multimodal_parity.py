"""One image between text: vision features, mRoPE positions and PLE on pad ids vs transformers."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_oracle import TOKENS, build_pair, deterministic_topk  # noqa: E402
from test_text_parity import assert_parity  # noqa: E402

from revolta.multimodal.media import mrope_positions  # noqa: E402
from revolta.state import SequenceState  # noqa: E402

IMG, START, END = TOKENS["image_token_id"], TOKENS["vision_start_token_id"], TOKENS["vision_end_token_id"]


def hf_image_logits(hf, ids, pixels, grid):
    mm_types = (ids == IMG).to(torch.int32)[None]  # 1 marks image pads, as HF's processor returns
    hf.model.rope_deltas = None
    with deterministic_topk():
        return hf(input_ids=ids[None], pixel_values=pixels, image_grid_thw=torch.tensor([grid]),
                  mm_token_type_ids=mm_types).logits[0]


def prompt_with_image(grid, n_before=9, n_after=23, seed=0):
    g = torch.Generator().manual_seed(seed)
    t, h, w = grid
    n_pad = t * h * w // 4
    ids = (torch.randint(0, 500, (n_before,), generator=g).tolist() + [START] + [IMG] * n_pad + [END]
           + torch.randint(0, 500, (n_after,), generator=g).tolist())
    pixels = torch.randn(t * h * w, 3 * 2 * 4 * 4, generator=g)
    return torch.tensor(ids), pixels


@pytest.fixture(scope="module")
def pair():
    return build_pair("T4", seed=31, vision=True)


@torch.no_grad()
@pytest.mark.parametrize("grid", [(1, 4, 4), (1, 4, 8)])
def test_image_between_text(pair, grid):
    hf, ours, cfg = pair
    ids, pixels = prompt_with_image(grid)
    ref = hf_image_logits(hf, ids, pixels, grid)
    positions, delta = mrope_positions(ids.tolist(), [grid], [], cfg)
    feats = ours.model.visual(pixels, [grid])
    out = ours(ids[None], positions=positions[:, None, :], mm_embeds=feats)[0]
    assert_parity(out, ref)
    assert delta < 0  # positions lag token indices after an image (s += max(h', w'))


@torch.no_grad()
def test_image_prefill_then_decode_uses_rope_delta(pair):
    hf, ours, cfg = pair
    grid = (1, 4, 4)
    ids, pixels = prompt_with_image(grid, n_after=3)
    cont = torch.randint(0, 500, (12,), generator=torch.Generator().manual_seed(9))
    full = torch.cat([ids, cont])
    ref = hf_image_logits(hf, full, pixels, grid)
    positions, delta = mrope_positions(ids.tolist(), [grid], [], cfg)
    st = SequenceState(rope_delta=delta)
    out = [ours(ids, positions=positions, cu_seqlens=[0, len(ids)], states=[st],
                mm_embeds=ours.model.visual(pixels, [grid]))]
    for tok in cont:  # decode: position = index + rope_delta on all rows
        out.append(ours(tok[None], cu_seqlens=[0, 1], states=[st]))
    assert_parity(torch.cat(out), ref)


@torch.no_grad()
def test_video_between_text(pair):
    """A 4-frame clip through our preprocessing and placeholder expansion (one `<|vision_start|>pads
    <|vision_end|>` run per temporal patch, a timestamp between them), then the whole forward, vs HF."""
    import numpy as np

    from revolta.multimodal.processor import MediaConfig, process_multimodal_prompt

    hf, ours, cfg = pair
    vid = TOKENS["video_token_id"]
    frames = np.random.default_rng(4).integers(0, 256, (4, 16, 24, 3), dtype=np.uint8)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 500, (7,), generator=g).tolist() + [START, vid, END] + \
        torch.randint(0, 500, (9,), generator=g).tolist()
    media = MediaConfig(video_min_pixels=64, video_max_pixels=16 * 24, fps=None)
    mm = process_multimodal_prompt(ids, {"video": frames}, cfg, media, {"video": 1},
                                   timestamp_ids=lambda seconds: [400 + round(seconds * 10)])
    (item,) = mm.items
    assert item.grid == (2, 4, 6) and len(item.runs) == 2
    input_ids = torch.tensor(mm.token_ids)
    mm_types = ((input_ids == vid).to(torch.int32) * 2)[None]  # 2 marks video pads
    hf.model.rope_deltas = None
    with deterministic_topk():
        ref = hf(input_ids=input_ids[None], pixel_values_videos=item.pixel_values(cfg.vision),
                 video_grid_thw=torch.tensor([item.grid]), mm_token_type_ids=mm_types).logits[0]
    out = ours(input_ids[None], positions=mm.positions[:, None, :],
               mm_embeds=ours.model.visual(item.pixel_values(cfg.vision), [item.grid]))[0]
    assert_parity(out, ref)
    assert int(hf.model.rope_deltas[0, 0]) == mm.rope_delta

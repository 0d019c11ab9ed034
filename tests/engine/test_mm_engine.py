"""Media through the engine: encoder scheduling, the encoder cache, media-keyed prefix hits, mRoPE on the paged path.

Greedy outputs of requests with images and video must equal each request run alone on the simple per-sequence
model path (full prompt forward with its mRoPE positions and vision features, then decode at index + rope_delta),
whatever the chunking (chunks split inside media runs), the batch or prefix-cache hits; nothing may leak, and the
encoder cache must stay within its size and end empty.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor
from PIL import Image

from revolta.config import ModelConfig
from revolta.engine import Engine, EngineConfig
from engine_spies import greedy_request
from revolta.multimodal.processor import MediaConfig, process_multimodal_prompt
from revolta.model import FlashNextModel, init_random_weights
from revolta.multimodal.media import MediaError
from revolta.state import SequenceState
from tiny_configs import T4_TEXT, TOKENS, V_TINY

IMG, VID, VS, VE = (TOKENS[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                        "vision_end_token_id"))
# patch 4 x merge 2: one LLM token per 8x8 pixels; a 32x48 image is grid (1, 8, 12) -> 24 pads
MEDIA = MediaConfig(min_pixels=64, max_pixels=48 * 48, video_min_pixels=64, video_max_pixels=24 * 32, fps=None)
LIMITS = {"image": 4, "video": 1}


Req = greedy_request  # a greedy request that runs to exactly max_tokens


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.from_dict(dict(model_type="qwen4_exp", text_config=dict(T4_TEXT, model_type="qwen4_exp_text"),
                                     vision_config=dict(V_TINY, model_type="qwen4_exp_vision"), **TOKENS))
    m = FlashNextModel(cfg, with_mtp=False).eval()
    init_random_weights(m, seed=3)
    return m


def image(height, width, seed):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def text(n, seed):
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def mm_request(model, rid, ids, mm_data, max_tokens=6):
    mm = process_multimodal_prompt(ids, mm_data, model.cfg, MEDIA, LIMITS)
    return Req(rid, mm.token_ids, max_tokens, mm)


@torch.no_grad()
def reference(model, req):
    """Greedy tokens of `req` alone on the per-sequence state path (no scheduler, no paged cache)."""
    mm, ids = req.mm_prompt, req.prompt_token_ids
    st = SequenceState(rope_delta=mm.rope_delta if mm else 0)
    kwargs = {}
    if mm is not None:
        feats = model.model.visual(torch.cat([it.pixel_values(model.cfg.vision) for it in mm.items]), [it.grid for it in mm.items])
        kwargs = dict(positions=mm.positions, mm_embeds=feats)
    logits = model(torch.tensor(ids), cu_seqlens=[0, len(ids)], states=[st], **kwargs)[-1]
    out = []
    for _ in range(req.max_tokens):
        out.append(int(logits.argmax()))
        logits = model(torch.tensor(out[-1:]), cu_seqlens=[0, 1], states=[st])[-1]
    return out


def make_engine(model, **kw):
    cfg = dict(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=20, block_size=16, kv_cache_gib=0.004,
               max_num_encoder_input_tokens=48, encoder_cache_size=64)
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg))


def run(engine, reqs, max_steps=2000):
    for r in reqs:
        engine.add_request(r)
    steps, peak = 0, 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.encoder_cache.num_used)
        steps += 1
        assert steps < max_steps, "the engine stopped making progress"
    return steps, peak


def assert_clean(engine):
    a = engine.allocator
    a.check()
    assert not a._seqs, "requests still hold cache"
    assert a.blocks.num_free == a.config.num_blocks - 1 and a.slots.num_free == a.config.num_slots - 1
    assert len(engine.encoder_cache) == 0 and engine.encoder_cache.num_used == 0, "encoder cache entries leaked"


def test_paged_engine_with_media_equals_per_sequence_path(model):
    frames = np.random.default_rng(7).integers(0, 256, (4, 24, 32, 3), dtype=np.uint8)  # 4 frames -> t = 2
    reqs = [
        mm_request(model, "two-images", text(5, 1) + [VS, IMG, VE] + text(3, 2) + [VS, IMG, VE] + text(4, 3),
                   {"image": [image(32, 48, 1), image(40, 24, 2)]}),
        mm_request(model, "video", text(6, 4) + [VS, VID, VE] + text(5, 5), {"video": frames}),
        # a literal image pad id in a text request batched with media requests stays an ordinary token
        Req("text", text(9, 6) + [IMG] + text(20, 7), 6),
    ]
    video = reqs[1].mm_prompt
    assert video.items[0].grid == (2, 6, 8) and len(video.items[0].runs) == 2  # one run per temporal patch
    assert reqs[0].mm_prompt.rope_delta < 0
    engine = make_engine(model)  # 20-token budget: chunks start and end inside the 24- and 15-pad media runs
    steps, peak = run(engine, reqs)
    assert steps > 6 and 0 < peak <= engine.encoder_cache.capacity
    for r in reqs:
        assert r.token_ids == reference(model, r), r.request_id
    assert_clean(engine)


def test_prefix_hit_with_same_image_and_miss_with_changed_pixel(model):
    engine = make_engine(model, max_num_batched_tokens=64)
    prefix = text(4, 11) + [VS, IMG, VE]
    img = image(32, 48, 3)
    captured = {}

    sample = engine.sampler.sample

    def capture(requests, logits):
        for r, row in zip(requests, logits):
            captured.setdefault(r.request_id, row.clone())
        sample(requests, logits)

    engine.sampler.sample = capture

    def step_all(reqs):
        for r in reqs:
            engine.add_request(r)
        while engine.has_unfinished():
            engine.step()

    first = mm_request(model, "first", prefix + text(6, 12), {"image": [img]})
    step_all([first])
    stats = engine.allocator.stats
    hits = stats.hit_tokens
    again = mm_request(model, "again", prefix + text(6, 12), {"image": [img]})
    step_all([again])
    assert stats.hit_tokens - hits >= 24, stats  # the blocks of the image are reused
    assert torch.equal(captured["again"], captured["first"])  # the last prompt token, computed on the hit
    assert again.token_ids == first.token_ids == reference(model, first)

    changed_img = np.asarray(img).copy()
    changed_img[20, 30, 1] ^= 0x80  # one pixel (inside the image's second block of pads)
    hits = stats.hit_tokens
    changed = mm_request(model, "changed", prefix + text(6, 12), {"image": [Image.fromarray(changed_img)]})
    step_all([changed])
    # only blocks entirely before the image's pads may hit; the image start is at token 5
    assert stats.hit_tokens - hits == 0, stats
    assert (captured["changed"] - captured["first"]).abs().max() > 1e-4
    assert changed.token_ids == reference(model, changed)
    assert_clean(engine)


def test_adjacent_large_images_under_a_small_encoder_cache_progress(model):
    """Two adjacent images that cannot be cached together, next to a text request (the release note's #6)."""
    a, b = image(48, 48, 21), image(48, 40, 22)  # 36 and 30 pads, no token between them
    ids = text(3, 21) + [VS, IMG, IMG, VE] + text(3, 22)
    big = mm_request(model, "adjacent", ids, {"image": [a, b]}, max_tokens=6)
    assert big.mm_prompt.items[0].end == big.mm_prompt.items[1].start
    chat = Req("text", text(12, 23), 4)
    # the cache holds one image at a time; the encoder budget is one image per step; the 16-token budget
    # splits both images over several steps
    engine = make_engine(model, max_num_batched_tokens=16, encoder_cache_size=40, max_num_encoder_input_tokens=36)
    engine.add_request(big)
    engine.add_request(chat)
    steps, text_done_at, media_done_at = 0, None, None
    while engine.has_unfinished():
        engine.step()
        assert engine.encoder_cache.num_used <= 40
        steps += 1
        text_done_at = text_done_at or (steps if chat.finished else None)
        media_done_at = media_done_at or (steps if big.finished else None)
        assert steps < 200, "stalled"
    assert text_done_at < media_done_at  # the text request completed while the media request ran
    assert engine.encoder_cache.peak_used <= 40
    assert big.token_ids == reference(model, big) and chat.token_ids == reference(model, chat)
    assert_clean(engine)


def test_item_equal_to_the_token_budget_and_oversized_items(model):
    ids = text(5, 31) + [VS, IMG, VE] + text(2, 32)
    req = mm_request(model, "exact", ids, {"image": [image(48, 48, 31)]}, max_tokens=3)  # 36 pads
    engine = make_engine(model, max_num_batched_tokens=36, max_num_encoder_input_tokens=36, encoder_cache_size=36)
    run(engine, [req])
    assert req.token_ids == reference(model, req)
    assert_clean(engine)
    small = make_engine(model, max_num_batched_tokens=16, encoder_cache_size=30)
    with pytest.raises(MediaError, match="encoder_cache_size"):
        small.add_request(mm_request(model, "huge", ids, {"image": [image(48, 48, 31)]}))
    assert small.has_unfinished() is False
    with pytest.raises(ValueError, match="encoder_cache_size=0"):
        EngineConfig(max_model_len=64, encoder_cache_size=0)


def test_encoder_cache_stays_bounded_over_many_rounds(model):
    engine = make_engine(model, max_num_batched_tokens=32, encoder_cache_size=64)
    peaks = []
    for round_ in range(6):
        reqs = [mm_request(model, f"r{round_}-{k}", text(3, k) + [VS, IMG, VE] + text(2, k),
                           {"image": [image(32, 40, 100 * round_ + k)]}, max_tokens=2) for k in range(3)]
        _, peak = run(engine, reqs)
        peaks.append(peak)
        assert len(engine.encoder_cache) == 0 and engine.encoder_cache.num_used == 0
    assert max(peaks) <= 64 and engine.encoder_cache.peak_used <= 64
    assert_clean(engine)


def test_preempted_media_requests_recompute_to_identical_tokens(model):
    """A KV pool too small for all requests: preemption frees their encoder holds; recompute re-encodes."""
    reqs = [mm_request(model, f"p{k}", text(20 + 7 * k, 40 + k) + [VS, IMG, VE] + text(9, 50 + k),
                       {"image": [image(32, 48, 60 + k)]}, max_tokens=48) for k in range(4)]
    engine = make_engine(model, kv_cache_gib=0.0005, max_num_batched_tokens=64, max_model_len=256)
    preempted = []
    orig = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: (preempted.append(seq.request_id), orig(seq))
    run(engine, reqs)
    assert preempted, "the cache was large enough for everything: the test did not preempt"
    for r in reqs:
        assert r.token_ids == reference(model, r), r.request_id
    assert_clean(engine)


def test_request_waiting_on_the_encoder_lets_text_in_but_not_later_media(model):
    first = mm_request(model, "first", [VS, IMG, VE] + text(4, 70), {"image": [image(48, 48, 70)]}, max_tokens=3)
    # starts with its image pad: while `first` holds the cache it cannot run a single token
    blocked = mm_request(model, "blocked", [IMG] + text(4, 71), {"image": [image(48, 48, 71)]}, max_tokens=3)
    chat = Req("text", text(6, 72), 3)
    small = mm_request(model, "small", [IMG] + text(3, 73), {"image": [image(16, 16, 73)]}, max_tokens=3)
    assert small.mm_prompt.items[0].num_tokens == 4  # it would fit in the 4 free rows, but must wait its turn
    engine = make_engine(model, max_num_batched_tokens=64, encoder_cache_size=40, max_num_encoder_input_tokens=40)
    for r in (first, blocked, chat, small):
        engine.add_request(r)
    engine.step()
    running = [s.request_id for s in engine.scheduler.running]
    waiting = [s.request_id for s in engine.scheduler.waiting]
    assert running == ["first", "text"] and waiting == ["blocked", "small"]
    run(engine, [])
    for r in (first, blocked, chat, small):
        assert r.token_ids == reference(model, r), r.request_id
    assert_clean(engine)


def test_an_image_repeated_in_a_prompt_is_encoded_once(model):
    img = image(32, 48, 80)
    req = mm_request(model, "twice", text(5, 80) + [VS, IMG, VE] + text(3, 81) + [VS, IMG, VE] + text(2, 82),
                     {"image": [img, img.copy()]})
    a, b = req.mm_prompt.items
    assert a.content_hash == b.content_hash and a.start != b.start
    engine = make_engine(model)  # 20-token chunks: one step ends the first copy and starts the second
    encoded = []
    orig = engine.executor._encode
    engine.executor._encode = lambda items: (encoded.extend(items), orig(items))
    run(engine, [req])
    assert len(encoded) == 1
    assert req.token_ids == reference(model, req)
    assert_clean(engine)


def test_abort_mid_image_frees_the_encoder_cache(model):
    req = mm_request(model, "aborted", text(4, 90) + [VS, IMG, VE] + text(3, 91), {"image": [image(32, 48, 90)]})
    other = mm_request(model, "other", text(4, 92) + [VS, IMG, VE] + text(3, 93), {"image": [image(32, 48, 91)]})
    engine = make_engine(model)
    engine.add_request(req)
    engine.add_request(other)
    engine.step()  # 20 tokens: `aborted` stops inside its image, `other` gets none yet
    assert len(engine.encoder_cache) == 1 and engine.encoder_cache.num_used == 24
    engine.abort("aborted")
    assert len(engine.encoder_cache) == 0
    run(engine, [])
    assert other.token_ids == reference(model, other)
    assert_clean(engine)


@pytest.fixture(scope="module")
def mtp_model():
    cfg = ModelConfig.from_dict(dict(model_type="qwen4_exp", vision_config=dict(V_TINY, model_type="qwen4_exp_vision"),
                                     text_config=dict(T4_TEXT, model_type="qwen4_exp_text", mtp_num_hidden_layers=1),
                                     **TOKENS))
    m = FlashNextModel(cfg).eval()
    init_random_weights(m, seed=5)
    return m


def test_a_prompt_ending_in_a_lone_pad_token_under_mtp_gets_its_vision_row(mtp_model):
    """The last prompt token alone in a step (chunking, or a prefix hit up to it) is scheduled like a decode
    token; with drafting on it must still run as a prefill row with its vision features, not as a verify row
    of the raw pad embedding."""
    req = mm_request(mtp_model, "ends-in-pad", text(8, 95) + [VS, IMG], {"image": [image(32, 48, 95)]}, max_tokens=4)
    assert len(req.prompt_token_ids) == 33 and req.prompt_token_ids[-1] == IMG
    # 16-token chunks leave the last pad alone in the third step; drafting is on from the first round
    spec = {"method": "mtp", "num_speculative_tokens": 2, "draft_policy": "always"}
    engine = make_engine(mtp_model, max_num_batched_tokens=16, speculative_config=spec)
    run(engine, [req])
    assert req.token_ids == reference(mtp_model, req)
    hits = engine.allocator.stats.hit_tokens
    again = mm_request(mtp_model, "again", text(8, 95) + [VS, IMG], {"image": [image(32, 48, 95)]}, max_tokens=4)
    run(engine, [again])  # a prefix hit of 32 tokens leaves the last pad alone too
    assert engine.allocator.stats.hit_tokens - hits == 32
    assert again.token_ids == req.token_ids
    assert_clean(engine)



def spy_mtp_seeds(engine) -> tuple[dict[int, tuple[Tensor, Tensor]], list[tuple[int, int]]]:
    """{position: (target wide row, MTP wide output M)} of every seeded MTP row (step 0) of a one-request run,
    and (first position, rows) of each seeding."""
    rows, seeds, mtp = {}, [], engine.runner.mtp

    def spy(seqs, hidden, step=0, logits_rows=None):
        logits, m = mtp(seqs, hidden, step=step, logits_rows=logits_rows)
        if step == 0:
            flat = [s.num_computed + j for s in seqs for j in range(len(s.token_ids))]
            rows.update({p: (h, x) for p, h, x in zip(flat, hidden, m)})
            seeds.extend((s.num_computed, len(s.token_ids)) for s in seqs)
        return logits, m

    engine.runner.mtp = spy
    return rows, seeds


@torch.no_grad()
@pytest.mark.parametrize("policy", ["always", "paused"])
def test_mtp_rows_at_media_positions_take_the_vision_rows_the_target_used(mtp_model, policy, monkeypatch):
    """The MTP row at p pairs the target's wide state at p with the token at p + 1; where that token is a
    media pad, its embedding is the vision row the target embedded there (vLLM feeds its drafter the target's
    input embeddings), not the raw pad embedding. 16-token chunks open the second and third steps on a pad: the
    token after the previous chunk's last row. Paused drafting leaves the rows of the last chunk and the lone
    pad unseeded (deferred) until its buffer fills."""
    import revolta.spec.mtp as mtp

    model = mtp_model
    req = mm_request(model, "mtp-media", text(8, 96) + [VS, IMG], {"image": [image(32, 48, 96)]}, max_tokens=6)
    ids, mm = req.prompt_token_ids, req.mm_prompt
    S = len(ids)
    assert S == 33 and ids[16] == ids[32] == IMG
    spec = {"method": "mtp", "num_speculative_tokens": 2, "draft_policy": "adaptive" if policy == "paused" else policy}
    engine = make_engine(model, max_num_batched_tokens=16, speculative_config=spec)
    if policy == "paused":
        monkeypatch.setattr(mtp, "MAX_DEFERRED_ROWS", 20)
        engine.policy.should_draft = lambda num_seqs: False
    seeded, seeds = spy_mtp_seeds(engine)
    engine.add_request(req)
    held = 0  # steps that ended with vision rows in the pending rows
    for _ in range(100):
        engine.step()
        for p in engine.drafter.pending.values():  # only the rows of pads after pending rows, in their own copy
            if p.mm_embeds is not None:
                held += 1
                assert sorted(set(p.mm_index)) == sorted(p.mm_index) and 0 <= min(p.mm_index)
                assert max(p.mm_index) < p.hidden.shape[0] and {ids[p.start + r + 1] for r in p.mm_index} == {IMG}
                assert p.mm_embeds.shape[0] == len(p.mm_index)
                assert p.mm_embeds.untyped_storage().nbytes() == p.mm_embeds.nbytes
        if not engine.has_unfinished():
            break
    assert held and not engine.has_unfinished() and not engine.drafter.pending
    assert set(range(S)) <= set(seeded)
    assert policy == "always" or (16, 20) in seeds  # chunk 2, the lone pad and 3 decode rows seeded together
    hidden = torch.stack([seeded[p][0] for p in range(S)])  # [S, h*d] the target rows the engine kept
    tokens = torch.tensor((ids + req.token_ids)[1:S + 1])  # [S] the token after each row
    feats = model.model.visual(torch.cat([it.pixel_values(model.cfg.vision) for it in mm.items]),
                               [it.grid for it in mm.items])  # [24, d]
    pads = (tokens == IMG).nonzero().squeeze(1)
    embed = model.model.language_model.embed_tokens
    _, want = model.mtp(hidden, embed(tokens).index_copy(0, pads, feats),  # [S, h*d] with the target's rows
                        model.make_meta(tokens, [0, S], [SequenceState()], mm.positions[:, :S]))
    got = torch.stack([seeded[p][1] for p in range(S)])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # the check can fail: the pad embedding gives other MTP rows at the media positions
    _, raw = model.mtp(hidden, embed(tokens), model.make_meta(tokens, [0, S], [SequenceState()], mm.positions[:, :S]))
    assert (raw[pads] - want[pads]).abs().max() > 100 * (got - want).abs().max()
    assert_clean(engine)

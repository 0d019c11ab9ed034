"""The DFlash2 drafter's preallocated context store (issue 19): fixed tensors across rounds, slots reused cleanly.

The engine's drafter (`DFlash2Drafter`) is fed arbitrary context rows through `keep` (no target forward: the
drafter cannot tell), and every block it drafts is compared with the drafter model run on a fresh dense
`DraftKVCache` holding the same request's whole context, which is how the drafter drafted before the store.
The tiny drafter has sliding layers of window 8 and one full layer, so contexts wrap the sliding rings.
"""

from __future__ import annotations

import pytest
import torch
from dflash2_fixtures import drafter_config
from test_engine import Req, ids
from test_paged_model import TINY
from test_spec_engine import make_engine, run

from revolta.cache.capacity import CacheLayout
from revolta.cache.storage import CacheStorage
from revolta.config import ModelConfig
from revolta.engine.runner import ModelRunner, StepSequence
from revolta.model import FlashNextModel, init_random_weights
from revolta.presets.default_drafter import init_drafter_weights
from revolta.spec.dflash2 import DraftKVCache
from revolta.spec.dflash2.checkpoint import save_draft_model
from revolta.spec.dflash2.draft_config import DFlash2DraftConfig
from revolta.spec.dflash2.drafter import DFlash2Drafter
from revolta.spec.dflash2.model import DFlash2DraftModel
from revolta.spec.mtp import DraftItem

WINDOW, MAX_LEN = 8, 64


@pytest.fixture(scope="module")
def parts():
    target = FlashNextModel(ModelConfig.from_dict(TINY)).eval()
    init_random_weights(target, seed=5)
    draft = DFlash2DraftModel(DFlash2DraftConfig.from_dict(drafter_config(target.cfg, sliding_window=WINDOW)))
    init_drafter_weights(draft, seed=6)
    layout = CacheLayout(num_blocks=2, block_size=8, num_slots=2, kv_cache_dtype="fp32", draft_kv_cache_dtype="fp32",
                         dtype="float32")
    return target, draft, ModelRunner(target, CacheStorage(target.cfg, layout), kernels="torch")


class Requests:
    """Context rows and tokens per request, fed to the drafter the way the engine's `keep` / `propose` do."""

    def __init__(self, drafter: DFlash2Drafter, width: int):
        self.drafter, self.width = drafter, width
        self.g = torch.Generator().manual_seed(1)
        self.rows: dict[str, list[torch.Tensor]] = {}  # request -> its context rows since its (re)start
        self.start: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}
        self.preemptions: dict[str, int] = {}

    def add(self, rid: str, n: int, start: int = 0, preempted: bool = False) -> None:
        """n committed rows at the request's end (a prompt, or a verify's accepted rows); `start` / `preempted`
        begin its context anew."""
        if rid not in self.tokens or preempted or start:
            self.preemptions[rid] = self.preemptions.get(rid, -1) + 1 if preempted else self.preemptions.get(rid, 0)
            self.tokens[rid] = torch.randint(0, 90, (start,), generator=self.g).tolist()
            self.rows[rid], self.start[rid] = [], start
        end = len(self.tokens[rid])
        rows = torch.randn(n, self.width, generator=self.g)
        self.drafter.keep(rid, rows, end, self.preemptions[rid])
        self.rows[rid].append(rows)
        self.tokens[rid] += torch.randint(0, 90, (n + 1,), generator=self.g).tolist()[:n]

    def item(self, rid: str, num_drafts: int = 7) -> DraftItem:
        done = len(self.tokens[rid])
        ids = self.tokens[rid] + [int(torch.randint(0, 90, (1,), generator=self.g))]
        return DraftItem(rid, StepSequence(ids[done:], done, [], slot=0), ids, self.preemptions[rid], num_drafts)

    def reference(self, target, draft, item: DraftItem) -> list[int]:
        """The drafter model on a fresh dense cache holding the request's whole context."""
        cache = DraftKVCache(start=self.start[item.request_id])
        anchor = torch.tensor([item.all_token_ids[item.step.num_computed]])
        sel = draft([torch.cat(self.rows[item.request_id])], [cache], anchor, target.model.language_model.embed_tokens,
                    target.compute_logits)
        return sel.tokens[0, :item.num_drafts].tolist()


def _check_round(reqs: Requests, target, draft, rids: list[str]) -> None:
    items = [reqs.item(r) for r in rids]
    got = reqs.drafter.propose(items)
    for it, d in zip(items, got):
        assert list(d) == reqs.reference(target, draft, it), it.request_id


def _storage(drafter: DFlash2Drafter) -> list[tuple[int, tuple[int, ...]]]:
    s = drafter.store
    return [(t.data_ptr(), tuple(t.shape)) for t in (*s.keys, *s.values, s.starts, s.ends)]


@pytest.mark.parametrize("static_view", [False, True], ids=["eager-views", "whole-rings"])
@torch.no_grad()
def test_store_stays_put_and_reuses_slots(parts, static_view):
    target, draft, runner = parts
    drafter = DFlash2Drafter(runner, draft, 7, max_num_seqs=2, max_model_len=MAX_LEN)
    store = drafter.store
    store.static_view = static_view  # whole rings: the shapes a CUDA graph of the drafter would fix
    assert store.capacities == (WINDOW, WINDOW, MAX_LEN)  # sliding rings of one window, the full layer max_model_len
    before = _storage(drafter)
    reqs = Requests(drafter, draft.fc.in_features)
    reqs.add("a", 5)
    reqs.add("b", 13)  # longer than the window: the prompt's first rows never reach the rings
    _check_round(reqs, target, draft, ["a", "b"])
    for n in (3, 1, 8, 2):  # accepted rows per round: "a" wraps its rings, "b" keeps going
        reqs.add("a", n)
        reqs.add("b", 9 - n)
        _check_round(reqs, target, draft, ["a", "b"])
    slot_a, slot_b = drafter.caches["a"][0], drafter.caches["b"][0]
    # "a" finishes: its slot is free, and the next request gets it with nothing of "a" visible
    drafter.drop("a")
    assert "a" not in drafter.caches and store.free == [slot_a]
    reqs.add("c", 3)
    reqs.add("b", 1)
    _check_round(reqs, target, draft, ["c", "b"])
    assert drafter.caches["c"][0] == slot_a
    # "b" is preempted and recomputes from position 0: same slot, its old context gone
    reqs.add("b", 6, preempted=True)
    _check_round(reqs, target, draft, ["b"])
    assert drafter.caches["b"][0] == slot_b and store.length(slot_b) == 6
    # a context starting past 0 (a prefix-cache hit) in an occupied store: "c" (least recently drafted,
    # not in this batch) gives its slot up and drafts from fresh rows later
    reqs.add("d", 4, start=20)
    reqs.add("b", 2)
    _check_round(reqs, target, draft, ["d", "b"])
    assert drafter.caches["d"][0] == slot_a and "c" not in drafter.caches
    reqs.add("c", 2, start=len(reqs.tokens["c"]))
    reqs.add("d", 3)
    _check_round(reqs, target, draft, ["c", "d"])  # "b" gives way now
    # more requests drafting at once than slots: refused, naming the fix
    for rid in ("c", "d", "e"):
        reqs.add(rid, 2)
    with pytest.raises(ValueError, match="max_num_seqs"):
        drafter.propose([reqs.item(r) for r in ("c", "d", "e")])
    assert _storage(drafter) == before  # no tensor of the store was reallocated or reshaped
    assert store.ends.tolist() == store.host_end and store.starts.tolist() == store.host_start


@torch.no_grad()
def test_a_context_past_max_model_len_is_refused(parts):
    _, draft, runner = parts
    drafter = DFlash2Drafter(runner, draft, 7, max_num_seqs=1, max_model_len=10)
    reqs = Requests(drafter, draft.fc.in_features)
    reqs.add("a", 11)
    with pytest.raises(ValueError, match="past max_model_len=10"):
        drafter.propose([reqs.item("a")])


@torch.no_grad()
def test_sleep_frees_the_store_and_drafting_resumes_after_wake_up(parts, tmp_path):
    target, draft, _ = parts
    engine = make_engine(target, {"method": "dflash2", "model": str(save_draft_model(draft, tmp_path / "d"))},
                         max_model_len=MAX_LEN)
    reqs = [Req("a", ids(20, seed=1), 6)]
    run(engine, reqs)
    store = engine.drafter.store
    assert engine.spec_stats.num_draft_tokens > 0 and not engine.drafter.caches
    engine.sleep(level=1)
    assert sum(t.untyped_storage().nbytes() for t in store.tensors()) == 0
    engine.wake_up()
    again = [Req("a", reqs[0].prompt_token_ids, 6)]
    drafted = engine.spec_stats.num_draft_tokens
    run(engine, again)
    assert again[0].token_ids == reqs[0].token_ids and engine.spec_stats.num_draft_tokens > drafted

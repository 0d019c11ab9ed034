"""The GatedDeltaNet layer on its own: the paged path (slot-indexed state pools, chunked prefill then decode
steps) equals the per-sequence path token for token and leaves the same state; a verify step computes every
row as a single-token decode would, keeps the state after each row in its draft slot and leaves the committed
state (and the conv window) untouched."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from revolta.cache.storage import GDNCache
from revolta.config import ModelConfig
from revolta.forward import ForwardMeta, PagedMeta, VerifyMeta
from revolta.kernels.ops import kernel_ops
from revolta.layers.gdn import GatedDeltaNet
from revolta.state import SequenceState
from test_paged_model import TINY

NUM_SLOTS = 12


@pytest.fixture(scope="module")
def layer():
    cfg = ModelConfig.from_dict(TINY).text
    torch.manual_seed(0)
    m = GatedDeltaNet(cfg, layer_idx=0).eval()
    with torch.no_grad():  # decays and gates away from their init values, so every term matters
        m.A_log.uniform_(-1.0, 1.0)
        m.dt_bias.uniform_(-0.5, 0.5)
        m.norm.weight.normal_(0.0, 0.2)
    return m


def empty_storage(layer: GatedDeltaNet) -> SimpleNamespace:
    """The GDN part of the paged cache (forward.PagedCache): one state and one conv window per slot."""
    return SimpleNamespace(gdn={layer.layer_idx: GDNCache(
        ssm_state=torch.zeros(NUM_SLOTS, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim),
        conv_state=torch.zeros(NUM_SLOTS, layer.conv_kernel - 1, layer.conv_dim))})


def meta(cu: list[int], paged: PagedMeta | None = None, states=None) -> ForwardMeta:
    T, B = cu[-1], len(cu) - 1
    return ForwardMeta(cu_seqlens=cu, states=states or [SequenceState() for _ in range(B)],
                       input_ids=torch.zeros(T, dtype=torch.long), positions=torch.zeros(3, T, dtype=torch.long),
                       cos=torch.ones(T, 2), sin=torch.zeros(T, 2), paged=paged)


def paged(storage, slots: list[int], cu: list[int], computed: list[int], spec: VerifyMeta | None = None) -> PagedMeta:
    B = len(slots)
    empty = torch.zeros(B, 0)
    return PagedMeta(storage=storage, ops=kernel_ops("torch"), slots=torch.tensor(slots, dtype=torch.int32),
                     has_initial_state=torch.tensor([c > 0 for c in computed]),
                     cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                     seq_lens=torch.tensor([c + b - a for c, a, b in zip(computed, cu, cu[1:])], dtype=torch.int32),
                     block_table=torch.zeros(B, 1, dtype=torch.int32), slot_mapping=torch.zeros(cu[-1], dtype=torch.long),
                     group_cos=empty, group_sin=empty, max_new_tokens=max(b - a for a, b in zip(cu, cu[1:])),
                     spec=spec)


def offsets(lens: list[int]) -> list[int]:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


# two sequences: (chunk lengths per step); 0 = not scheduled that step. Prefill chunks of 5 + 8 and 7, then decodes
SCHEDULE = [(5, 7), (8, 1), (1, 1), (1, 0), (1, 1)]


@torch.no_grad()
def test_paged_steps_equal_the_per_sequence_path(layer):
    d = layer.in_proj_qkv.in_features
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(sum(step[b] for step in SCHEDULE), d, generator=g) for b in range(2)]  # each sequence's rows
    slots, storage = [3, 7], empty_storage(layer)
    ref_states = [SequenceState(), SequenceState()]
    done = [0, 0]
    for step in SCHEDULE:
        run = [b for b in range(2) if step[b]]
        cu = offsets([step[b] for b in run])
        x = torch.cat([xs[b][done[b]:done[b] + step[b]] for b in run])
        got = layer(x, meta(cu, paged(storage, [slots[b] for b in run], cu, [done[b] for b in run])))
        want = layer(x, meta(cu, states=[ref_states[b] for b in run]))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        for b in run:
            done[b] += step[b]
    cache = storage.gdn[layer.layer_idx]
    for b in range(2):
        st = ref_states[b].layers[layer.state_key]
        torch.testing.assert_close(cache.ssm_state[slots[b]], st.recurrent, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(cache.conv_state[slots[b]], st.conv)
    untouched = [s for s in range(NUM_SLOTS) if s not in slots]
    assert not cache.ssm_state[untouched].any() and not cache.conv_state[untouched].any()


def prefill(layer, storage, slots, xs):
    cu = offsets([len(x) for x in xs])
    layer(torch.cat(xs), meta(cu, paged(storage, slots, cu, [0] * len(xs))))


def clone(storage):
    c = storage.gdn[0]
    return SimpleNamespace(gdn={0: GDNCache(ssm_state=c.ssm_state.clone(), conv_state=c.conv_state.clone())})


@pytest.mark.parametrize("keep_drafts", [True, False], ids=["per-draft-slots", "replay"])
@torch.no_grad()
def test_verify_rows_equal_single_token_decodes_and_commit_nothing(layer, keep_drafts):
    d = layer.in_proj_qkv.in_features
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randn(9, d, generator=g), torch.randn(4, d, generator=g)]
    rows = [torch.randn(4, d, generator=g), torch.randn(3, d, generator=g)]  # definite token + 3 and + 2 drafts
    slots = [2, 5]
    storage = empty_storage(layer)
    prefill(layer, storage, slots, prompts)
    committed = clone(storage)

    # the reference: the same rows decoded one token per step, recording the state after each
    ref, ref_out, ref_states = clone(storage), [[], []], [[], []]
    for j in range(max(len(r) for r in rows)):
        run = [b for b in range(2) if j < len(rows[b])]
        cu = offsets([1] * len(run))
        out = layer(torch.stack([rows[b][j] for b in run]),
                    meta(cu, paged(ref, [slots[b] for b in run], cu, [len(prompts[b]) + j for b in run])))
        for i, b in enumerate(run):
            ref_out[b].append(out[i])
            ref_states[b].append(ref.gdn[0].ssm_state[slots[b]].clone())

    R = max(len(r) for r in rows)
    cu = offsets([len(r) for r in rows])
    flat = torch.tensor([b * R + j for b, r in enumerate(rows) for j in range(len(r))])
    table = None
    if keep_drafts:  # running slot, then one slot per draft; padding rows on the dummy slot 0
        table = torch.tensor([[2, 8, 9, 10], [5, 11, 1, 0]], dtype=torch.int32)
    sv = VerifyMeta(num_seqs=2, num_rows=R, flat_index=flat, draft_slots=table)
    out = layer(torch.cat(rows), meta(cu, paged(storage, slots, cu, [len(p) for p in prompts], spec=sv)))

    torch.testing.assert_close(out, torch.cat([torch.stack(o) for o in ref_out]), rtol=1e-4, atol=1e-5)
    assert f"gdn{layer.layer_idx}" in sv.record  # what the commit (spec/commit.py) needs
    cache, before = storage.gdn[0], committed.gdn[0]
    assert torch.equal(cache.conv_state, before.conv_state), "verify wrote a conv window"
    if keep_drafts:  # column j holds the state after row j; column 0 is the running slot (row 0 is definite)
        for b, r in enumerate(rows):
            for j in range(len(r)):
                torch.testing.assert_close(cache.ssm_state[int(table[b, j])], ref_states[b][j], rtol=1e-4, atol=1e-5)
    else:  # replay keeps nothing: the state pools are as before
        assert torch.equal(cache.ssm_state, before.ssm_state)

"""Merged input projections (layers/merged_linear.py): one GEMM for a layer's projections of one input, the
parameters views of the merged weight, so names, state_dict, in-place loads and sleep's reload stay as they were;
a rebound parameter falls back to its own GEMM; a packed (non-plain) part stays separate."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from revolta.config import ModelConfig
from revolta.engine.sleep import SleepingMemory
from revolta.layers.gdn import GatedDeltaNet
from revolta.layers.merged_linear import ROW_ALIGN, merge_linears, project
from revolta.layers.moe import MoE
from revolta.layers.qsa import QSAttention
from test_paged_model import TINY

CFG = ModelConfig.from_dict(TINY).text


class _CountGemms(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.__name__.split(".")[0] in ("mm", "addmm")
        return func(*args, **(kwargs or {}))


def _gemms(parts, merged, x) -> tuple[list[torch.Tensor], int]:
    with torch.no_grad(), _CountGemms() as c:
        out = project(parts, merged, x)
    return out, c.n


def _layers():
    torch.manual_seed(0)
    gdn = GatedDeltaNet(CFG, layer_idx=0).eval()
    qsa = QSAttention(CFG, state_key="qsa3", cache_key=3).eval()
    qsa.q_proj = nn.Linear(CFG.hidden_size, qsa.q_proj.out_features, bias=True)  # a part with a bias
    return gdn, qsa


def test_one_gemm_same_outputs_names_and_state_dict():
    for layer in _layers():
        parts = layer.in_projections()
        before = {k: v.clone() for k, v in layer.state_dict().items()}
        x = torch.randn(5, CFG.hidden_size)
        want, n_split = _gemms(parts, None, x)
        layer.merge_projections()
        merged = layer.merged_in_proj
        assert merged is not None and merged.index == (0, 1, 2, 3)
        after = layer.state_dict()
        assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
        for p in parts:  # views of the one weight: no second copy of the projections
            assert p.weight.untyped_storage().data_ptr() == merged.weight.untyped_storage().data_ptr()
        got, n_merged = _gemms(parts, merged, x)
        assert (n_split, n_merged) == (4, 1)
        for g, w in zip(got, want):
            assert g.stride(-1) == 1 and g.shape == w.shape
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
        layer.merge_projections()
        assert layer.merged_in_proj is merged  # idempotent


def test_in_place_loads_reach_the_merged_weight_and_rebinding_falls_back():
    gdn, _ = _layers()
    gdn.merge_projections()
    parts, x = gdn.in_projections(), torch.randn(3, CFG.hidden_size)
    state = {k: torch.randn_like(v) for k, v in gdn.state_dict().items()}
    gdn.load_state_dict(state)  # copy_ into the views, as load_weights and sleep's reload do
    got, n = _gemms(parts, gdn.merged_in_proj, x)
    assert n == 1
    torch.testing.assert_close(got[1], x @ state["in_proj_z.weight"].T, atol=1e-5, rtol=1e-5)
    gdn.in_proj_b.weight.data = gdn.in_proj_b.weight.data.clone() * 2  # rebound (as .to() / to_dtype do)
    got, n = _gemms(parts, gdn.merged_in_proj, x)
    assert n == 4  # the merged weight no longer holds in_proj_b: every part runs its own GEMM
    torch.testing.assert_close(got[2], x @ (2 * state["in_proj_b.weight"]).T, atol=1e-5, rtol=1e-5)
    gdn.merge_projections()
    got2, n = _gemms(parts, gdn.merged_in_proj, x)
    assert n == 1 and all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(got2, got))


def test_non_plain_part_stays_separate():
    class Packed(nn.Linear):  # stands in for QuantLinear / a parallel subclass: its own forward
        def forward(self, x):
            return super().forward(x) + 1.0

    gdn, _ = _layers()
    gdn.in_proj_z = Packed(CFG.hidden_size, gdn.value_dim, bias=False)
    gdn.merge_projections()
    assert gdn.merged_in_proj.index == (0, 2, 3)
    x = torch.randn(2, CFG.hidden_size)
    got, n = _gemms(gdn.in_projections(), gdn.merged_in_proj, x)
    assert n == 2  # the three plain parts in one GEMM, the packed one alone
    torch.testing.assert_close(got[1], gdn.in_proj_z(x).detach(), atol=0, rtol=0)
    assert merge_linears([gdn.in_proj_qkv, gdn.in_proj_z]) is None  # one plain part: nothing to merge


def test_autograd_reaches_the_parameters():
    gdn, _ = _layers()
    gdn.merge_projections()
    x = torch.randn(2, CFG.hidden_size)
    sum(y.sum() for y in project(gdn.in_projections(), gdn.merged_in_proj, x)).backward()
    assert all(p.weight.grad is not None for p in gdn.in_projections())


def test_sleep_level_2_drops_the_merged_storage():
    """The merged weight is covered by its parts' parameters: level 2 reloads it, it copies nothing to host."""
    gdn, _ = _layers()
    gdn.merge_projections()
    weights = [(p.weight, True) for p in gdn.in_projections()]
    assert SleepingMemory(2, weights, [], torch.device("cpu")).host_bytes() == 0
    partly = weights[:3] + [(weights[3][0], False)]  # a tensor that cannot be reloaded on the storage: kept
    assert SleepingMemory(2, partly, [], torch.device("cpu")).host_bytes() == gdn.merged_in_proj.weight.nbytes
    assert SleepingMemory(2, weights[:3], [], torch.device("cpu")).host_bytes() == gdn.merged_in_proj.weight.nbytes


def test_an_odd_merged_width_is_padded_to_16_byte_rows():
    """MoE's router and shared-expert gate are E + 1 wide: the merged weight gets zero rows up to a multiple of
    ROW_ALIGN so the product's rows are 16-byte aligned in 16-bit (cuBLAS's aligned kernels); the parts' outputs,
    names and state_dict are those of the unpadded parts."""
    torch.manual_seed(0)
    moe = MoE(hidden_size=32, num_experts=12, top_k=2, intermediate_size=16, shared_intermediate_size=16).eval()
    with torch.no_grad():  # the experts' banks start as torch.empty: NaN garbage would fail torch.equal below
        for p in moe.parameters():
            p.normal_()
    parts, x = moe.router_projections(), torch.randn(5, 32)
    want, n_split = _gemms(parts, None, x)
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    moe.merge_projections()
    merged = moe.merged_router
    assert merged.sizes == (12, 1) and merged.weight.shape == (16, 32) and ROW_ALIGN == 8
    assert torch.count_nonzero(merged.weight[13:]) == 0
    after = moe.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    got, n_merged = _gemms(parts, merged, x)
    assert (n_split, n_merged) == (2, 1)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.stride() == (16, 1)
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    half = MoE(32, 12, 2, 16, 16).half()
    half.merge_projections()
    with torch.no_grad():  # autograd on: every part runs alone (test_autograd_reaches_the_parameters)
        y = project(half.router_projections(), half.merged_router, x.half())[0]
    assert y.stride(0) * y.element_size() % 16 == 0
    gdn, _ = _layers()  # a width that is already a multiple of 8 gets no padding
    gdn.merge_projections()
    assert gdn.merged_in_proj.weight.shape[0] == sum(gdn.merged_in_proj.sizes)


# ---- packed (quantized) parts: one packed GEMV ---------------------------------------------------------------


def _packed(layer, names, fmt_name, seed=0, bias_on=()):
    """Swap the layer's projections `names` for QuantLinears holding `fmt_name` tensors written by the format's own
    tool (tests/quant/quant_checkpoints.quantize_weight: AutoAWQ's packing, compressed-tensors' compressors)."""
    from quant_checkpoints import quantize_weight

    from revolta.layers.linear import QuantLinear
    from revolta.quant.config import WeightScheme
    from revolta.quant.formats import weight_format

    fmt = weight_format(WeightScheme(*{"awq": ("awq", 4, 32, False), "ct-int4": ("ct-int4", 4, 32, True),
                                       "ct-int4-asym": ("ct-int4", 4, 32, False),
                                       "ct-nvfp4": ("ct-nvfp4", 4, 16, True)}[fmt_name]))
    gen = torch.Generator().manual_seed(seed)
    for name in names:
        owner, attr = (layer.indexer, "index_qk_proj") if name == "index_qk_proj" else (layer, name)
        old = getattr(owner, attr)
        q = QuantLinear(old.in_features, old.out_features, name in bias_on, fmt)
        stored, _ = quantize_weight(torch.randn(old.out_features, old.in_features, generator=gen) * 0.1, fmt_name)
        with torch.no_grad():
            for n in q.packed_names:
                getattr(q, n).copy_(stored[n].reshape(getattr(q, n).shape))
            if q.bias is not None:
                q.bias.copy_(torch.randn(q.out_features, generator=gen))
        setattr(owner, attr, q)
    return layer


def _count_packed(monkeypatch):
    import revolta.layers.linear as L
    import revolta.layers.merged_linear as ML

    calls = []
    real = L.quant_linear

    def counting(x, fmt, packed, n, *a, **k):
        calls.append(n)
        return real(x, fmt, packed, n, *a, **k)

    monkeypatch.setattr(L, "quant_linear", counting)
    monkeypatch.setattr(ML, "quant_linear", counting)
    return calls


@pytest.mark.parametrize("fmt_name", ["awq", "ct-int4-asym"])
def test_packed_parts_run_as_one_gemv(fmt_name, monkeypatch):
    """GDN's packed in_proj_qkv / in_proj_z and QSA's four packed projections (one with a bias) become one packed
    GEMV each: outputs equal the separate calls, names and state_dict unchanged, the parts' buffers views of the
    merged tensors (no second copy)."""
    calls = _count_packed(monkeypatch)
    gdn, qsa = _layers()
    _packed(gdn, ("in_proj_qkv", "in_proj_z"), fmt_name)
    _packed(qsa, ("q_proj", "k_proj", "v_proj", "index_qk_proj"), fmt_name, seed=1, bias_on=("k_proj",))
    for layer, packed_index, plain_index in ((gdn, (0, 1), (2, 3)), (qsa, (0, 1, 2, 3), None)):
        parts, x = layer.in_projections(), torch.randn(3, CFG.hidden_size)
        before = {k: v.clone() for k, v in layer.state_dict().items()}
        calls.clear()
        want, _ = _gemms(parts, None, x)
        assert len(calls) == len(packed_index)
        layer.merge_projections()
        merged = layer.merged_packed_in_proj
        assert merged is not None and merged.index == packed_index
        assert (layer.merged_in_proj.index if layer.merged_in_proj is not None else None) == plain_index
        after = layer.state_dict()
        assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
        for i in packed_index:
            for name, t in parts[i].packed().items():
                if name in merged.views[0]:
                    assert t.untyped_storage().data_ptr() == merged.packed[name].untyped_storage().data_ptr()
        calls.clear()
        got, _ = _gemms(parts, (layer.merged_in_proj, merged), x)
        assert calls == [sum(parts[i].out_features for i in packed_index)]  # one GEMV over every packed part
        for g, w in zip(got, want):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
        layer.merge_projections()
        assert layer.merged_packed_in_proj is merged  # idempotent


def test_packed_merge_follows_loads_and_falls_back_when_rebound(monkeypatch):
    """An in-place load (copy_ into the strided views) reaches the merged tensors; a rebound buffer takes its part
    off the merge, every packed part then runs its own GEMV (on contiguous copies of its views), and merging again
    brings the one GEMV back. The Triton path (interpreter here) gives the separate calls' outputs too."""
    calls = _count_packed(monkeypatch)
    gdn, _ = _layers()
    _packed(gdn, ("in_proj_qkv", "in_proj_z"), "awq")
    gdn.merge_projections()
    parts, x = gdn.in_projections(), torch.randn(2, CFG.hidden_size)
    fresh, _ = _layers()
    _packed(fresh, ("in_proj_qkv", "in_proj_z"), "awq", seed=7)
    gdn.load_state_dict(fresh.state_dict())
    assert not gdn.in_proj_qkv.qweight.is_contiguous()  # AWQ packs along its last axis: column slices
    merges = (gdn.merged_in_proj, gdn.merged_packed_in_proj)
    calls.clear()
    got, _ = _gemms(parts, merges, x)
    assert len(calls) == 1
    want = [fresh.in_proj_qkv(x), fresh.in_proj_z(x)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.detach(), atol=1e-5, rtol=1e-5)
    gdn.in_proj_z.scales.data = gdn.in_proj_z.scales.data.clone() * 2  # rebound (as .to() does)
    calls.clear()
    got, _ = _gemms(parts, merges, x)
    assert len(calls) == 2
    torch.testing.assert_close(got[1], 2 * want[1].detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[0], want[0].detach(), atol=1e-5, rtol=1e-5)
    gdn.merge_projections()
    merges = (gdn.merged_in_proj, gdn.merged_packed_in_proj)
    for p in parts[:2]:
        p.kernel = "triton"
    calls.clear()
    got, _ = _gemms(parts, merges, x[:1])
    assert len(calls) == 1
    for p, g in zip(parts[:2], got):
        p_alone = p.dequantize(torch.float32)
        torch.testing.assert_close(g, x[:1] @ p_alone.T, atol=2e-5, rtol=2e-5)


def test_packed_parts_of_other_formats_or_with_global_scales_stay_apart():
    """NVFP4's per-linear global scale cannot be shared, so its parts keep their own GEMVs; parts of two formats
    merge only with the first part's format."""
    gdn, _ = _layers()
    _packed(gdn, ("in_proj_qkv", "in_proj_z"), "ct-nvfp4")
    gdn.merge_projections()
    assert gdn.merged_packed_in_proj is None and gdn.merged_in_proj.index == (2, 3)
    x = torch.randn(2, CFG.hidden_size)
    got, _ = _gemms(gdn.in_projections(), (gdn.merged_in_proj, None), x)
    torch.testing.assert_close(got[0], gdn.in_proj_qkv(x).detach(), atol=0, rtol=0)
    _, qsa = _layers()
    _packed(qsa, ("q_proj", "v_proj"), "awq")
    _packed(qsa, ("k_proj", "index_qk_proj"), "ct-int4", seed=3)
    qsa.merge_projections()
    assert qsa.merged_packed_in_proj.index == (0, 2) and qsa.merged_in_proj is None

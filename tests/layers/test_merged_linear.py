"""Merged input projections (layers/merged_linear.py): one GEMM for a layer's projections of one input, the
parameters views of the merged weight, so names, state_dict, in-place loads and sleep's reload stay as they were;
a rebound parameter falls back to its own GEMM; a packed (non-plain) part stays separate."""

from __future__ import annotations

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

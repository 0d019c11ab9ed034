"""The dense packed GEMV on the group-factored nibble decode (kernels/quant/gemv_nibble.py) against the formats' fp32
dequantized references under the interpreter: AWQ int4, compressed-tensors int4 (symmetric q + 8 and with zero
points), NVFP4 (ModelOpt: 2 global-scale shards; compressed-tensors: inverted global scale); M = 1, 3, 16, 17, 40
in fp16 and bf16 (fp32 too), K of 4 groups (8 for NVFP4) in 2 split-K slices (and group 128 over 4 K steps), 72
features (a masked N tile), bias; row invariance under one config; the launch configs at the real shapes; the default
path switch.
Packed test weights and the bf16 interpreter fixture: test_quant.py, conftest.py."""

import pytest
import torch
import triton
from test_quant import CASES

from revolta.kernels.quant import gemv_nibble
from revolta.kernels.quant.gemv_nibble import nibble_gemv_config, use_nibble
from revolta.kernels.quant.nibble import split_len

pytestmark = pytest.mark.usefixtures("poison", "bf16_dots")  # conftest.py: NaN-poisoned outputs; bf16 as on the GPU

N, K, G = 72, 128, 32
LAYOUT = {"awq": "awq", "ct_sym": "ct_int4", "ct_asym": "ct_int4", "nvfp4": "nvfp4", "nvfp4_ct": "nvfp4"}
EPS = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 1e-5}


def _config(name, M):
    """nibble_gemv_config's tiles for M rows, with 32-feature N tiles (3, the last masked) and 2 K slices."""
    group = 16 if LAYOUT[name] == "nvfp4" else G
    cfg = nibble_gemv_config(M, N, K, group, LAYOUT[name], num_sms=1)
    return cfg | dict(BLOCK_N=32, SPLIT_K=2, k_per_split=split_len(K, 2, cfg["BLOCK_K"]))


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("M,dtype", [(1, torch.float16), (1, torch.bfloat16), (3, torch.bfloat16),
                                     (16, torch.float16), (17, torch.bfloat16), (40, torch.float16),
                                     (40, torch.bfloat16)], ids=str)
def test_nibble_gemv_matches_reference(name, M, dtype):
    g = torch.Generator().manual_seed(M)
    make, ref, tri, _, _ = CASES[name]
    args = make(N, K, G, g)
    x = torch.randn(M, K, generator=g).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype) if M == 3 else None
    want = ref(x, *args, bias=bias)  # x @ (W dequantized to fp32).T in fp32, rounded once to x.dtype
    got = tri(x, *args, bias=bias, config=_config(name, M))
    assert got.dtype == dtype and not got.isnan().any()
    # codes are exact in x.dtype and products exact in fp32: only the sum order and the final rounding differ
    torch.testing.assert_close(got.float(), want.float(), rtol=EPS[dtype], atol=1e-3 * want.abs().max().item())


@pytest.mark.parametrize("name", CASES)
def test_nibble_gemv_fixup_is_bitwise_the_reduce_launch(name, monkeypatch):
    """FIXUP on the nibble path of every format (the last K slice of each tile adds the partials, kernels/quant/
    common.py splitk_fixup): bitwise the reduce launch's output, with bias; each format's gemv hands the caller's
    counters (a layer's own) to the launch, which leaves them at 0."""
    from revolta.kernels.quant import common

    handed, real = [], common.splitk_counters

    def spy(tiles, device, c=None):
        handed.append(c)
        return real(tiles, device, c)

    monkeypatch.setattr(common, "splitk_counters", spy)
    g = torch.Generator().manual_seed(3)
    make, ref, tri, _, _ = CASES[name]
    args = make(N, K, G, g)
    x = torch.randn(3, K, generator=g).to(torch.float16)
    bias = torch.randn(N, generator=g).to(torch.float16)
    want = tri(x, *args, bias=bias, config=_config(name, 3))
    counters = torch.zeros(N, dtype=torch.int32)
    got = tri(x, *args, bias=bias, config=_config(name, 3) | dict(FIXUP=True), counters=counters)
    assert torch.equal(got, want) and not counters.any()
    assert len(handed) == 1 and handed[0] is counters


@pytest.mark.parametrize("name", ["awq", "ct_asym"])
def test_nibble_gemv_groups_wider_than_the_k_step(name):
    """Group 128: four 32-input K steps share one scale and zero (split-K cuts inside the group)."""
    g = torch.Generator().manual_seed(5)
    make, ref, tri, _, _ = CASES[name]
    args = make(N, 256, 128, g)
    x = torch.randn(3, 256, generator=g).to(torch.float16)
    cfg = nibble_gemv_config(3, N, 256, 128, LAYOUT[name], num_sms=1) | dict(SPLIT_K=4, k_per_split=64)
    want = ref(x, *args)
    got = tri(x, *args, config=cfg)
    torch.testing.assert_close(got.float(), want.float(), rtol=EPS[torch.float16], atol=1e-3 * want.abs().max().item())


@pytest.mark.parametrize("name", ["awq", "ct_asym", "nvfp4"])
def test_nibble_gemv_fp32_activations(name):
    g = torch.Generator().manual_seed(7)
    make, ref, tri, _, _ = CASES[name]
    args = make(N, K, G, g)
    x = torch.randn(5, K, generator=g)
    want = ref(x, *args)
    got = tri(x, *args, nibble=True)  # the default config on the interpreter's 80 "SMs"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("name", ["awq", "ct_sym", "nvfp4"])
def test_nibble_gemv_rows_are_invariant_under_one_config(name):
    """A row's result does not depend on the other rows of the call (same config: BLOCK_M 16, 2 K slices)."""
    g = torch.Generator().manual_seed(3)
    make, _, tri, _, _ = CASES[name]
    args = make(N, K, G, g)
    x = torch.randn(5, K, generator=g).to(torch.bfloat16)
    cfg = _config(name, 1)
    assert cfg == _config(name, 5)
    five = tri(x, *args, config=cfg)
    for r in range(5):
        assert torch.equal(tri(x[r:r + 1], *args, config=cfg), five[r:r + 1]), r


REAL = [(12288, 2560), (512, 2560), (2560, 6144), (10240, 2560), (6144, 2560), (1280, 2560), (2560, 640)]


def test_nibble_configs_at_the_real_shapes():
    for n, k in REAL:
        for layout, group in (("awq", 32), ("nvfp4", 16)):
            one = nibble_gemv_config(1, n, k, group, layout, num_sms=132, arch=90)
            programs = triton.cdiv(n, one["BLOCK_N"]) * one["SPLIT_K"]
            # M = 1 fills the H200's SMs (k_proj, 8 tiles of 64 features: 128 programs at the widest split)
            assert programs >= 132 or one["SPLIT_K"] == gemv_nibble.NIBBLE_MAX_SPLIT, (n, k, layout, one)
            assert one["k_per_split"] * one["SPLIT_K"] >= k and one["k_per_split"] % one["BLOCK_K"] == 0
            assert one["k_per_split"] >= 2 * one["BLOCK_K"]  # at least 2 K steps a slice
            for M in (1, 5, 8, 16, 40, 64):
                cfg = nibble_gemv_config(M, n, k, group, layout, num_sms=132, arch=90)
                assert cfg["BLOCK_M"] >= min(M, 16) and triton.cdiv(M, cfg["BLOCK_M"]) == 1
                assert cfg["BLOCK_K"] == group  # one group per K step
                if cfg["BLOCK_M"] == 16:  # the swept skinny tiles (sweep_nibble_gemv.py): one config for 1-16 rows
                    assert (cfg["BLOCK_N"], cfg["num_stages"]) == (64, 3) and cfg == one, (n, k, M, cfg)
                else:  # 64 rows (and NVFP4): wide tiles, the partials held to the budget
                    assert cfg["BLOCK_N"] == 128
                    budget = max(n * k // 2 // gemv_nibble.NIBBLE_WS_SHARE, gemv_nibble.NIBBLE_WS_FLOOR)
                    assert cfg["SPLIT_K"] == 1 or cfg["SPLIT_K"] * M * n * 8 <= budget, (n, k, M, cfg)
        sm70 = nibble_gemv_config(40, n, k, 32, "awq", num_sms=80, arch=70)
        assert (sm70["BLOCK_M"], sm70["BLOCK_N"]) == (16, 32)  # narrow tiles: no spills (test_quant_aot.py)


def test_the_default_path_switch():
    """The nibble path by default: AWQ and compressed-tensors int4 on sm80+ with 16-bit activations; nibble= decides
    when given."""
    assert use_nibble(90, torch.bfloat16, "awq") and use_nibble(80, torch.float16, "ct_int4")
    assert use_nibble(90, torch.bfloat16, "nvfp4") and not use_nibble(90, torch.bfloat16, "nvfp4", nibble=False)
    assert not use_nibble(70, torch.float16, "awq") and use_nibble(70, torch.float16, "awq", nibble=True)
    assert not use_nibble(90, torch.float32, "awq") and not use_nibble(None, torch.bfloat16, "awq")
    assert not use_nibble(90, torch.bfloat16, "awq", nibble=False)
    # from 17 rows only the widest projections (the 64-row tiles lost at N <= 6144 on an H100: RESULTS.md K6b)
    for M, N, want in ((16, 2560, True), (17, 2560, False), (40, 6144, False), (40, 10240, True), (40, 12288, True)):
        assert use_nibble(90, torch.float16, "awq", M=M, N=N) is want, (M, N)
        assert use_nibble(90, torch.float16, "awq", nibble=True, M=M, N=N)  # asked: always
    for M in (1, 5, 40):  # compiled for sm_90, NVFP4's 16 / 32-row nibble tiles summed wrong (tests/gpu)
        assert nibble_gemv_config(M, 512, 2560, 16, "nvfp4", num_sms=132, arch=90)["BLOCK_M"] == 64
        assert nibble_gemv_config(M, 512, 2560, 32, "awq", num_sms=132, arch=90)["BLOCK_M"] == (16 if M < 40 else 64)
    x = torch.zeros(3, K, dtype=torch.float16)
    assert "NIBBLE_DOT" not in gemv_nibble.gemv_config_for(x, N, K, G, "awq", 8)  # CPU: the tile path by default
    assert gemv_nibble.gemv_config_for(x, N, K, G, "awq", 8, nibble=True)["NIBBLE_DOT"]

"""Packed-weight kernels (kernels/quant) against their torch references under the interpreter: AWQ int4,
compressed-tensors int4 (symmetric / asymmetric), NVFP4 (ModelOpt / compressed-tensors global scale),
group sizes 32/64/128, odd feature counts, fp32 and fp16, M from 1 to 64 (the GEMV and tl.dot tile paths),
split-K, bias, NaN-poisoned outputs; the large-M path (dequantized slices + torch matmul)."""

import pytest
import torch

from revolta.kernels.quant import awq, ct_int4, nvfp4
from revolta.kernels.quant.common import dequant_matmul, gemv_config


def _int32(shape, g):
    return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, generator=g)


def _awq(N, K, G, g):
    return (_int32((K, N // 8), g), _int32((K // G, N // 8), g), (torch.rand(K // G, N, generator=g) * 0.02).half())


def _ct(N, K, G, g, asym):
    return (_int32((N, K // 8), g), (torch.rand(N, K // G, generator=g) * 0.02).bfloat16(),
            _int32((N // 8, K // G), g) if asym else None)


def _fp4(N, K, g, shards, inverted=False):
    global_scale = torch.rand(shards, generator=g) * 0.01 + 0.001
    return (torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g),
            (torch.rand(N, K // 16, generator=g) * 2 + 0.1).to(torch.float8_e4m3fn),
            1 / global_scale if inverted else global_scale)


CASES = {  # name -> (packed args of (N, K, group), reference gemv, triton gemv, ref dequant, triton dequant)
    "awq": (lambda N, K, G, g: (*_awq(N, K, G, g), G), awq.awq_gemv_ref, awq.awq_gemv, awq.awq_dequantize_ref,
            awq.awq_dequantize),
    "ct_sym": (lambda N, K, G, g: (*_ct(N, K, G, g, False), G), ct_int4.ct_int4_gemv_ref, ct_int4.ct_int4_gemv,
               ct_int4.ct_int4_dequantize_ref, ct_int4.ct_int4_dequantize),
    "ct_asym": (lambda N, K, G, g: (*_ct(N, K, G, g, True), G), ct_int4.ct_int4_gemv_ref, ct_int4.ct_int4_gemv,
                ct_int4.ct_int4_dequantize_ref, ct_int4.ct_int4_dequantize),
    "nvfp4": (lambda N, K, G, g: (*_fp4(N, K, g, 2), False), nvfp4.nvfp4_gemv_ref, nvfp4.nvfp4_gemv,
              nvfp4.nvfp4_dequantize_ref, nvfp4.nvfp4_dequantize),
    "nvfp4_ct": (lambda N, K, G, g: (*_fp4(N, K, g, 1, inverted=True), True), nvfp4.nvfp4_gemv_ref, nvfp4.nvfp4_gemv,
                 nvfp4.nvfp4_dequantize_ref, nvfp4.nvfp4_dequantize),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("N,K,G", [(200, 96, 32), (24, 384, 128)])
def test_dequantize_matches_reference_exactly(name, N, K, G, poison):
    make, _, _, deq_ref, deq = CASES[name]
    args = make(N, K, G, torch.Generator().manual_seed(N + K))
    want = deq_ref(*args, dtype=torch.float32)
    assert torch.equal(deq(*args, dtype=torch.float32), want)
    assert torch.equal(deq(*args, dtype=torch.float16), want.half())  # one rounding of the exact value
    rows = deq(*args, dtype=torch.float32, rows=(64, N)) if N > 64 else None
    if rows is not None:
        assert torch.equal(rows, want[64:])


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("M,dtype", [(1, torch.float32), (3, torch.float16), (8, torch.float32), (40, torch.float16)])
def test_gemv_matches_reference(name, M, dtype, poison):
    N, K, G = 72, 512, 64
    g = torch.Generator().manual_seed(M)
    make, ref, tri, _, _ = CASES[name]
    args = make(N, K, G, g)
    x = torch.randn(M, K, generator=g).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype) if M == 3 else None
    want = ref(x, *args, bias=bias)
    got = tri(x, *args, bias=bias)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())


def test_split_k_and_dot_paths_are_what_the_tests_cover():
    assert gemv_config(1, 72, 512, 64, 80)["SPLIT_K"] > 1  # the reduce kernel runs in the tests above
    assert not gemv_config(8, 72, 512, 64, 80)["USE_DOT"] and gemv_config(40, 72, 512, 64, 80)["USE_DOT"]
    assert not gemv_config(8, 72, 512, 64, 80, arch=70)["USE_DOT"]  # sm70: FMA tiles up to 15 rows
    assert gemv_config(5, 72, 512, 64, 132, arch=90)["USE_DOT"] and not gemv_config(4, 72, 512, 64, 132, arch=90)["USE_DOT"]
    cfg = gemv_config(1, 2560, 10240, 32, 132)
    assert cfg["SPLIT_K"] * (2560 // cfg["BLOCK_N"]) >= 132  # real shape: every SM busy at M = 1


def test_large_m_path_dequantizes_slices():
    g = torch.Generator().manual_seed(0)
    qw, qz, s = _awq(200, 64, 32, g)
    x = torch.randn(70, 64, generator=g)
    want = x @ awq.awq_dequantize_ref(qw, qz, s, 32).t()
    got = dequant_matmul(x, 200, lambda a, b: awq.awq_dequantize(qw, qz, s, 32, x.dtype, (a, b)),
                         chunk_bytes=64 * 64 * 4)  # 64 rows per slice: 4 slices
    torch.testing.assert_close(got, want)

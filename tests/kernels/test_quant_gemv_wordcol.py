"""The one-row AWQ GEMV on CUDA cores (kernels/quant/gemv_wordcol.py) against the fp32 dequantized reference under the
interpreter: fp16, bf16 and fp32 activations, groups of 32 / 64 / 128, N a multiple of the program's features and not
(masked), steps of 8 / 16 / 32 rows, one to five split-K slices (groups spanning slices), bias; its launch config
at the real shapes and the default path switch; the fp16-pair walk (HALF2, half2.py's interpreter twin of its inline
PTX) likewise, and at fp16's largest activations.
Packed test weights and the bf16 interpreter fixture: test_quant.py, conftest.py."""

import pytest
import torch
import triton
from test_quant import CASES

from revolta.kernels.quant.awq import awq_gemv_ref
from revolta.kernels.quant.common import fixup_default
from revolta.kernels.quant.gemv_wordcol import (HALF2_MAX_ROWS, HALF2_ROWS, WORDCOL_MAX_SPLIT, WORDCOL_MIN_N,
                                                WORDCOL_PROGRAMS_PER_SM, awq_wordcol_gemv, default_wordcol_config,
                                                use_wordcol, wordcol_config)

pytestmark = pytest.mark.usefixtures("poison", "bf16_dots")  # conftest.py: NaN-poisoned outputs; bf16 as on the GPU

EPS = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 1e-5}


@pytest.mark.parametrize("N,K,G,bn,warps,split,rows,dtype", [
    (512, 256, 32, 256, 1, 2, None, torch.float16),  # EVEN: two programs of 256 features
    (576, 128, 32, 256, 1, 2, None, torch.bfloat16),  # 72 words: the last program masked
    (256, 512, 64, 256, 1, 3, None, torch.float16),  # 16 steps of 32 rows (two a group) in 3 slices of 6, 6, 4
    (256, 384, 128, 256, 1, 4, None, torch.float32),  # 12 steps in 4 slices of 3: groups span slices
    (256, 384, 128, 256, 1, 5, 16, torch.float32),  # 24 steps of 16 rows in 5 slices of 5 (the last 4)
    (512, 256, 32, 256, 1, 4, 16, torch.bfloat16),  # half-group steps, 2 a slice
    (512, 256, 32, 256, 1, 3, "prefetch", torch.float16),  # 8-row steps, the next one's words loaded ahead: slices of
    (576, 128, 64, 256, 1, 1, "prefetch", torch.float32),  # 88 / 88 / 80 rows; one slice, masked features
    (1024, 128, 32, 512, 2, 1, None, torch.float16),  # two warps a program, no split (out written directly)
    (512, 128, 32, 512, 1, 1, None, torch.float32),  # two words a thread
], ids=str)
def test_wordcol_gemv_matches_reference(N, K, G, bn, warps, split, rows, dtype):
    g = torch.Generator().manual_seed(N + K)
    make, ref, tri, _, _ = CASES["awq"]
    args = make(N, K, G, g)
    x = torch.randn(1, K, generator=g).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype) if split == 1 or N == 576 else None
    want = ref(x, *args, bias=bias)  # x @ (W dequantized to fp32).T in fp32, rounded once to x.dtype
    prefetch = rows == "prefetch"
    cfg = wordcol_config(N, K, G, 4, bn, warps, split, 8 if prefetch else rows, prefetch)
    got = tri(x, *args, bias=bias, config=cfg)
    assert got.dtype == dtype and not got.isnan().any()
    # no weight rounded, products and sums in fp32: the sum order and the final rounding differ
    torch.testing.assert_close(got.float(), want.float(), rtol=EPS[dtype], atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("N,K,split,rows,half2,dtype,bias", [
    (576, 256, 4, None, False, torch.bfloat16, True),  # masked last tile, bias added once by the last slice
    (512, 128, 2, None, False, torch.float32, False),
    (256, 256, 3, 16, True, torch.float16, True),  # the fp16-pair walk
], ids=str)
def test_wordcol_fixup_is_bitwise_the_reduce_launch(N, K, split, rows, half2, dtype, bias):
    """FIXUP: the last K slice of each tile adds the slices' partials (+ bias) and writes out (no reduce launch):
    bitwise the reduce launch's output, every output written (NaN-poisoned), the caller's counters back at 0; with
    none, or too few, the wrapper counts on zeros of its own."""
    g = torch.Generator().manual_seed(N + split)
    make, ref, tri, _, _ = CASES["awq"]
    args = make(N, K, 32, g)
    x = torch.randn(1, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    cfg = wordcol_config(N, K, 32, 4, 256, 1, split, rows, half2=half2)
    want = tri(x, *args, bias=b, config=cfg)
    torch.testing.assert_close(want.float(), ref(x, *args, bias=b).float(), rtol=EPS[dtype] * (8 if half2 else 1),
                               atol=2e-3 * want.float().abs().max().item())
    counters = torch.zeros(triton.cdiv(N, 256), dtype=torch.int32)
    for c in (counters, None, torch.zeros(1, dtype=torch.int32)):
        got = awq_wordcol_gemv(x, *args[:3], 32, b, cfg | dict(FIXUP=True), counters=c)
        assert torch.equal(got, want)
    assert not counters.any()


@pytest.mark.parametrize("M,split,half2,dtype", [(3, 2, False, torch.bfloat16), (2, 1, False, torch.float32),
                                                  (2, 2, True, torch.float16)], ids=str)
def test_wordcol_gemv_several_rows(M, split, half2, dtype):
    """Several rows (asked for: a program row each) against the reference, and each row bitwise the same row's
    one-row call (the same walk and sum order); bias with one K slice, split-K partials of M rows with two."""
    g = torch.Generator().manual_seed(M + split)
    make, ref, tri, _, _ = CASES["awq"]
    N, K, G = (256, 64, 32) if half2 else (576, 128, 32)  # masked features (the fp16-pair twin is slow: smaller)
    args = make(N, K, G, g)
    x = torch.randn(M, K, generator=g).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype) if split == 1 else None
    cfg = wordcol_config(N, K, G, 4, split=split, rows=16 if half2 else None, half2=half2)
    got = tri(x, *args, bias=bias, config=cfg)
    assert got.shape == (M, N) and got.dtype == dtype and not got.isnan().any()
    want = ref(x, *args, bias=bias)
    if half2:
        _close_half2(got, want)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=EPS[dtype], atol=1e-5 * want.abs().max().item())
    for i in range(M):
        assert torch.equal(got[i:i + 1], tri(x[i:i + 1], *args, bias=bias, config=cfg))


def test_wordcol_configs_at_the_real_shapes():
    """The default config: 8-row steps, 64 K slices on the projections it is the default for (the configs that won on
    an H100, RESULTS.md K6c), at least 2 whole steps a slice everywhere."""
    for n, k in ((12288, 2560), (512, 2560), (2560, 6144), (10240, 2560), (6144, 2560), (1280, 2560), (2560, 640)):
        cfg = wordcol_config(n, k, 32, num_sms=132)
        assert cfg["WORDCOL"] and cfg["BLOCK_M"] == 1 and not cfg["USE_DOT"] and cfg["BLOCK_K"] == 8
        assert cfg["k_per_split"] % 8 == 0 and cfg["k_per_split"] * cfg["SPLIT_K"] >= k
        assert cfg["k_per_split"] >= 16 and cfg["SPLIT_K"] <= WORDCOL_MAX_SPLIT
        programs = triton.cdiv(n, cfg["BLOCK_N"]) * cfg["SPLIT_K"]
        assert programs >= WORDCOL_PROGRAMS_PER_SM * 132 or cfg["SPLIT_K"] == WORDCOL_MAX_SPLIT or k // 8 < 4 * cfg[
            "SPLIT_K"], (n, k, cfg)
        if n >= WORDCOL_MIN_N:
            assert cfg["SPLIT_K"] == 64, (n, k, cfg)


def test_the_default_picks_the_word_column_path_for_one_awq_row_of_a_wide_projection():
    K = 2560  # the wide projections' inputs
    for N in (6144, 10240, 12288):
        assert use_wordcol(90, torch.float16, "awq", 1, N, K) and use_wordcol(80, torch.bfloat16, "awq", 1, N, K)
    assert not use_wordcol(90, torch.float16, "awq", 2, 12288, K)  # one row only
    assert not use_wordcol(90, torch.float16, "awq", 1, 2560, K)  # lost at N <= 2560 (K6c)
    assert not use_wordcol(90, torch.float16, "ct_int4", 1, 12288, K) and not use_wordcol(90, torch.float16, "nvfp4",
                                                                                           1, 12288, K)
    assert not use_wordcol(70, torch.float16, "awq", 1, 12288, K)
    assert not use_wordcol(None, torch.float16, "awq", 1, 12288, K)
    assert not use_wordcol(90, torch.float32, "awq", 1, 12288, K)
    # fp16 rows (the fp16-pair walk) also from 2560 x 6144 weights (out_proj: K6g), not below
    assert use_wordcol(90, torch.float16, "awq", 1, 2560, 6144) and not use_wordcol(90, torch.bfloat16, "awq", 1, 2560,
                                                                                     6144)
    assert not use_wordcol(90, torch.float16, "awq", 1, 1280, 2560) and not use_wordcol(90, torch.float16, "awq", 1,
                                                                                         512, 2560)


def test_the_default_word_column_config_per_dtype():
    """fp16 takes the fp16-pair walk in 32-row steps (HALF2_ROWS, within the group), bf16 the fp32 walk in 8-row steps;
    the K splits as wordcol_config picks (64 for out_proj's 6144 inputs, 32 for q_proj's 2560 at 32-row steps)."""
    h2 = default_wordcol_config(12288, 2560, 32, 132, torch.float16)
    assert h2["HALF2"] and h2["BLOCK_K"] == HALF2_ROWS and h2["SPLIT_K"] == 32
    assert default_wordcol_config(2560, 6144, 32, 132, torch.float16)["SPLIT_K"] == 64
    assert default_wordcol_config(12288, 2560, 128, 132, torch.float16)["BLOCK_K"] == 32
    assert default_wordcol_config(12288, 2560, 32, 132, torch.bfloat16) == wordcol_config(12288, 2560, 32, 132) | dict(
        PDL=True, **({"FIXUP": True} if fixup_default() else {}))  # PDL: launch_gemv chains it where sm_90 has it


def _close_half2(got, want):
    """The fp16-pair walk rounds each product and its ROWS-row partial sums to fp16 (about 2^-11 relative, summed
    over a step's rows), then adds the steps in fp32: within 2e-3 of the largest output, plus fp16's own rounding."""
    assert got.dtype == torch.float16 and not got.isnan().any() and not got.isinf().any()
    torch.testing.assert_close(got.float(), want.float(), rtol=2.0 ** -10, atol=2e-3 * want.float().abs().max().item())


@pytest.mark.parametrize("N,K,G,split,rows", [
    (512, 256, 32, 2, 8),  # EVEN, two slices of 8-row steps
    (576, 128, 32, 1, 16),  # masked last program, no split (out and bias written directly)
    (256, 384, 128, 4, 32),  # 32-row steps (HALF2_MAX_ROWS), groups spanning slices
], ids=str)
def test_half2_wordcol_gemv_matches_reference(N, K, G, split, rows):
    g = torch.Generator().manual_seed(N + K + rows)
    make, ref, tri, _, _ = CASES["awq"]
    args = make(N, K, G, g)
    x = torch.randn(1, K, generator=g).half()
    bias = torch.randn(N, generator=g).half() if split == 1 else None
    cfg = wordcol_config(N, K, G, 4, split=split, rows=rows, half2=True)
    assert cfg["HALF2"] and rows <= HALF2_MAX_ROWS
    _close_half2(tri(x, *args, bias=bias, config=cfg), ref(x, *args, bias=bias))


def test_half2_partials_hold_fp16s_largest_activations():
    """x at 60,000 everywhere and every code 15 with zero 0 (or 0 with zero 15): each 32-row step's fp16 partial is
    32 · 60,000 · 15 / 512 = 56,250, under 65,504 only because the walk scales the codes by 1/512 (unscaled, or by
    1/256, the partials overflow to inf); the output stays finite and equal to the reference."""
    N, K, G = 256, 128, 32
    for q, z in ((0xFFFFFFFF, 0), (0, 0xFFFFFFFF)):
        qw = torch.full((K, N // 8), q, dtype=torch.int64).to(torch.int32)
        qz = torch.full((K // G, N // 8), z, dtype=torch.int64).to(torch.int32)
        sc = torch.full((K // G, N), 1e-4).half()
        x = torch.full((1, K), 60000.0).half()
        cfg = wordcol_config(N, K, G, 4, split=2, rows=32, half2=True)
        want = awq_gemv_ref(x, qw, qz, sc, G)  # ±128 · 60,000 · 15 · 1e-4 = ±11,520
        assert want.abs().min().item() > 11000
        _close_half2(awq_wordcol_gemv(x, qw, qz, sc, G, None, cfg), want)


@pytest.mark.parametrize("magnitude", [1.0, 3e6, 1e-7], ids=str)
def test_half2_walk_of_bf16_rows_scales_each_step_into_fp16(magnitude):
    """bf16 x on the fp16-pair walk: each step's x scaled by a power of two so its largest lies in [2^14, 2^15)
    (exact: bf16 has 8 significant bits) and the step's sums scaled back, so rows far outside fp16's range (3e6 with
    one entry 100x that: 3e8) or deep in its subnormals (1e-7) give the reference's output, no inf or zero; the
    result is bf16, within bf16's rounding of the fp32 walk's."""
    g = torch.Generator().manual_seed(7)
    make, ref, tri, _, _ = CASES["awq"]
    N, K, G = 256, 128, 32
    args = make(N, K, G, g)
    x = torch.randn(1, K, generator=g) * magnitude
    x[0, 5] *= 100
    x = x.bfloat16()
    want = ref(x, *args)
    got = awq_wordcol_gemv(x, *args[:3], G, None, wordcol_config(N, K, G, 4, split=2, rows=16, half2=True))
    assert got.dtype == torch.bfloat16 and got.isfinite().all() and (got != 0).float().mean() > 0.9
    torch.testing.assert_close(got.float(), want.float(), rtol=2.0 ** -7, atol=4e-3 * want.float().abs().max().item())


def test_half2_takes_16_bit_rows_only():
    make, _, _, _, _ = CASES["awq"]
    qw, qz, sc, G = make(256, 64, 32, torch.Generator().manual_seed(0))
    with pytest.raises(AssertionError, match="fp16 or bf16"):
        awq_wordcol_gemv(torch.randn(1, 64), qw, qz, sc, G, None, wordcol_config(256, 64, G, 4, rows=8, half2=True))


def test_fixup_is_a_default_only_where_the_environment_asks(monkeypatch):
    """FIXUP (the split-K reduce inside the kernel) lost where timed (RESULTS.md K5l) and stays opt-in: the default
    configs of the word-column and nibble GEMVs and of the word-column MoE take it with REVOLTA_SPLITK_FIXUP=1 only
    (one bf16 token's MoE had it until the chained launches without it beat it: RESULTS.md K5n)."""
    from revolta.kernels.quant.gemv_nibble import nibble_gemv_config
    from revolta.kernels.quant.moe import moe_wordcol_config

    def defaults():
        return [default_wordcol_config(12288, 2560, 32, 132, dt)
                for dt in (torch.float16, torch.bfloat16)] + [
            nibble_gemv_config(8, 12288, 2560, 32, "awq", 132, 90)] + [
            moe_wordcol_config(M, dt) for M in (1, 8) for dt in (torch.float16, torch.bfloat16)]

    monkeypatch.delenv("REVOLTA_SPLITK_FIXUP", raising=False)
    assert not any(c.get("FIXUP", False) for c in defaults())
    monkeypatch.setenv("REVOLTA_SPLITK_FIXUP", "1")
    assert all(c["FIXUP"] for c in defaults())

"""half2.py's fp16-pair helpers under the interpreter: h2_fma's twin (what the GEMV walk runs on the CPU in place of
the fma.rn.f16x2 instruction) against IEEE fp16 fused multiply-add computed independently with numpy (exact in
float64, one correct rounding to float16), bit for bit, on random fp16 lanes (normals, subnormals, signed zeros) and
on the walk's own operands (AWQ codes as subnormals times 2^15 / 2^11 minus z / 512: (q - z) / 512 exactly)."""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from revolta.kernels.quant.half2 import awq_code_pair, h2_fma

@triton.jit
def _fma_kernel(a, b, c, out, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < n
    r = h2_fma(tl.load(a + o, mask=m), tl.load(b + o, mask=m), tl.load(c + o, mask=m), False)
    tl.store(out + o, r, mask=m)


@triton.jit
def _codes_kernel(w, out, J: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(out + o, awq_code_pair(tl.load(w + o), J))


def _lanes(t):  # int32 [n] -> fp16 [n, 2] (low lane first: little-endian)
    return t.numpy().view(np.float16).reshape(-1, 2)


def _fma_ref(a, b, c):
    """int32 pairs -> int32 pairs of fp16 fma: the exact value in float64 (22-bit products, sums within 53 bits for
    the operands drawn here), rounded once by numpy's float64 -> float16 conversion (round to nearest even)."""
    la, lb, lc = (_lanes(t).astype(np.float64) for t in (a, b, c))
    return torch.from_numpy((la * lb + lc).astype(np.float16).reshape(-1).view(np.int32).copy())


def _fp16_bits(n, g, lo_exp, hi_exp):
    """int32 fp16 bit patterns with exponent fields in [lo_exp, hi_exp] (0: subnormals), either sign."""
    sign = torch.randint(0, 2, (n,), generator=g) << 15
    exp = torch.randint(lo_exp, hi_exp + 1, (n,), generator=g) << 10
    return (sign | exp | torch.randint(0, 1024, (n,), generator=g)).to(torch.int32)


def _pairs(lo, hi):
    return (lo & 0xFFFF) | (hi << 16)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # lanes past 65504: inf on both
def test_fma_twin_is_fp16_fma_bit_for_bit():
    """(Fails for a twin that rounds the sum to fp32 first: double rounding.)"""
    g = torch.Generator().manual_seed(0)
    n = 4096
    # products and addends within ~2^30 of each other (the GEMV's range: |x| up to 65504 times (q - z) / 512)
    a = _pairs(_fp16_bits(n, g, 1, 30), _fp16_bits(n, g, 0, 20))
    b = _pairs(_fp16_bits(n, g, 5, 16), _fp16_bits(n, g, 8, 20))
    c = _pairs(_fp16_bits(n, g, 0, 25), _fp16_bits(n, g, 5, 30))
    want = _fma_ref(a, b, c)
    finite = np.isfinite(_lanes(want)).all(axis=1)  # overflowing lanes: inf on both, compared below
    got = torch.empty(n, dtype=torch.int32)
    _fma_kernel[(1,)](a, b, c, got, n, BLOCK=n)
    assert torch.equal(got[torch.from_numpy(finite)], want[torch.from_numpy(finite)])
    assert np.array_equal(np.isinf(_lanes(got)), np.isinf(_lanes(want)))


@pytest.mark.parametrize("j", [0, 1, 2, 3])
def test_the_walks_code_pairs_are_exact(j):
    """awq_code_pair's lanes times 2^15 (j even) / 2^11 (j odd) minus z / 512 are (q - z) / 512 exactly, for the
    features 2j (nibble j) and 2j + 1 (nibble j + 4) of AWQ's pack order, with the fma twin."""
    g = torch.Generator().manual_seed(j)
    n = 256
    w = torch.randint(-2 ** 31, 2 ** 31 - 1, (n,), dtype=torch.int32, generator=g)
    codes = torch.empty(n, dtype=torch.int32)
    _codes_kernel[(1,)](w, codes, J=j, BLOCK=n)
    z = torch.randint(0, 16, (n,), generator=g)
    mult = 0x78007800 if j % 2 == 0 else 0x68006800
    neg_z = torch.from_numpy((-(z.numpy() / 512.0)).astype(np.float16).repeat(2).view(np.int32).copy())
    out = torch.empty(n, dtype=torch.int32)
    _fma_kernel[(1,)](codes, torch.full((n,), mult, dtype=torch.int32), neg_z, out, n, BLOCK=n)
    q_lo = (w >> (4 * j)) & 0xF
    q_hi = (w >> (4 * j + 16)) & 0xF
    want = torch.stack([(q_lo - z), (q_hi - z)], 1).double() / 512
    assert torch.equal(torch.from_numpy(_lanes(out).astype(np.float64)), want)

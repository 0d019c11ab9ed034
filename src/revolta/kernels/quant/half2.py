"""fp16x2 arithmetic on int32 registers (two fp16 lanes, the low half first) for the CUDA-core GEMV walks.

On the GPU `h2_fma` is one PTX `fma.rn.f16x2` a pair of lanes (sm_53+: V100 and H100 alike), which Triton does not
emit from its own ops; the Triton interpreter cannot run inline asm, so ASM False gives a twin made of plain Triton
ops: each lane's a · b + c in fp64, rounded once to fp16, which is the fused instruction's result bit for bit
(tests/kernels/test_quant_half2.py) wherever a · b and c lie within fp64's 53 bits of each other (always, unless one
is near fp16's largest and the other near its smallest values). The lane extractors and the packers are plain ops on
both. The torch reference of the walk that uses these is the GEMV's own (the fp32 product over the dequantized
weights: test_quant.py's CASES).

AWQ's nibble order (0, 2, 4, 6, 1, 3, 5, 7) is made for pairs: features 2j and 2j + 1 are nibbles j and j + 4, 16
bits apart, so one AND with 0x000F000F (after a shift of 8 for j = 2, 3) or 0x00F000F0 (j = 1, 3) leaves both codes
of a pair as the fp16 bit patterns q (or 16 q) in their lanes: the subnormals q · 2^-24 (q · 2^-20), exact. One
fma with 2^15 (2^11) makes them q / 512 (`awq_code_pair`; fp16 subnormals are not flushed by fma.rn.f16x2).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def h2_lo(p):
    """fp32 value of the low lane of int32 pairs p."""
    return (p & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def h2_hi(p):
    """fp32 value of the high lane of int32 pairs p."""
    return (p >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def h2_pack(lo, hi):
    """int32 pairs of fp32 / fp64 lo / hi, each rounded to fp16 (round to nearest even)."""
    b_lo = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    b_hi = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    return b_lo | (b_hi << 16)


@triton.jit
def h2_splat(x):
    """int32 pair (x, x) of an fp16 scalar or tensor x."""
    b = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return b | (b << 16)


@triton.jit
def h2_fma(a, b, c, ASM: tl.constexpr):
    """Lane-wise a · b + c of int32 fp16 pairs (shapes broadcast): one fma.rn.f16x2 (ASM), or its interpreter twin."""
    if ASM:
        return tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        # an fp16 x fp16 product is exact in fp64 and so (almost always) is the sum: one rounding, to fp16
        lo = h2_lo(a).to(tl.float64) * h2_lo(b).to(tl.float64) + h2_lo(c).to(tl.float64)
        hi = h2_hi(a).to(tl.float64) * h2_hi(b).to(tl.float64) + h2_hi(c).to(tl.float64)
        return h2_pack(lo, hi)


@triton.jit
def awq_code_pair(words, j: tl.constexpr):
    """int32 pairs holding the codes of nibbles j (low lane) and j + 4 (high lane) of AWQ words, j in 0..3 (features
    2j and 2j + 1 in AWQ's pack order), as fp16 subnormals q · 2^-24 (j even) or q · 2^-20 (j odd): times 2^15
    (j even) or 2^11 (j odd) they are q / 512 exactly. words >> 8 is shared by j = 2, 3 (the compiler keeps one)."""
    if j >= 2:
        words = words >> 8  # arithmetic: the sign bits land in bits 24..31, outside both masks
    if j % 2 == 0:
        b = words & 0x000F000F
    else:
        b = words & 0x00F000F0
    return b

"""The one-row AWQ GEMV on CUDA cores (kernels/quant/gemv_wordcol.py) against the fp32 dequantized reference under the
interpreter: fp16, bf16 and fp32 activations, groups of 32 / 64 / 128, N a multiple of the program's features and not
(masked), one to three split-K slices (an empty last one), bias; its launch config at the real shapes.
Packed test weights and the bf16 interpreter fixture: test_quant.py, conftest.py."""

import pytest
import torch
import triton
from test_quant import CASES

from revolta.kernels.quant.gemv_wordcol import WORDCOL_PROGRAMS_PER_SM, wordcol_config

pytestmark = pytest.mark.usefixtures("poison", "bf16_dots")  # conftest.py: NaN-poisoned outputs; bf16 as on the GPU

EPS = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 1e-5}


@pytest.mark.parametrize("N,K,G,bn,warps,split,dtype", [
    (512, 256, 32, 256, 1, 2, torch.float16),  # EVEN: two programs of 256 features
    (576, 128, 32, 256, 1, 2, torch.bfloat16),  # 72 words: the last program masked
    (256, 512, 64, 256, 1, 3, torch.float16),  # 8 groups in 3 slices of 3, 3, 2
    (256, 384, 128, 256, 1, 4, torch.float32),  # 3 groups in 4 slices: the last one empty
    (1024, 128, 32, 512, 2, 1, torch.float16),  # two warps a program, no split (out written directly)
    (512, 128, 32, 512, 1, 1, torch.float32),  # two words a thread
], ids=str)
def test_wordcol_gemv_matches_reference(N, K, G, bn, warps, split, dtype):
    g = torch.Generator().manual_seed(N + K)
    make, ref, tri, _, _ = CASES["awq"]
    args = make(N, K, G, g)
    x = torch.randn(1, K, generator=g).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype) if split == 1 or N == 576 else None
    want = ref(x, *args, bias=bias)  # x @ (W dequantized to fp32).T in fp32, rounded once to x.dtype
    cfg = wordcol_config(N, K, G, 4, bn, warps, split)
    got = tri(x, *args, bias=bias, config=cfg)
    assert got.dtype == dtype and not got.isnan().any()
    # no weight rounded, products and sums in fp32: the sum order and the final rounding differ
    torch.testing.assert_close(got.float(), want.float(), rtol=EPS[dtype], atol=1e-5 * want.abs().max().item())


def test_wordcol_configs_at_the_real_shapes():
    for n, k in ((12288, 2560), (512, 2560), (2560, 6144), (10240, 2560), (6144, 2560), (1280, 2560), (2560, 640)):
        cfg = wordcol_config(n, k, 32, num_sms=132)
        programs = triton.cdiv(n, cfg["BLOCK_N"]) * cfg["SPLIT_K"]
        assert programs >= WORDCOL_PROGRAMS_PER_SM * 132 or cfg["SPLIT_K"] == 64 or k // 32 < 4 * cfg["SPLIT_K"]
        assert cfg["k_per_split"] % 32 == 0 and cfg["k_per_split"] * cfg["SPLIT_K"] >= k
        assert cfg["WORDCOL"] and cfg["BLOCK_M"] == 1 and not cfg["USE_DOT"]

"""On a GPU: the dense packed GEMV's nibble path (kernels/quant/gemv_nibble.py) at the real projection shapes
(largest and smallest N, the widest K) against the fp32 dequantized reference, beside the tile path, for AWQ g32,
compressed-tensors int4 with zero points and NVFP4, bf16 and fp16, M = 1, 5, 40; and captured in a CUDA graph that
replays on new activations (the split-K workspace is allocated inside the capture); the default one-row AWQ path
(the word-column GEMV) likewise, and its walk on fp16 pairs (HALF2, inline PTX)."""

from __future__ import annotations

import pytest
import torch

from revolta.quant.config import WeightScheme
from revolta.quant.formats import weight_format

pytestmark = pytest.mark.gpu
SCHEMES = {"awq": ("awq", 32, False), "ct_asym": ("ct-int4", 32, False), "nvfp4": ("modelopt-nvfp4", 16, True)}


def _packed(name, N, K, gen):
    fmt = weight_format(WeightScheme(SCHEMES[name][0], 4, SCHEMES[name][1], SCHEMES[name][2]))
    t = {n: torch.empty(s.shape, dtype=s.dtype, device="cuda") for n, s in fmt.specs(N, K).items()}
    fmt.random_(t, K ** -0.5, gen)
    return fmt, t


def _rel(got, want):
    return ((got.float() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("N,K", [(12288, 2560), (512, 2560), (2560, 6144)])
def test_nibble_gemv_real_shapes(name, N, K):
    gen = torch.Generator(device="cuda").manual_seed(N + K)
    fmt, t = _packed(name, N, K, gen)
    w = fmt.dequantize(t, torch.float32)
    for M in (1, 5, 40):
        for dt in (torch.bfloat16, torch.float16):
            x = torch.randn(M, K, device="cuda", generator=gen).to(dt)
            want = x.float() @ w.t()
            tol = 8e-3 if dt == torch.bfloat16 else 1e-3  # nibble: exact codes, one rounding of the output
            assert _rel(fmt.gemv(x, t, None, nibble=True), want) < tol, (M, dt)
            assert _rel(fmt.gemv(x, t, None, nibble=False), want) < 2 * tol, (M, dt)  # tile: weights rounded too


def test_nibble_gemv_replays_in_a_cuda_graph():
    gen = torch.Generator(device="cuda").manual_seed(0)
    fmt, t = _packed("awq", 2560, 6144, gen)
    x = torch.randn(1, 6144, device="cuda", generator=gen).to(torch.bfloat16)
    fmt.gemv(x, t, None, nibble=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fmt.gemv(x, t, None, nibble=True)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = fmt.gemv(x, t, None, nibble=True)
    x.copy_(torch.randn(1, 6144, device="cuda", generator=gen))
    g.replay()
    assert torch.equal(y, fmt.gemv(x, t, None, nibble=True))  # same config, same order: bitwise


@pytest.mark.parametrize("N,K", [(12288, 2560), (6144, 2560), (2560, 6144)])
def test_default_one_row_awq_gemv(N, K):
    """The default one-row AWQ GEMV (the word-column path from 6144 outputs on sm80+, and for fp16 rows the fp16-pair
    walk from 2560 x 6144 weights, gemv_wordcol.py) against the fp32 reference, and replayed from a CUDA graph on a
    new row (bitwise the eager call)."""
    from revolta.kernels.quant.common import device_facts
    from revolta.kernels.quant.gemv_wordcol import use_wordcol

    gen = torch.Generator(device="cuda").manual_seed(N)
    fmt, t = _packed("awq", N, K, gen)
    w = fmt.dequantize(t, torch.float32)
    arch = device_facts(torch.device("cuda"))[1]
    for dt in (torch.bfloat16, torch.float16):
        assert use_wordcol(arch, dt, "awq", 1, N, K) == (arch >= 80 and (N >= 6144 or dt == torch.float16))
        x = torch.randn(1, K, device="cuda", generator=gen).to(dt)
        # bf16: the fp32 walk (no weight rounded, fp32 sums, one rounding of the output); fp16: the fp16-pair walk
        # (fp16 products and step sums, as test_half2_wordcol_gemv)
        tol = 8e-3 if dt == torch.bfloat16 else 2e-3
        assert _rel(fmt.gemv(x, t, None), x.float() @ w.t()) < tol, dt
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fmt.gemv(x, t, None)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = fmt.gemv(x, t, None)
    x.copy_(torch.randn(1, K, device="cuda", generator=gen))
    g.replay()
    assert torch.equal(y, fmt.gemv(x, t, None))


@pytest.mark.parametrize("N,K", [(12288, 2560), (2560, 6144), (1280, 2560)])
def test_half2_wordcol_gemv(N, K):
    """The word-column walk on fp16 pairs (gemv_wordcol.wordcol_slice_half2: fma.rn.f16x2 as inline PTX) in 8-, 16-
    and 32-row steps against the fp32 reference (fp16 products and step sums: 2e-3), and replayed from a CUDA graph
    on a new row (bitwise the eager call)."""
    from revolta.kernels.quant.common import device_facts
    from revolta.kernels.quant.gemv_wordcol import awq_wordcol_gemv, wordcol_config

    gen = torch.Generator(device="cuda").manual_seed(N + K)
    fmt, t = _packed("awq", N, K, gen)
    w = fmt.dequantize(t, torch.float32)
    sms = device_facts(torch.device("cuda"))[0]
    x = torch.randn(1, K, device="cuda", generator=gen).half()
    args = (t["qweight"], t["qzeros"], t["scales"], 32, None)
    for rows in (8, 16, 32):
        cfg = wordcol_config(N, K, 32, sms, rows=rows, half2=True)
        assert _rel(awq_wordcol_gemv(x, *args, cfg), x.float() @ w.t()) < 2e-3, rows
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = awq_wordcol_gemv(x, *args, cfg)
    x.copy_(torch.randn(1, K, device="cuda", generator=gen))
    g.replay()
    assert torch.equal(y, awq_wordcol_gemv(x, *args, cfg))


@pytest.mark.parametrize("N,K", [(12288, 2560), (2560, 6144)])
def test_wordcol_fixup_is_bitwise_the_reduce_launch(N, K):
    """The split-K reduce inside the one-row GEMV (FIXUP: the last of each tile's K slices adds the partials; its
    counters a release / acquire atomic on the GPU, where slices finish in any order) against the reduce launch:
    bitwise equal over 50 calls on new rows, eager and replayed from a CUDA graph, with the caller's counters and
    with per-call zeros, and the counters back at 0 after every launch."""
    from revolta.kernels.quant.common import device_facts
    from revolta.kernels.quant.gemv_wordcol import awq_wordcol_gemv, default_wordcol_config

    gen = torch.Generator(device="cuda").manual_seed(N + 1)
    fmt, t = _packed("awq", N, K, gen)
    sms = device_facts(torch.device("cuda"))[0]
    args = (t["qweight"], t["qzeros"], t["scales"], 32)
    counters = torch.zeros(N // 8, dtype=torch.int32, device="cuda")
    for dt in (torch.float16, torch.bfloat16):
        cfg = default_wordcol_config(N, K, 32, sms, dt)
        assert cfg["SPLIT_K"] > 1
        fx = cfg | dict(FIXUP=True)
        bias = torch.randn(N, device="cuda", generator=gen).to(dt)
        x = torch.randn(1, K, device="cuda", generator=gen).to(dt)
        for i in range(50):
            x.normal_(generator=gen)
            want = awq_wordcol_gemv(x, *args, bias, cfg)
            assert torch.equal(awq_wordcol_gemv(x, *args, bias, fx, counters), want), (dt, i)
            assert torch.equal(awq_wordcol_gemv(x, *args, bias, fx), want), (dt, i)
        assert not counters.any()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = awq_wordcol_gemv(x, *args, bias, fx, counters)
        for i in range(50):
            x.normal_(generator=gen)
            g.replay()
            assert torch.equal(y, awq_wordcol_gemv(x, *args, bias, cfg)), (dt, "graph", i)
        assert not counters.any()


@pytest.mark.parametrize("N,K", [(16384, 2560), (2560, 6144)])
def test_gemv_pdl_chain_is_bitwise_the_plain_launches(N, K):
    """The packed GEMV and its split-K reduce launched with programmatic dependent launch (PDL on sm_90: each grid
    scheduled while the one before it runs, waiting inside before its first access) against plain launches: bitwise
    equal at one row (the word-column walk) and 8 rows (the nibble path), fp16 and bf16, over 10 new rows eager and
    replayed from a CUDA graph of back-to-back calls (each call's reduce and the next call's GEMV chained)."""
    from revolta.kernels.quant.awq import awq_gemv
    from revolta.kernels.quant.gemv_nibble import gemv_config_for

    gen = torch.Generator(device="cuda").manual_seed(N + 3)
    fmt, t = _packed("awq", N, K, gen)
    args = (t["qweight"], t["qzeros"], t["scales"], 32)
    for M in (1, 8):
        for dt in (torch.float16, torch.bfloat16):
            x = torch.randn(M, K, device="cuda", generator=gen).to(dt)
            cfg = gemv_config_for(x, N, K, 32, "awq")
            assert cfg["SPLIT_K"] > 1 and (cfg.get("WORDCOL") or cfg.get("NIBBLE_DOT")), cfg
            pdl = cfg | dict(PDL=True)
            for i in range(10):
                x.normal_(generator=gen)
                assert torch.equal(awq_gemv(x, *args, config=pdl), awq_gemv(x, *args, config=cfg)), (M, dt, i)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                ys = [awq_gemv(x, *args, config=pdl) for _ in range(3)]
            for i in range(10):
                x.normal_(generator=gen)
                g.replay()
                want = awq_gemv(x, *args, config=cfg)
                assert all(torch.equal(y, want) for y in ys), (M, dt, "graph", i)

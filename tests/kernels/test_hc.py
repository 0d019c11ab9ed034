"""HyperConnection kernels (revolta.kernels.hc) vs their references and HyperConnection.read/combine."""

import pytest
import torch

from revolta.kernels import hc as K
from revolta.layers.hyperconnection import HyperConnection

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=3e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
h, d, r = 4, 32, 16
# the rows kernels' shapes: d = 40 splits 5 ways per branch as the real d = 2560 does (K chunks of 8),
# r = 24 takes both K pieces of the up kernel (16 + 8) as the real r = 320 does (256 + 64)
D_ROWS, R_ROWS = 40, 24


pytestmark = pytest.mark.usefixtures("poison")  # tests/kernels/conftest.py


def _module(dtype, with_inject=True, seed=0, d=d, r=r):
    torch.manual_seed(seed)
    mod = HyperConnection(d, h, r, 1e-6, with_inject=with_inject)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return mod.to(dtype)


def _weights(mod):
    inj = mod.block_inject_weight.weight.detach() if mod.block_inject_weight is not None else None
    return (mod.hc_norm.weight.detach(), mod.input_mix_weight_down.weight.detach(),
            mod.input_mix_weight_up.weight.detach(), inj)


CONFIGS = {
    "tiles": "tiles",  # hc_config_tiles(M): GEMV-like for M <= 8, tl.dot above (the default from M = 17 on)
    "dot16": dict(KIND="tiles", BLOCK_M=16, BLOCK_R=16, BLOCK_K=16, SPLITS_PER_BRANCH=2, BLOCK_C=16, BLOCK_K_UP=16,
                  USE_DOT=True, num_warps=4),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("M", [1, 5, 63])
@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_hc_read_tiles(M, dtype, cfg):
    mod = _module(dtype)
    x = (torch.randn(M, h * d) * 2).to(dtype)
    norm_w, w_dn, w_up, w_inj = _weights(mod)
    config = K.hc_config_tiles(M, d, r, h) if cfg == "tiles" else CONFIGS[cfg]
    out, inj = K.hc_read(x, norm_w, w_dn, w_up, w_inj, h, 1e-6, path="triton", config=config)
    ref_out, ref_inj = K.hc_read_ref(x, norm_w, w_dn, w_up, w_inj, h, 1e-6)
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    torch.testing.assert_close(inj, ref_inj, **TOL[dtype])


# the M the rows kernels serve by default (1 row, a partial tile of 8, a full tile, two tiles), every
# dtype at three of them, with and without the inject rows (the final mixer has none)
ROWS_CASES = [(1, torch.float32, True), (1, torch.bfloat16, False), (1, torch.float16, True),
              (3, torch.float16, False), (3, torch.float32, True), (3, torch.bfloat16, True),
              (8, torch.bfloat16, True), (8, torch.float16, True), (8, torch.float32, False),
              (16, torch.float32, True), (16, torch.bfloat16, False)]


def _check_read(mod, x, cfg, with_inject):
    """hc_read(config=cfg) against the reference at the dtype's tolerance, inject gates present or not."""
    out, inj = K.hc_read(x, *_weights(mod), h, 1e-6, config=cfg)
    ref_out, ref_inj = K.hc_read_ref(x, *_weights(mod), h, 1e-6)
    torch.testing.assert_close(out, ref_out, **TOL[x.dtype])
    assert (inj is None) == (ref_inj is None) == (not with_inject)
    if with_inject:
        torch.testing.assert_close(inj, ref_inj, **TOL[x.dtype])


@pytest.mark.parametrize("M,dtype,with_inject", ROWS_CASES,
                         ids=[f"M{m}-{str(t)[6:]}-{'inj' if i else 'noinj'}" for m, t, i in ROWS_CASES])
def test_hc_read_rows(M, dtype, with_inject):
    """The default small-M path (hc_config: the rows kernels with the mix launch) against the reference;
    past the default's MAX_M (the tiled kernels win there on the H200) the same config asked for explicitly."""
    mod = _module(dtype, with_inject, d=D_ROWS, r=R_ROWS)
    x = (torch.randn(M, h * D_ROWS) * 2).to(dtype)
    cfg = None
    if M > K.hc_rows_default()["MAX_M"]:
        cfg = K.rows_config(dict(K.hc_rows_default(), MAX_M=M), M, D_ROWS, R_ROWS, h)
    else:
        assert K.hc_config(M, D_ROWS, R_ROWS, h)["KIND"] == "rows"
    _check_read(mod, x, cfg, with_inject)


@pytest.mark.parametrize("M,with_inject", [(3, True), (9, False)])
def test_hc_read_rows_fused_mix(M, with_inject):
    """FUSED_MIX (two launches: every up program redoes the split-K reduction), one split per branch."""
    mod = _module(torch.float16, with_inject, d=D_ROWS, r=R_ROWS)
    x = (torch.randn(M, h * D_ROWS) * 2).half()
    cfg = K.rows_config(dict(K.hc_config(M, D_ROWS, R_ROWS, h), FUSED_MIX=True, SPLITS_PER_BRANCH=1, BLOCK_R=4),
                        M, D_ROWS, R_ROWS, h)
    out, inj = K.hc_read(x, *_weights(mod), h, 1e-6, config=cfg)
    ref_out, ref_inj = K.hc_read_ref(x, *_weights(mod), h, 1e-6)
    torch.testing.assert_close(out, ref_out, **TOL[torch.float16])
    if with_inject:
        torch.testing.assert_close(inj, ref_inj, **TOL[torch.float16])


def test_hc_rows_config_and_row_invariance(monkeypatch):
    """Up to MAX_M rows the config differs only in BLOCK_M (rows per program, a loop), so a row's result
    does not depend on the rows beside it; "auto" runs the kernels at every M (no reference fallback)."""
    real = K.hc_config(1, 2560, 320, 4, arch=90, dot=False)  # the dot passes: test_hc_dot_config_and_row_invariance
    for M in range(1, real["MAX_M"] + 1):
        cfg = K.hc_config(M, 2560, 320, 4, arch=90, dot=False)
        assert {k: v for k, v in cfg.items() if k != "BLOCK_M"} == {k: v for k, v in real.items() if k != "BLOCK_M"}
        assert cfg["KIND"] == "rows" and cfg["BLOCK_M"] <= 1 << (M - 1).bit_length()
    assert K.hc_config(real["MAX_M"] + 1, 2560, 320, 4, arch=90, dot=False)["KIND"] == "tiles"
    monkeypatch.setattr(K, "hc_read_ref", lambda *a: pytest.fail("hc_read(path='auto') fell back to the reference"))
    mod = _module(torch.float32, d=D_ROWS, r=R_ROWS)
    x = torch.randn(real["MAX_M"], h * D_ROWS) * 2  # the most rows the kernels serve, against 1 and 3 of them
    out, inj = K.hc_read(x, *_weights(mod), h, 1e-6, path="auto")
    for lo, hi in ((6, 7), (5, 8)):
        part, part_inj = K.hc_read(x[lo:hi].contiguous(), *_weights(mod), h, 1e-6, path="auto")
        assert torch.equal(part, out[lo:hi]) and torch.equal(part_inj, inj[lo:hi]), (lo, hi)


def test_hc_read_without_inject_and_ref_matches_layer():
    for with_inject in (True, False):
        mod = _module(torch.float32, with_inject)
        x = torch.randn(5, h * d)
        with torch.no_grad():
            u, w = mod.read(x)
            ref_u, ref_w = K.hc_read_ref(x, *_weights(mod), h, 1e-6)
        torch.testing.assert_close(ref_u, u, atol=0, rtol=0)
        assert (w is None) == (ref_w is None) == (not with_inject)
        if with_inject:
            torch.testing.assert_close(ref_w, w, atol=0, rtol=0)
        out, inj = K.hc_read(x, *_weights(mod), h, 1e-6, path="triton")
        torch.testing.assert_close(out, u, **TOL[torch.float32])
        assert (inj is None) == (not with_inject)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("M", [1, 5, 63])
def test_hc_combine_bitwise(M, dtype):
    mod = _module(dtype)
    x = torch.randn(M, h * d).to(dtype)
    inj = (2 * torch.rand(M, h)).to(dtype)
    u = torch.randn(M, d).to(dtype)
    ref = mod.combine(x, inj, u)
    assert torch.equal(K.hc_combine_ref(x, inj, u), ref)
    assert torch.equal(K.hc_combine(x, inj, u), ref)
    y = x.clone()
    K.hc_combine(y, inj, u, inplace=True)
    assert torch.equal(y, ref)


# the dot passes (kernels/hc_dot.py) at the verify / decode row counts they serve (4-8) and past them (13, one
# partial 16-row tile); "90" = the H200 config (W_up in two K pieces loaded at once), "70" = the V100 one (K chunks)
DOT_CASES = [(4, torch.float16, True, 90), (4, torch.bfloat16, False, 70), (5, torch.bfloat16, True, 90),
             (5, torch.float16, False, 70), (8, torch.bfloat16, False, 90), (8, torch.float16, True, 70),
             (13, torch.float16, False, 90), (13, torch.bfloat16, True, 70)]


def _dot_config(M, arch, **over):
    return K.rows_config(dict(K.hc_dot_default(arch), MAX_M=16, **over), M, D_ROWS, R_ROWS, h)


@pytest.mark.parametrize("M,dtype,with_inject,arch", DOT_CASES,
                         ids=[f"M{m}-{str(t)[6:]}-{'inj' if i else 'noinj'}-sm{a}" for m, t, i, a in DOT_CASES])
def test_hc_read_dot(M, dtype, with_inject, arch):
    """Both passes on tl.dot against the reference (bf16 under the interpreter through fp32 operands of the
    same values: its tl.dot multiplies bf16 storage as integers)."""
    mod = _module(dtype, with_inject, d=D_ROWS, r=R_ROWS)
    x = (torch.randn(M, h * D_ROWS) * 2).to(dtype)
    cfg = _dot_config(M, arch)
    assert (cfg["DOWN"], cfg["UP"]) == ("dot", "dot") and (cfg["UP_BLOCK_K"] > 0) == (arch == 70)
    _check_read(mod, x, cfg, with_inject)


@pytest.mark.parametrize("down,up", [("dot", "rows"), ("rows", "dot")])
def test_hc_read_dot_one_pass(down, up):
    """One pass on tl.dot, the other on the rows kernels (the benchmark's dot-rowsup / dot-rowsdown): the
    two share the workspaces."""
    mod = _module(torch.float16, d=D_ROWS, r=R_ROWS)
    _check_read(mod, (torch.randn(6, h * D_ROWS) * 2).half(), _dot_config(6, 90, DOWN=down, UP=up), True)


def test_hc_dot_config_and_row_invariance():
    """hc_config: the dot passes by default on sm90+ only (measured there; off on sm80, sm70 and the CPU),
    when asked anywhere, and only for MIN_M..MAX_M (rows 1-3 stay on the rows kernels, 17+ on the tiles;
    without dot, 9+ on the tiles); within the dot config a row's result does not depend on the rows beside
    it or their number; configs tl.dot cannot run are refused by name."""
    assert [K.hc_dot_default(a)["ENABLED"] for a in (None, 70, 80, 90, 100)] == [False, False, False, True, True]
    assert (K.hc_dot_default(90)["MIN_M"], K.hc_dot_default(90)["MAX_M"]) == (4, 16)

    def kind(cfg):
        return cfg["DOWN"] if cfg["KIND"] == "rows" else "tiles"
    for M in range(1, 20):
        kinds = tuple(kind(K.hc_config(M, 2560, 320, 4, arch=a, dot=o)) for a, o in ((90, None), (80, None), (90, False)))
        dot_or = "dot" if 4 <= M <= 16 else "rows" if M < 4 else "tiles"
        rows_or = "rows" if M <= 8 else "tiles"
        assert kinds == (dot_or, rows_or, rows_or), M
    mod = _module(torch.float16, d=D_ROWS, r=R_ROWS)
    x = (torch.randn(13, h * D_ROWS) * 2).half()
    out, inj = K.hc_read(x, *_weights(mod), h, 1e-6, config=_dot_config(13, 90))
    for lo, hi in ((5, 10), (3, 7)):
        part, part_inj = K.hc_read(x[lo:hi].contiguous(), *_weights(mod), h, 1e-6, config=_dot_config(hi - lo, 90))
        assert torch.equal(part, out[lo:hi]) and torch.equal(part_inj, inj[lo:hi]), (lo, hi)
    for bad, what in ((dict(BLOCK_R=8), "BLOCK_R=8"), (dict(BLOCK_C=2), "BLOCK_C"), (dict(UP_BLOCK_K=8), "UP_BLOCK_K=8"),
                      (dict(FUSED_MIX=True), "FUSED_MIX")):
        with pytest.raises(ValueError, match=what):
            K.hc_read(x, *_weights(mod), h, 1e-6, config=_dot_config(13, 90, **bad))

"""The group-factored decode path of the packed-expert MoE (kernels/quant/moe_decode.py, config "NIBBLE_DOT") against
`quant_fused_moe_ref` under the interpreter: AWQ int4 (zero points), compressed-tensors int4 symmetric and asymmetric,
NVFP4; fp16 and bf16 activations (fp32 in one case); M = 1 (with and without split-K), 5, 8 and 40 (skewed routing,
so an expert's rows span several BLOCK_M chunks); the shared expert riding as expert E. Shapes and weights are
test_quant_moe.py's (H 64, I 32, 8 experts, top-2).

The interpreter runs tl.dot and arithmetic on bf16 as raw uint16 bits (numpy has no bf16); the `bf16_dots` fixture
(tests/kernels/conftest.py) gives both fp32 operands (exact) and rounds arithmetic back to bf16, what the GPU
computes."""

import dataclasses
import functools

import pytest
import torch
from test_quant_moe import TOL, _case

from revolta.kernels.quant.moe import (MOE_WORDCOL, MOE_WORDCOL_BF16_PAIRS, MOE_WORDCOL_BF16_PAIRS_ROWS,
                                      MOE_WORDCOL_CHAIN, MOE_WORDCOL_HALF2, MOE_WORDCOL_MAX_TOKENS, MOE_WORDCOL_PAIRS,
                                      MOE_WORDCOL_PAIRS_HALF2, quant_fused_moe, quant_grouped_config, use_moe_wordcol)

pytestmark = pytest.mark.usefixtures("poison")  # tests/kernels/conftest.py: unwritten outputs are NaN

TOLS = TOL | {torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
NIB = dict(BLOCK_M=16, BLOCK_N_UP=16, BLOCK_K_UP=32, BLOCK_N_DOWN=32, BLOCK_K_DOWN=32, USE_DOT=True, num_warps=4,
           num_stages=2, NIBBLE_DOT=True, SPLIT_UP=1, SPLIT_DOWN=1)
SPLIT = NIB | dict(SPLIT_UP=2, SPLIT_DOWN=2)  # I = 32 is one K step: the second down split is empty (adds zeros)
CONFIGS = {"nib": NIB, "split": SPLIT, "ahead": SPLIT | dict(SCALE_AHEAD=True),  # scales loaded one K step ahead
           "nib-ahead": NIB | dict(SCALE_AHEAD=True)}


@pytest.mark.usefixtures("bf16_dots")
@pytest.mark.parametrize("name,M,cfg,dtype", [
    ("awq", 1, "split", torch.bfloat16), ("awq", 1, "nib", torch.float16), ("awq", 5, "nib", torch.bfloat16),
    ("awq", 8, "nib", torch.float16), ("awq", 40, "nib", torch.bfloat16), ("awq", 40, "nib", torch.float16),
    ("ct_sym", 1, "split", torch.float16), ("ct_sym", 8, "nib", torch.bfloat16), ("ct_sym", 5, "nib", torch.float32),
    ("ct_asym", 1, "split", torch.bfloat16), ("ct_asym", 5, "nib", torch.float16),
    ("ct_asym", 40, "nib", torch.bfloat16), ("ct_channel", 8, "nib", torch.float16),
    ("nvfp4", 1, "split", torch.float16), ("ct_nvfp4", 8, "nib", torch.bfloat16),
    ("awq", 1, "ahead", torch.float16), ("awq", 40, "nib-ahead", torch.bfloat16),
    ("ct_asym", 5, "nib-ahead", torch.float16), ("ct_channel", 8, "nib-ahead", torch.bfloat16),
    ("nvfp4", 1, "ahead", torch.float16)], ids=str)
def test_nibble_path_matches_reference(name, M, cfg, dtype):
    x, gate_up, down, ids, w, shared, ref = _case(name, M, dtype)
    out = quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared, config=CONFIGS[cfg])
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOLS[dtype])


WORDCOL = dict(WORDCOL=True, BLOCK_M=1, USE_DOT=False, BLOCK_N_UP=32, BLOCK_N_DOWN=256, num_warps=1, num_stages=1)


@pytest.mark.usefixtures("bf16_dots")
@pytest.mark.parametrize("dtype,split", [(torch.float16, (1, 1)), (torch.bfloat16, (2, 2)), (torch.float32, (3, 1)),
                                         (torch.float16, (5, 3, 8)), (torch.bfloat16, (2, 3, 8, True)),
                                         (torch.float32, (2, 3, 8, True))], ids=str)
def test_wordcol_path_matches_reference(dtype, split):
    """One token of AWQ experts on the word-column path (moe_wordcol.py): the gate / up sums in one K slice or in
    split-K partials (H = 64: 2 groups; 3 slices leave the last empty), down over I = 32 (one group: a second slice is
    empty; steps of 8 rows in 5 / 3 slices, with and without the next step's words loaded ahead), 256 down features a
    program over H = 64 (masked), the shared expert as slot k."""
    x, gate_up, down, ids, w, shared, ref = _case("awq", 1, dtype)
    cfg = WORDCOL | dict(SPLIT_UP=split[0], SPLIT_DOWN=split[1], ROWS=split[2] if len(split) > 2 else 32,
                         PREFETCH=len(split) > 3)
    out = quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared, config=cfg)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOLS[dtype])


@pytest.mark.usefixtures("bf16_dots")
@pytest.mark.parametrize("M", [1, 3], ids=str)
def test_half2_wordcol_path_takes_bf16_tokens(M):
    """bf16 tokens on the fp16-pair walk (each step's x, and act in the down walk, scaled into fp16 by a power of
    two), one token and a program row per pair, with the reduces inside the kernels: the reference's MoE within
    bf16's rounding."""
    x, gate_up, down, ids, w, shared, ref = _case("awq", M, torch.bfloat16)
    cfg = WORDCOL | dict(SPLIT_UP=2, SPLIT_DOWN=2, ROWS=16, HALF2=True, FIXUP=True)
    out = quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared, config=cfg)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOLS[torch.bfloat16])


@pytest.mark.parametrize("split", [(1, 1, 32), (2, 3, 8), (3, 1, 16)], ids=str)
def test_half2_wordcol_path_matches_reference(split):
    """The same walk on fp16 pairs (HALF2: gemv_wordcol.wordcol_slice_half2, half2.py's interpreter twin): products
    and each step's partial sums rounded to fp16, so within 2e-3 of the largest output."""
    x, gate_up, down, ids, w, shared, ref = _case("awq", 1, torch.float16)
    cfg = WORDCOL | dict(SPLIT_UP=split[0], SPLIT_DOWN=split[1], ROWS=split[2], HALF2=True)
    out = quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared, config=cfg)
    assert out.dtype == torch.float16 and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2.0 ** -10, atol=2e-3 * ref.float().abs().max().item())


@pytest.mark.usefixtures("bf16_dots")
@pytest.mark.parametrize("M,dtype,split", [(5, torch.float16, (2, 3, 8)), (3, torch.bfloat16, (1, 1, 32))], ids=str)
def test_wordcol_path_several_tokens(M, dtype, split):
    """Several tokens on the word-column path: a program row per (token, slot) pair, each reading its token's x row;
    experts chosen by several tokens (8 experts, top-2 + the shared expert in every token) are walked once per pair,
    and the y rows of each token's pairs add up in moe_sum (on fp16 pairs:
    test_default_wordcol_config_matches_reference, whose interpreter twin of the PTX is slow)."""
    x, gate_up, down, ids, w, shared, ref = _case("awq", M, dtype)
    assert ids.unique().numel() < ids.numel()  # pairs share experts across tokens
    cfg = WORDCOL | dict(SPLIT_UP=split[0], SPLIT_DOWN=split[1], ROWS=split[2])
    out = quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared, config=cfg)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOLS[dtype])


@pytest.mark.usefixtures("bf16_dots")
@pytest.mark.parametrize("M,dtype,split", [(1, torch.bfloat16, (3, 2, 8)), (1, torch.float32, (1, 3, 16)),
                                           (5, torch.float16, (2, 3, 8)), (3, torch.bfloat16, (2, 1, 32))], ids=str)
def test_wordcol_fixup_is_bitwise_the_reduce_launches(M, dtype, split):
    """FIXUP: the last K slice of each gate_up tile forms act and the last program of each (token, down tile) sums
    the slots (no split-act / slot-sum launch): bitwise the separate launches' output (one K slice: no split-act,
    the slot sum still inside), every output written (NaN-poisoned), the layer's own counters back at 0; with too
    few counters (or none) the wrapper counts on zeros of its own."""
    x, gate_up, down, ids, w, shared, ref = _case("awq", M, dtype)
    assert gate_up.counters is not None and gate_up.counters.dtype == torch.int32 and not gate_up.counters.any()
    cfg = WORDCOL | dict(SPLIT_UP=split[0], SPLIT_DOWN=split[1], ROWS=split[2])
    want = quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared, config=cfg)
    torch.testing.assert_close(want, ref, **TOLS[dtype])
    got = quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared, config=cfg | dict(FIXUP=True))
    assert torch.equal(got, want) and not gate_up.counters.any()
    few = dataclasses.replace(gate_up, counters=torch.zeros(1, dtype=torch.int32))
    got = quant_fused_moe(x, few, down, ids, w, shared_expert=shared, config=cfg | dict(FIXUP=True))
    assert torch.equal(got, want) and not few.counters.any()


@pytest.mark.usefixtures("bf16_dots")
@pytest.mark.parametrize("M,dtype,split,fixup", [(5, torch.float16, (2, 3, 8), False),
                                                 (3, torch.bfloat16, (2, 1, 32), True)], ids=str)
def test_wordcol_expert_order_is_bitwise_the_pair_order(M, dtype, split, fixup):
    """EXPERT_ORDER: the program rows walk the pairs sorted by expert (moe_group's order) instead of token-major; each
    pair's sums are the same, so the output is bitwise the default's, every output written (NaN-poisoned), with the
    reduce launches and with FIXUP (counters back at 0)."""
    x, gate_up, down, ids, w, shared, ref = _case("awq", M, dtype)
    assert ids.unique().numel() < ids.numel()  # pairs share experts across tokens: the order differs
    cfg = WORDCOL | dict(SPLIT_UP=split[0], SPLIT_DOWN=split[1], ROWS=split[2], FIXUP=fixup)
    want = quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared, config=cfg)
    got = quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared, config=cfg | dict(EXPERT_ORDER=True))
    assert torch.equal(got, want) and not gate_up.counters.any()
    torch.testing.assert_close(got, ref, **TOLS[dtype])


@functools.lru_cache(maxsize=None)
def _pair_walk(M, dtype, split):
    """The per-pair fp16-pair walk's output on _case("awq", M, dtype) (computed once: the interpreter is slow)."""
    x, gate_up, down, ids, w, shared, _ = _case("awq", M, dtype)
    cfg = WORDCOL | dict(SPLIT_UP=split[0], SPLIT_DOWN=split[1], ROWS=split[2], HALF2=True)
    return quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared, config=cfg)


@pytest.mark.usefixtures("bf16_dots")
@pytest.mark.parametrize("M,dtype,split", [(1, torch.float16, (3, 2, 16)), (3, torch.bfloat16, (1, 1, 32))], ids=str)
def test_wordcol_joint_gate_up_walk_is_bitwise_the_two_walks(M, dtype, split):
    """JOINT: gate and up walked together (gemv_wordcol.wordcol_slice2_half2: both weights' words of a step loaded
    together, x once) give the two walks' sums bitwise, so the output is the per-pair walk's (fp16 and bf16 tokens,
    one K slice and split-K partials, experts shared by tokens, the shared expert in every token; NaN-poisoned
    outputs all written). The
    split-act and slot-sum block sizes (ACT_BLOCK, SUM_BLOCK) change which program adds a feature, not its sum."""
    x, gate_up, down, ids, w, shared, ref = _case("awq", M, dtype)
    cfg = WORDCOL | dict(SPLIT_UP=split[0], SPLIT_DOWN=split[1], ROWS=split[2], HALF2=True)
    want = _pair_walk(M, dtype, split)
    got = quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared, config=cfg | dict(JOINT=True))
    assert torch.equal(got, want)
    torch.testing.assert_close(got.float(), ref.float(), rtol=3e-2, atol=3e-2 * ref.float().abs().max().item())
    if split[0] > 1:
        got = quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared,
                              config=cfg | dict(JOINT=True, ACT_BLOCK=16, SUM_BLOCK=32))
        assert torch.equal(got, want)


def test_default_config_picks_the_nibble_path_on_sm80_up_and_the_tiles_on_sm70():
    for M in (1, 8, 40):
        assert quant_grouped_config(M, 11, 513, 90)["NIBBLE_DOT"] and quant_grouped_config(M, 11, 513)["NIBBLE_DOT"]
        assert "NIBBLE_DOT" not in quant_grouped_config(M, 11, 513, 70)
    one, many = quant_grouped_config(1, 11, 513, 90), quant_grouped_config(8, 11, 513, 90)
    assert (one["SPLIT_UP"], one["SPLIT_DOWN"]) == (4, 2) == (many["SPLIT_UP"], many["SPLIT_DOWN"])


@pytest.mark.usefixtures("bf16_dots")
@pytest.mark.parametrize("M,dtype", [(1, torch.float16), (1, torch.bfloat16), (2, torch.float16),
                                     (3, torch.bfloat16)], ids=str)
def test_default_wordcol_config_matches_reference(M, dtype):
    """The configs AWQ tokens take by default on sm80+ (moe_wordcol_config: one token on fp16 pairs in 32 / 8 slices of
    16 rows, bf16 scaled into fp16 a step with gate and up in one walk; several tokens a program row per pair in
    16 / 4 slices on pairs, fp16 in 16-row steps, bf16 scaled in 32-row steps with gate and up in one walk; most slices
    empty at H = 64, I = 32; PDL is off under the interpreter) compute the reference's MoE."""
    x, gate_up, down, ids, w, shared, ref = _case("awq", M, dtype)
    cfg = quant_grouped_config(M, ids.shape[1], 9, 90, dtype=dtype)
    assert cfg["WORDCOL"] and cfg["HALF2"]
    out = quant_fused_moe(x, gate_up, down, ids, w, shared_expert=shared, config=cfg)
    if cfg["HALF2"] and dtype == torch.float16:  # bf16 rows: their own rounding (TOLS) dominates the pairs'
        atol = 2e-3 * ref.float().abs().max().item()
        torch.testing.assert_close(out.float(), ref.float(), rtol=2.0 ** -10, atol=atol)
    else:
        torch.testing.assert_close(out, ref, **TOLS[dtype])


def test_awq_tokens_in_16_bit_take_the_word_column_walk_on_sm80_up():
    """RESULTS.md K5g (H200) / K5h (H100): one token 42.4 us (bf16) / 36.2 us (fp16 pairs) against the nibble path's
    47.9 / 42.8; 5 / 8 / 40 tokens a program row per pair 2.0-2.1x (fp16 pairs) and 1.4-1.5x (bf16) faster than the
    nibble path. Only when the caller names the activations' dtype: fp32 activations, more than
    MOE_WORDCOL_MAX_TOKENS tokens, other layouts, sm70 and the interpreter keep their paths."""
    for arch in (80, 90):
        for dtype in (torch.float16, torch.bfloat16):
            half2 = dtype == torch.float16
            assert use_moe_wordcol(arch, dtype, "awq", 1) and use_moe_wordcol(arch, dtype, "awq", 40)
            one = quant_grouped_config(1, 11, 513, arch, dtype=dtype)
            assert one == (MOE_WORDCOL_HALF2 | MOE_WORDCOL_CHAIN if half2 else MOE_WORDCOL_BF16_PAIRS)
            assert one is not MOE_WORDCOL_BF16_PAIRS and one is not MOE_WORDCOL_HALF2  # a copy: callers may edit
            several = quant_grouped_config(8, 11, 513, arch, dtype=dtype)
            assert several == (MOE_WORDCOL_PAIRS_HALF2 if half2 else MOE_WORDCOL_BF16_PAIRS_ROWS)  # K5n
            assert several is not MOE_WORDCOL_PAIRS_HALF2 and several is not MOE_WORDCOL_BF16_PAIRS_ROWS
    assert MOE_WORDCOL_HALF2["HALF2"] and MOE_WORDCOL_PAIRS_HALF2["HALF2"] and not MOE_WORDCOL_PAIRS["HALF2"]
    assert not use_moe_wordcol(90, torch.float32, "awq", 1)
    assert not use_moe_wordcol(90, torch.float16, "awq", MOE_WORDCOL_MAX_TOKENS + 1)
    assert not use_moe_wordcol(90, torch.float16, "ct_int4", 1) and not use_moe_wordcol(70, torch.float16, "awq", 1)
    assert not use_moe_wordcol(None, torch.float16, "awq", 1)
    assert quant_grouped_config(41, 11, 513, 90, dtype=torch.float16)["NIBBLE_DOT"]
    assert quant_grouped_config(1, 11, 513, 90, nibble=True, dtype=torch.float16)["NIBBLE_DOT"]  # asked: nibble
    assert quant_grouped_config(1, 11, 513, 90)["NIBBLE_DOT"]  # no dtype named: the nibble path, as before


def test_nvfp4_keeps_the_tile_path_on_a_gpu_and_asked_nibble_tiles_are_64_rows():
    """Compiled for sm_90 the nibble path's 16-row NVFP4 tiles summed wrong (tests/gpu/test_quant_moe_gpu.py); the
    interpreter (arch None) still runs them, the tests above check its sums."""
    for M in (1, 8, 40):
        assert "NIBBLE_DOT" not in quant_grouped_config(M, 9, 65, 90, layout="nvfp4")
        assert "NIBBLE_DOT" not in quant_grouped_config(M, 9, 65, 80, layout="nvfp4")
        assert quant_grouped_config(M, 9, 65, 90, nibble=True, layout="nvfp4")["BLOCK_M"] == 64
        assert quant_grouped_config(M, 9, 65, layout="nvfp4")["BLOCK_M"] == 16
        assert quant_grouped_config(M, 9, 65, 90, layout="awq")["BLOCK_M"] == 16


def test_nibble_k_step_is_a_power_of_two_inside_one_group():
    from revolta.kernels.quant.nibble import nibble_block_k, split_len

    assert nibble_block_k(32, 32, "awq") == 32 and nibble_block_k(32, 128, "awq") == 32
    assert nibble_block_k(32, 80, "ct_int4") == 16 and nibble_block_k(32, 48, "awq") == 16  # per-channel K/tp
    assert nibble_block_k(32, 16, "nvfp4") == 16
    for group in (24, 40, 8):  # no power-of-two step >= 16 divides it (tl.arange and tl.dot need one)
        with pytest.raises(AssertionError, match=f"group {group}"):
            nibble_block_k(32, group, "awq")
    assert split_len(2560, 4, 32) == 640 and split_len(160, 2, 32) == 96  # whole K steps per split

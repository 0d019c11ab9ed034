"""store_kv: paged scatter in fp16 / fp8-e4m3-as-uint8 / int8, and the E4M3 bit codec."""

import pytest
import torch
import triton
import triton.language as tl

from revolta.kernels.qsa import store_kv, store_kv_ref
from revolta.kernels.qsa.common import e4m3_decode, e4m3_decode_ref, e4m3_encode, e4m3_encode_ref, int8_quant_ref
from test_qsa_helpers import nan_poison  # noqa: F401

KVH, D, BS, NB = 2, 32, 8, 12


@triton.jit
def _codec_kernel(x_ptr, bits_ptr, dec_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    b = e4m3_encode(tl.load(x_ptr + i))
    tl.store(bits_ptr + i, b)
    tl.store(dec_ptr + i, e4m3_decode(b).to(tl.float32) * 256.0)


def test_e4m3_codec_matches_torch_bit_for_bit():
    every = torch.arange(256, dtype=torch.uint8)
    finite = every[(every & 0x7F) != 0x7F].view(torch.float8_e4m3fn).float()  # all 254 finite codes
    mids = (finite[:-1] + finite[1:]) / 2  # exact ties between neighbours: round to even
    torch.manual_seed(0)
    rand = torch.cat([torch.randn(2000) * 50, torch.randn(500) * 1e-3, torch.tensor([500.0, -1e6, 449.0, 464.0, 0.0])])
    x = torch.cat([finite, mids, -mids, rand]).float()
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(n - x.numel())])
    bits = torch.empty(n, dtype=torch.uint8)
    dec = torch.empty(n)
    _codec_kernel[(1,)](x, bits, dec, N=n)
    ref = e4m3_encode_ref(x, torch.tensor(1.0))
    assert torch.equal(bits, ref), (x[bits != ref][:8], bits[bits != ref][:8], ref[bits != ref][:8])
    assert torch.equal(dec, e4m3_decode_ref(ref, torch.tensor(1.0)))


def _caches(kv_dtype):
    dt = {"auto": torch.float16, "fp8_e4m3": torch.uint8, "int8": torch.int8}[kv_dtype]
    k = torch.full((NB, BS, KVH, D), 3, dtype=dt)  # sentinel: untouched slots must stay
    if kv_dtype == "fp8_e4m3":
        ks, vs = torch.tensor([0.02]), torch.tensor([0.005])
    elif kv_dtype == "int8":
        ks, vs = torch.full((NB, BS, KVH), 7.0), torch.full((NB, BS, KVH), 7.0)
    else:
        ks = vs = None
    return k, k.clone(), ks, vs


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3", "int8"])
@pytest.mark.parametrize("T", [1, 5, 11])
def test_store_kv_matches_ref(kv_dtype, T, nan_poison):
    g = torch.Generator().manual_seed(T)
    k = (torch.randn(T, KVH, D, generator=g) * 2).half()
    v = torch.randn(T, KVH, D, generator=g).half()
    k[0, 0] = 0  # all-zero head: int8 scale 0, codes 0
    slots = torch.randperm(NB * BS, generator=g)[:T] + BS  # never the null block 0
    slots = torch.where(slots >= NB * BS, slots - BS, slots)
    if T > 2:
        slots[1] = -1  # padding token: skipped
    out, ref = _caches(kv_dtype), _caches(kv_dtype)
    store_kv(k, v, out[0], out[1], slots, kv_dtype, out[2], out[3])
    store_kv_ref(k, v, ref[0], ref[1], slots, kv_dtype, ref[2], ref[3])
    for a, b in zip(out, ref):
        if a is not None:
            assert torch.equal(a, b)


def test_store_kv_strided_input_and_bad_args():
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(4, 2 * KVH, D, generator=g).half()  # fused [T, 2*KVH, D] projection output
    k, v = kv[:, :KVH], kv[:, KVH:]
    kc, vc, _, _ = _caches("auto")
    slots = torch.tensor([8, 9, 30, 95])
    store_kv(k, v, kc, vc, slots, "auto")
    assert torch.equal(kc.view(-1, KVH, D)[slots], k) and torch.equal(vc.view(-1, KVH, D)[slots], v)
    with pytest.raises(ValueError, match="kv_dtype"):
        store_kv(k, v, kc, vc, slots, "fp4")
    with pytest.raises(ValueError, match="fp8_e4m3 needs"):
        store_kv(k, v, kc.view(torch.uint8)[..., :D], vc.view(torch.uint8)[..., :D], slots, "fp8_e4m3")
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(k, v, kc, vc, slots[:3], "auto")


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
def test_quantised_round_trip_tolerance(kv_dtype):
    """Stated tolerance vs fp16 for unit-scale data: fp8 (3 mantissa bits) <= 1/16 relative of the layer
    max after scaling by max/448; int8 <= half a step of the per-token absmax/127."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, KVH, D, generator=g).half()
    if kv_dtype == "fp8_e4m3":
        scale = x.float().abs().max().reshape(1) / 448
        back = e4m3_decode_ref(e4m3_encode_ref(x, scale), scale)
        rel = (back - x.float()).abs() / x.float().abs().clamp_min(scale * 2 ** -6)
        assert rel.max() <= 1 / 16 + 1e-6
    else:
        q, s = int8_quant_ref(x)
        back = q.float() * s[..., None]
        assert ((back - x.float()).abs() <= s[..., None] / 2 + 1e-6).all()

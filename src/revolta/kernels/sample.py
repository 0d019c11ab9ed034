"""Token sampling on the device without host syncs (the kernel behind `revolta.engine.sampling`).

`sample_from_logits(logits [N, V] fp32, temperature, top_k, top_p, min_p, seeds, offsets) -> [N] int64`

Per row (one program, the vocabulary streamed in chunks):
  * temperature <= 0: greedy argmax of the raw logits (ties: lowest id);
  * otherwise s = logits / temperature and the allowed set is {s >= max(t_k, t_p, t_min_p)}:
      - t_k: the k-th largest logit, found by bisection on the order-preserving int32 key of the fp32
        bits (<= 32 counting passes, no sort; ties at the k-th value are all kept);
      - t_p: the largest threshold whose kept mass (inside the top-k set) still reaches top_p,
        bisection on the same key with mass passes (the smallest nucleus, as the torch Sampler);
      - min_p: s >= s_max + log(min_p) in closed form;
  * the pick is the exponential race argmax_i (s_i - log E_i), E_i = -log U_i, with U_i from Philox
    4x32-10 keyed by the row's seed and counter (token id, offset lo, offset hi, 0): a request
    reproduces from (seed, offset) alone, independently of the batch it is in. `offsets` is the
    per-request step counter (e.g. the number of tokens generated so far).
`sample_from_logits_ref` draws the same U_i with a torch Philox, so kernel and reference agree token
for token; `sampling_probs_ref` is the distribution (the torch `Sampler.probs` semantics).

Cost: one max pass, then only for rows that use them up to 32 + 32 bisection passes and one sampling
pass over V; the row stays in L2 after the first pass. One program per row: at decode batch sizes
this uses few SMs, so a split-V variant is the next step if sampling shows up in the profile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_M32 = 0xFFFFFFFF
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57


def _mul32(a: int, x: Tensor) -> tuple[Tensor, Tensor]:
    """(hi, lo) 32-bit words of a·x for a constant a < 2^32 and x: int64 tensor of uint32 values."""
    x_hi, x_lo = x >> 16, x & 0xFFFF
    p_hi, p_lo = a * x_hi, a * x_lo  # each < 2^48
    hi = (p_hi + (p_lo >> 16)) >> 16
    lo = (((p_hi & 0xFFFF) << 16) + p_lo) & _M32
    return hi, lo


def philox_ref(seed: Tensor, c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor) -> Tensor:
    """First output word of Philox 4x32-10 (Triton's `tl.philox`), int64 tensors holding uint32 values."""
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(10):
        hi_b, lo_b = _mul32(_PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mul32(_PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY_A) & _M32, (k1 + _PHILOX_KEY_B) & _M32
    return c0


def sampling_probs_ref(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
    """The sampling distribution [N, V] fp32 of each non-greedy row (temperature, top-k, top-p, min-p).

    Same rules as `revolta.engine.sampling.Sampler.probs`: top-k (<= 0 or >= V: off), then the smallest
    nucleus whose renormalised mass reaches top_p, then min_p relative to the most likely token.
    """
    N, V = logits.shape
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    s = logits.float() / t[:, None]
    k = torch.where((top_k > 0) & (top_k < V), top_k, torch.full_like(top_k, V)).long()
    sorted_s, order = s.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=logits.device)
    sorted_s = sorted_s.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
    sorted_p = sorted_s.softmax(dim=-1)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    drop = (mass_before >= top_p[:, None]) & (rank[None, :] > 0) & (top_p[:, None] < 1.0)
    sorted_s = sorted_s.masked_fill(drop, float("-inf"))
    s = torch.full_like(s, float("-inf")).scatter_(-1, order, sorted_s)
    probs = s.softmax(dim=-1)
    threshold = min_p[:, None].float() * probs.max(dim=-1, keepdim=True).values
    return probs.masked_fill((min_p[:, None] > 0) & (probs < threshold), 0.0)


def _uniform_ref(seeds: Tensor, offsets: Tensor, V: int) -> Tensor:
    """U [N, V] in (0, 1): Philox(seed, (token id, offset lo, offset hi, 0)), 23 bits + 1/2."""
    ids = torch.arange(V, device=seeds.device, dtype=torch.int64)[None, :]
    seed = seeds.long()[:, None]
    off = offsets.long()[:, None]
    r = philox_ref(seed, ids.expand(seeds.shape[0], V), (off & _M32).expand(-1, V), ((off >> 32) & _M32).expand(-1, V),
                   torch.zeros_like(ids).expand(seeds.shape[0], V))
    return ((r >> 9).float() + 0.5) * 2.0**-23


def sample_from_logits_ref(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor,
                           seeds: Tensor, offsets: Tensor) -> Tensor:
    """Reference of `sample_from_logits`: same allowed set rules, same Philox draws. Returns [N] int64."""
    greedy = logits.argmax(dim=-1)
    probs = sampling_probs_ref(logits, temperature, top_k, top_p, min_p)
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    e = -torch.log(_uniform_ref(seeds, offsets, logits.shape[1]))
    score = (logits.float() / t[:, None] - torch.log(e)).masked_fill(probs <= 0, float("-inf"))
    return torch.where(temperature > 0, score.argmax(dim=-1), greedy)


@triton.jit
def _key(b_l):
    # order-preserving map of fp32 to int32: flip the magnitude bits of negative numbers
    b = b_l.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _count_ge(p_l, V, t, BLOCK_V: tl.constexpr):
    n = tl.zeros([BLOCK_V], dtype=tl.int32)
    for v0 in range(0, V, BLOCK_V):
        o = v0 + tl.arange(0, BLOCK_V)
        m = o < V
        b_l = tl.load(p_l + o, mask=m, other=float("-inf"))
        n += ((_key(b_l) >= t) & m).to(tl.int32)
    return tl.sum(n, 0)


@triton.jit
def _mass_ge(p_l, V, t, s_max, temp, BLOCK_V: tl.constexpr):
    z = tl.zeros([BLOCK_V], dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        o = v0 + tl.arange(0, BLOCK_V)
        m = o < V
        b_l = tl.load(p_l + o, mask=m, other=float("-inf"))
        keep = (_key(b_l) >= t) & m
        z += tl.where(keep, tl.exp(b_l / temp - s_max), 0.0)
    return tl.sum(z, 0)


@triton.jit
def _sample_kernel(logits, temperature, top_k, top_p, min_p, seeds, offsets, out, V, stride_l,
                   BLOCK_V: tl.constexpr):
    i_n = tl.program_id(0).to(tl.int64)
    p_l = logits + i_n * stride_l
    best = float("-inf")
    best_i = 0
    for v0 in range(0, V, BLOCK_V):
        o = v0 + tl.arange(0, BLOCK_V)
        b_l = tl.load(p_l + o, mask=o < V, other=float("-inf"))
        c_max = tl.max(b_l, 0)
        c_i = tl.argmax(b_l, 0, tie_break_left=True) + v0
        better = c_max > best
        best_i = tl.where(better, c_i, best_i)
        best = tl.where(better, c_max, best)
    temp = tl.load(temperature + i_n)
    if temp > 0:
        s_max = best / temp
        k = tl.load(top_k + i_n)
        tp = tl.load(top_p + i_n)
        mp = tl.load(min_p + i_n)
        key_max = _key(best).to(tl.int64)
        t_k = key_max * 0 - 2147483648
        if (k > 0) & (k < V):
            # largest key t with count(key >= t) >= k
            lo = t_k
            hi = key_max
            while lo < hi:
                mid = lo + (hi - lo + 1) // 2
                ok = _count_ge(p_l, V, mid, BLOCK_V) >= k
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid - 1)
            t_k = lo
        t = t_k
        if tp < 1.0:
            target = tp * _mass_ge(p_l, V, t_k, s_max, temp, BLOCK_V)
            lo = t_k
            hi = key_max
            while lo < hi:
                mid = lo + (hi - lo + 1) // 2
                ok = _mass_ge(p_l, V, mid, s_max, temp, BLOCK_V) >= target
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid - 1)
            t = lo
        thr = tl.where(mp > 0, s_max + tl.log(tl.maximum(mp, 1e-30)), float("-inf"))
        seed = tl.load(seeds + i_n)
        off = tl.load(offsets + i_n)
        c1 = (off & 0xFFFFFFFF).to(tl.uint32)
        c2 = ((off >> 32) & 0xFFFFFFFF).to(tl.uint32)
        best = float("-inf")
        best_i = 0
        for v0 in range(0, V, BLOCK_V):
            o = v0 + tl.arange(0, BLOCK_V)
            m = o < V
            b_l = tl.load(p_l + o, mask=m, other=float("-inf"))
            b_s = b_l / temp
            allowed = m & (_key(b_l) >= t) & (b_s >= thr)
            zero = tl.zeros([BLOCK_V], dtype=tl.uint32)
            r, _, _, _ = tl.philox(seed, o.to(tl.uint32), zero + c1, zero + c2, zero)
            u = ((r >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
            score = tl.where(allowed, b_s - tl.log(-tl.log(u)), float("-inf"))
            c_max = tl.max(score, 0)
            c_i = tl.argmax(score, 0, tie_break_left=True) + v0
            better = c_max > best
            best_i = tl.where(better, c_i, best_i)
            best = tl.where(better, c_max, best)
    tl.store(out + i_n, best_i.to(tl.int64))


def sample_from_logits(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor,
                       seeds: Tensor, offsets: Tensor) -> Tensor:
    """Sample one token per row; no host sync. See the module docstring.

    logits: [N, V] fp32 (last dim contiguous); temperature, top_p, min_p: [N] fp32 (temperature 0 =
    greedy, top_p 1 = off, min_p 0 = off); top_k: [N] int32 (<= 0 or >= V: off); seeds, offsets: [N] int64.
    Returns [N] int64 token ids.
    """
    assert logits.dim() == 2 and logits.dtype == torch.float32 and logits.stride(-1) == 1, (logits.shape, logits.dtype)
    N, V = logits.shape
    assert V < 2**31
    for name, t, dt in (("temperature", temperature, torch.float32), ("top_k", top_k, torch.int32),
                        ("top_p", top_p, torch.float32), ("min_p", min_p, torch.float32),
                        ("seeds", seeds, torch.int64), ("offsets", offsets, torch.int64)):
        assert t.shape == (N,) and t.dtype == dt and t.is_contiguous(), (name, t.shape, t.dtype, N)
    out = torch.empty(N, dtype=torch.int64, device=logits.device)
    if N == 0:
        return out
    block_v = min(4096, triton.next_power_of_2(V))
    _sample_kernel[(N,)](logits, temperature, top_k, top_p, min_p, seeds, offsets, out, V, logits.stride(0),
                         BLOCK_V=block_v, num_warps=8 if block_v >= 2048 else 4)
    return out


def greedy_ref(logits: Tensor) -> Tensor:
    """argmax per row (first maximum), [N] int64."""
    return logits.argmax(dim=-1)


def greedy(logits: Tensor) -> Tensor:
    """Greedy argmax per row; the temperature-0 branch of `_sample_kernel`."""
    N = logits.shape[0]
    dev = logits.device
    zf = torch.zeros(N, dtype=torch.float32, device=dev)
    zi = torch.zeros(N, dtype=torch.int64, device=dev)
    return sample_from_logits(logits, zf, torch.zeros(N, dtype=torch.int32, device=dev), zf + 1, zf, zi, zi)

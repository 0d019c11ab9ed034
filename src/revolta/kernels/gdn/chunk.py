"""Chunked gated delta rule prefill over a flat varlen batch (spec/model.md §3.5, chunked form;
spec/performance.md §2.2), state pool in/out. This module holds the launch configuration and the
wrapper; the kernels live in chunk_intra.py, chunk_state.py and chunk_out.py.

Launches (chunk = 64 tokens, every grid sized by a host-known bound, so the wrapper never
synchronises with the device and can be graph-captured):
0. `_gdn_chunk_index_kernel`: chunk and segment tables from cu_seqlens (chunk_index.py).
1. `_gdn_chunk_intra_kernel` (chunk, v-head), or (chunk, k-head) with `intra_group_heads`: γ, 1/‖k‖,
   T = (I + β K̂K̂ᵀ ⊙ Γ)⁻¹ and the WY form W, U, in one pass (T stays in registers).
2. the state walk (chunk_state.py), serial over chunks: one program per (sequence, v-head, V
   block) for short batches; for batches of at least `cp_min_tokens` tokens each sequence is cut
   into segments of `seg_chunks` chunks that walk at the same time after a prescan (affine
   summary of each segment) and a merge (the segments' start states): context parallelism, so
   one long sequence does not run as a few hundred programs for T / 64 serial steps.
3. `_gdn_chunk_o_kernel` (V block, chunk, v-head): outputs from h_c and V'.
With `pipeline_pieces`, a long sequence whose serial walk leaves SMs idle (alone, or beside decode rows when the
caller passes the host's cu_seqlens) runs as chunk-aligned pieces whose stages overlap on three streams
(`_pipelined`): piece i's walk beside piece i+1's intra and i-1's outputs.

q and k stay raw in memory: their L2 norms (and the q scale) are per-row factors applied to dot
results or folded into the other operand. W, U, h_c, V' are stored in the input dtype (fp32 for
fp32 inputs), the running state, merges and all accumulations are fp32 (fla's precision choices).

sm70 note: tl.dot on Volta runs on FMA units (no tensor cores); a V100 variant should move the
intra-chunk products to torch.bmm and keep only the walk in Triton (`gdn_chunk_prefill` docstring).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from .chunk_index import BT, _gdn_chunk_index_kernel
from .chunk_intra import _gdn_chunk_intra_kernel
from .chunk_out import _gdn_chunk_o_kernel
from .chunk_state import _gdn_chunk_merge_kernel, _gdn_chunk_prescan_kernel, _gdn_chunk_walk_kernel

NO_SPLIT = 1 << 30  # segment length meaning "one segment per sequence"


@dataclass(frozen=True)
class PipelinePlan:
    """How a batch runs as pipelined pieces: sequence `seq` (of num_seqs) is cut at the token offsets `cuts` (flat
    batch positions, chunk-aligned within the sequence); the first piece also holds the sequences before it, the last
    the ones after it."""
    seq: int
    num_seqs: int
    cuts: tuple[int, ...]
    num_tokens: int

    def pieces(self) -> list[tuple[int, int, int, int]]:
        """(first token, end token, first sequence, end sequence) of each piece."""
        bounds = (0, *self.cuts, self.num_tokens)
        last = len(bounds) - 2
        return [(lo, hi, 0 if i == 0 else self.seq, self.num_seqs if i == last else self.seq + 1)
                for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]


@dataclass(frozen=True)
class ChunkConfig:
    """Block sizes, warps and pipeline stages of every launch, and when to split the walk.

    Block sizes are upper bounds: the wrapper shrinks each to a power of two dividing its dimension.
    """
    intra_bk: int  # K slice of K Kᵀ and of W
    intra_bv: int  # V slice of U
    intra_warps: int
    walk_bv: int  # V columns per walk program, one segment per sequence
    walk_warps: int
    walk_stages: int
    cp_walk_bv: int  # the same when the walk is split into segments
    cp_walk_warps: int
    cp_stages: int  # pipeline stages of the split walk and the prescan
    prescan_bv: int  # columns of the [Q | P] summary per prescan program
    prescan_warps: int
    merge_bv: int
    merge_warps: int
    out_bk: int
    out_bv: int  # V tile of one product
    out_vp: int  # V columns per output program (a multiple of out_bv; Q Kᵀ is computed once per program)
    out_warps: int
    out_stages: int
    cp_min_tokens: int  # split the walk when the batch has at least this many tokens (0: never)
    seg_chunks: int  # chunks per segment when split (0: chosen from the token count and SM count)
    # the walk stays serial when its programs fill at least this fraction of the SMs (segment_chunks)
    serial_min_fill: float = 1.0
    walk_k_halves: bool = False  # walk and prescan hold the state as two [K/2, BV] tiles (chunk_state.py)
    walk_transposed: bool = False  # the walk holds hᵀ [BV, K] and stores h_c as [V, K] (chunk_state.py)
    walk_prefetch: bool = False  # the walk loads each chunk's decay factors a chunk ahead (chunk_state.py)
    # the walk loads U and the decay factors in their own chunk, for Triton's pipeliner to stage with W and K̂ (cp.async
    # stages, as fla's walk), instead of a register prefetch one chunk ahead (chunk_state.py STAGE_U; sm_90 default)
    walk_stage_u: bool = False
    # one intra program per (chunk, k head) over its HV / H value heads: K Kᵀ and 1/‖k‖ (the same for the value
    # heads of one k head) once instead of HV / H times, on H programs per chunk instead of HV (chunk_intra.py;
    # opt-in: slower on an H100, RESULTS.md K1)
    intra_group_heads: bool = False
    # one sequence cut into up to this many chunk-aligned pieces of at least `pipeline_min_chunks` chunks, whose
    # stages overlap on three streams: piece i's serial walk (which leaves SMs idle) beside piece i+1's intra and
    # piece i-1's output stage (`_pipelined`); 0 or 1: off. Applies where the walk is not split, the sequence's walk
    # has fewer programs than the GPU has SMs and it holds 7/8 of the batch's tokens (`pipeline_plan`).
    pipeline_pieces: int = 0
    pipeline_min_chunks: int = 2
    # the first piece's share of the chunks (0: equal pieces); the others share the rest equally. A longer first walk
    # gives the next piece's intra stage time to finish beside it, a shorter last piece leaves less output work after
    # the last walk (`pipeline_cuts`)
    pipeline_lead: float = 0.0

    def serial_walk_programs(self, num_seqs: int, num_v_heads: int, V: int) -> int:
        """Programs of the walk when it is not split: one per (sequence, v-head, V tile)."""
        return num_seqs * num_v_heads * (V // _fit(self.walk_bv, V))

    def pipeline_pieces_for(self, num_tokens: int, seq_walk_programs: int, num_sms: int) -> int:
        """How many pipelined pieces one sequence of num_tokens runs as (`pipeline_pieces`; 1 = not pipelined): at
        least `pipeline_min_chunks` (and 2) chunks a piece, a walk (seq_walk_programs: its v-heads x V tiles) with
        SMs to spare."""
        pieces = min(self.pipeline_pieces, num_tokens // (BT * max(2, self.pipeline_min_chunks)))
        return pieces if pieces > 1 and seq_walk_programs < num_sms else 1

    def pipeline_plan(self, cu_seqlens: Sequence[int], seq_walk_programs: int, num_sms: int) -> PipelinePlan | None:
        """Whether a batch (host cu_seqlens) whose walk is not split runs pipelined, and how: its longest sequence
        must hold at least 7/8 of the tokens (the others, decode rows or short prompts, ride in the first and last
        pieces) and be long enough for `pipeline_pieces_for`. None: one piece."""
        lens = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]
        if not lens:
            return None
        seq = max(range(len(lens)), key=lens.__getitem__)
        pieces = self.pipeline_pieces_for(lens[seq], seq_walk_programs, num_sms)
        if pieces <= 1 or 8 * lens[seq] < 7 * cu_seqlens[-1]:
            return None
        start = cu_seqlens[seq]
        cuts = self.pipeline_cuts(-(-lens[seq] // BT), pieces)
        return PipelinePlan(seq, len(lens), tuple(min(start + c * BT, start + lens[seq]) for c in cuts[1:-1]),
                            cu_seqlens[-1])

    def pipeline_cuts(self, num_chunks: int, pieces: int) -> list[int]:
        """Chunk offsets where the pieces start, then num_chunks (pieces >= 2)."""
        first = round(self.pipeline_lead * num_chunks)
        if not 0 < first < num_chunks:
            first = -(-num_chunks // pieces)
        step = -(-(num_chunks - first) // (pieces - 1))
        return [0, *range(first, num_chunks, step), num_chunks]

    def segment_chunks(self, num_tokens: int, num_v_heads: int, num_sms: int, walk_programs: int = 0) -> int:
        """Chunks per walk segment for a batch of num_tokens tokens, or 0 for no split. walk_programs: the serial
        walk's programs (sequences x v-heads x V tiles); when they fill `serial_min_fill` of the SMs the walk is not
        split (H200, 1 x 32K, 48 v-heads: 192 32-column programs, serial 3.52 ms against 3.98 ms split; H100, 96
        64-column programs on 132 SMs: serial faster, RESULTS.md K1)."""
        if (self.cp_min_tokens <= 0 or num_tokens < self.cp_min_tokens
                or walk_programs >= self.serial_min_fill * num_sms):
            return 0
        if self.seg_chunks > 0:
            return self.seg_chunks
        # about 3 x sqrt(heads x chunks / SMs) chunks per segment (TileOPs' heuristic for H200):
        # more segments fill the GPU, fewer keep the merge chain and the prescan short
        chunks = max(1, num_tokens // BT)
        return max(8, 2 ** round(math.log2(3 * math.sqrt(num_v_heads * chunks / num_sms))))


def chunk_config(K: int, V: int, arch: int = 90) -> ChunkConfig:
    """The launch configuration for sm_<arch> (sm_70 and sm_90 builds are checked in
    tests/kernels/test_gdn_aot.py). On sm70 tl.dot is FMA-only and keeps whole operand rows per
    thread, so tiles shrink and warps double to bound register spills.
    """
    if arch < 80:  # intra at 4 warps: at 8, ptxas keeps 32 registers and spills 22 KB
        return ChunkConfig(intra_bk=32, intra_bv=32, intra_warps=4, walk_bv=16, walk_warps=8, walk_stages=1,
                           cp_walk_bv=16, cp_walk_warps=8, cp_stages=1, prescan_bv=16, prescan_warps=8,
                           merge_bv=16, merge_warps=8, out_bk=16, out_bv=32, out_vp=32, out_warps=8, out_stages=1,
                           cp_min_tokens=16384, seg_chunks=0)
    # walk: one program per (sequence, v-head, 64 columns), the 96 programs of one sequence at the real
    # shape in one wave, with every per-chunk input (W, K̂, U, the decay factors) in 3 cp.async stages as
    # fla's walk (walk_stage_u: the walk 305 -> 261 µs at 1 x 8K, 284 -> 239 at 8 x 1K on an H100 against
    # 32 columns with U prefetched in registers; RESULTS.md K1); 96 programs on 132 SMs stay serial
    # (serial_min_fill). Split walk and prescan: many programs per SM hide latency, so 2 stages.
    # One sequence of >= 8K tokens runs as 2-3 pipelined pieces of >= 64 chunks (the walk's 96 programs leave 36 SMs
    # idle): on an H100, 1 x 8K 0.91 -> 0.97x fla (bf16) / 0.94 -> 1.00x (fp16) as 2 pieces, 1 x 32K 0.96 -> 1.08x as
    # 3 (RESULTS.md K1b); shorter sequences are not pipelined (not timed), nor batches of several long ones; beside
    # decode rows (the engine's mixed steps) it is, by the same rule, not timed.
    return ChunkConfig(intra_bk=64, intra_bv=64, intra_warps=4, walk_bv=64, walk_warps=4, walk_stages=3,
                       cp_walk_bv=64, cp_walk_warps=4, cp_stages=2, prescan_bv=64, prescan_warps=4,
                       merge_bv=32, merge_warps=8, out_bk=64, out_bv=64, out_vp=128, out_warps=4, out_stages=2,
                       cp_min_tokens=16384, seg_chunks=0, walk_stage_u=True, serial_min_fill=0.5,
                       pipeline_pieces=3, pipeline_min_chunks=64)


def _fit(block: int, n: int) -> int:
    """The largest power of two <= block that divides n (n a multiple of 16)."""
    b = min(block, n)
    while n % b:
        b //= 2
    return b


def _device_arch(device: torch.device) -> int:
    if device.type != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_prefill_inputs(q, k, v, g, beta, cu_seqlens, ssm_state, slots, has_initial_state):
    assert q.dim() == 3 and k.shape == q.shape, f"q, k must be [T, H, K], got {tuple(q.shape)} and {tuple(k.shape)}"
    T, H, K = q.shape
    assert v.dim() == 3 and v.shape[0] == T, f"v must be [T={T}, HV, V], got {tuple(v.shape)}"
    HV, V = v.shape[1:]
    assert HV % H == 0, f"value heads ({HV}) must be a multiple of q/k heads ({H})"
    assert g.shape == (T, HV) and beta.shape == (T, HV), \
        f"g, beta must be [T={T}, HV={HV}], got {tuple(g.shape)} and {tuple(beta.shape)}"
    assert g.dtype == torch.float32 and beta.dtype == torch.float32, f"g, beta must be fp32, got {g.dtype}, {beta.dtype}"
    assert q.dtype == k.dtype == v.dtype and v.dtype in (torch.float16, torch.bfloat16, torch.float32), \
        f"q, k, v must share one of fp16/bf16/fp32, got {q.dtype}, {k.dtype}, {v.dtype}"
    for name, x, inner in (("q", q, K), ("k", k, K), ("v", v, V)):
        assert x.stride(-1) == 1 and x.stride(-2) == inner, \
            f"{name} must have contiguous heads (strides [*, {inner}, 1]), got {x.stride()}"
    assert g.stride(-1) == 1 and beta.stride(-1) == 1, "g, beta must be contiguous over heads"
    assert K in (16, 32, 64, 128, 256) and V % 16 == 0, f"K must be a power of two in [16, 256] and V a multiple of 16, got {K}, {V}"
    assert ssm_state.dtype == torch.float32 and ssm_state.dim() == 4 and ssm_state.shape[1:] == (HV, K, V) \
        and ssm_state.is_contiguous(), \
        f"ssm_state must be contiguous fp32 [num_slots, {HV}, {K}, {V}], got {ssm_state.dtype} {tuple(ssm_state.shape)}"
    assert slots.dtype == torch.int32 and slots.dim() == 1, f"slots must be int32 [B], got {slots.dtype} {tuple(slots.shape)}"
    B = slots.shape[0]
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.shape == (B + 1,), \
        f"cu_seqlens must be int32 [B+1={B + 1}], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
    assert has_initial_state.dtype == torch.bool and has_initial_state.shape == (B,), \
        f"has_initial_state must be bool [B={B}], got {has_initial_state.dtype} {tuple(has_initial_state.shape)}"
    devs = {x.device for x in (q, k, v, g, beta, cu_seqlens, ssm_state, slots, has_initial_state)}
    assert len(devs) == 1, f"all tensors must be on one device, got {devs}"
    return T, B, H, HV, K, V


def gdn_chunk_prefill(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                      ssm_state: Tensor, slots: Tensor, has_initial_state: Tensor, scale: float | None = None,
                      use_qk_l2norm: bool = True, config: ChunkConfig | None = None,
                      host_cu_seqlens: Sequence[int] | None = None) -> Tensor:
    """Chunked (C = 64) gated delta rule over a flat varlen batch, states from/to a slot pool.

    q, k: [T, H, K] raw (normalised in the kernels when use_qk_l2norm; views with contiguous heads
    are fine); v: [T, HV, V]; g (log decay), beta: [T, HV] fp32; cu_seqlens: int32 [B+1];
    ssm_state: [num_slots, HV, K, V] fp32; slots: int32 [B]; has_initial_state: bool [B] (False:
    start from zeros). Each sequence's final state is written to its slot (length 0: untouched).
    Returns o [T, HV, V] in v.dtype. scale defaults to K^-1/2. config: launch configuration
    (default `chunk_config` for the device). host_cu_seqlens: the host's copy of cu_seqlens where the caller has one
    (the engine's steps do): a batch where one sequence holds nearly all tokens (a long prompt beside decode rows) may
    then run pipelined (`ChunkConfig.pipeline_pieces`); it must equal cu_seqlens, and a CUDA graph captured with it
    replays those lengths only. A one-sequence batch needs no copy.

    V100: every tl.dot here runs on FMA units on sm70 (Triton has no Volta MMA); the follow-up is
    a variant doing the intra-chunk products (K Kᵀ, T·[K|V], Q Kᵀ, Q h, A V') as torch.bmm on
    cuBLAS tensor cores with only the sequential state walk in Triton.
    """
    T, B, H, HV, K, V = _check_prefill_inputs(q, k, v, g, beta, cu_seqlens, ssm_state, slots, has_initial_state)
    o = torch.empty(T, HV, V, dtype=v.dtype, device=v.device)
    if T == 0 or B == 0:
        return o
    dev, dt = v.device, v.dtype
    arch = _device_arch(dev)
    cfg = config or chunk_config(K, V, arch)
    assert not cfg.walk_k_halves or K >= 32, \
        f"walk_k_halves needs K >= 32 (two tiles of at least 16 rows for tl.dot), got K={K}: use walk_k_halves=False"
    assert not (cfg.walk_k_halves and cfg.walk_transposed), \
        "walk_k_halves and walk_transposed are two tilings of the walk: set at most one"
    assert not (cfg.walk_k_halves and cfg.walk_prefetch), \
        "walk_prefetch is a variant of the one-tile walk: set walk_k_halves=False with it"
    assert not (cfg.walk_stage_u and (cfg.walk_k_halves or cfg.walk_transposed)), \
        "walk_stage_u is a variant of the one-tile [K, BV] walk: set walk_k_halves and walk_transposed to False with it"
    launch = _Launch(cfg, H, HV, K, V, float(K**-0.5 if scale is None else scale), use_qk_l2norm,
                     tensor_f32=arch >= 80 and dt != torch.float32)
    walk_programs, num_sms = cfg.serial_walk_programs(B, HV, V), _num_sms(dev)
    seg = cfg.segment_chunks(T, HV, num_sms, walk_programs)
    host_cu = [0, T] if B == 1 else host_cu_seqlens
    assert host_cu is None or (len(host_cu) == B + 1 and host_cu[0] == 0 and host_cu[-1] == T), \
        f"host_cu_seqlens must be the host copy of cu_seqlens ([0, ..., T={T}], B+1={B + 1} entries), got {host_cu}"
    plan = None if seg or host_cu is None else cfg.pipeline_plan(host_cu, walk_programs // B, num_sms)
    if plan is not None:
        _pipelined(launch, plan, q, k, v, g, beta, cu_seqlens, ssm_state, slots, has_initial_state, o)
        return o
    piece = launch.piece(q, k, v, g, beta, cu_seqlens, has_initial_state, slots, o, B, T // BT + B, seg)
    launch.intra(piece)
    launch.walk(piece, ssm_state)
    launch.out(piece)
    return o


@dataclass(frozen=True)
class _Piece:
    """One launch set's view of the batch: the whole batch, or (pipelined) a chunk-aligned token range of its one
    sequence. Buffers are views of the call's; `num_chunks` bounds the grid (programs past the real count exit)."""
    q: Tensor
    k: Tensor
    v: Tensor
    g: Tensor
    beta: Tensor
    cu_seqlens: Tensor  # int32 [B+1]
    cu_chunks: Tensor  # int32 [B+1]
    cu_segs: Tensor  # int32 [B+1]
    has_initial_state: Tensor  # bool [B]
    slots: Tensor  # int32 [B]
    o: Tensor  # [T, HV, V]
    w: Tensor  # [T, HV, K]
    u: Tensor  # [T, HV, V]
    gcum: Tensor  # [T, HV] fp32
    k_rstd: Tensor  # [T, H] fp32
    h: Tensor  # [num_chunks, HV, K, V] (or [.., V, K] transposed)
    v_new: Tensor  # [T, HV, V]
    num_seqs: int
    num_chunks: int
    seg: int  # chunks per walk segment, 0: one serial walk per sequence


@dataclass(frozen=True)
class _Launch:
    """The three stages' launches for one call (shapes, precisions and the configuration fixed)."""
    cfg: ChunkConfig
    H: int
    HV: int
    K: int
    V: int
    scale: float
    use_qk_l2norm: bool
    tensor_f32: bool  # fp32 products may use TF32 tensor cores (sm80+, 16-bit inputs)

    def piece(self, q, k, v, g, beta, cu_seqlens, has_initial_state, slots, o, num_seqs, num_chunks, seg,
              buffers: tuple | None = None, h: Tensor | None = None) -> _Piece:
        """Index tables for `cu_seqlens` (launched now) and the stage buffers (new, or the given views)."""
        T, dev, dt = q.shape[0], q.device, v.dtype
        cu_chunks = torch.empty(num_seqs + 1, dtype=torch.int32, device=dev)
        cu_segs = torch.empty(num_seqs + 1, dtype=torch.int32, device=dev)
        _gdn_chunk_index_kernel[(1,)](cu_seqlens, cu_chunks, cu_segs, num_seqs, seg or NO_SPLIT,
                                      BLOCK=max(16, triton.next_power_of_2(num_seqs)))
        H, HV, K, V = self.H, self.HV, self.K, self.V
        w, u, gcum, k_rstd, v_new = buffers or (
            torch.empty(T, HV, K, dtype=dt, device=dev), torch.empty(T, HV, V, dtype=dt, device=dev),
            torch.empty(T, HV, dtype=torch.float32, device=dev), torch.empty(T, H, dtype=torch.float32, device=dev),
            torch.empty(T, HV, V, dtype=dt, device=dev))
        if h is None:
            h = torch.empty(num_chunks, HV, *((V, K) if self.cfg.walk_transposed else (K, V)), dtype=dt, device=dev)
        return _Piece(q, k, v, g, beta, cu_seqlens, cu_chunks, cu_segs, has_initial_state, slots, o, w, u, gcum,
                      k_rstd, h, v_new, num_seqs, num_chunks, seg)

    @property
    def prec(self) -> str:
        return "ieee"  # fp32 inputs: exact fp32 products (no TF32); fp16/bf16 inputs ignore it

    def intra(self, p: _Piece) -> None:
        cfg, K, V = self.cfg, self.K, self.V
        solve_prec = "tf32" if self.tensor_f32 else "ieee"  # T is rounded to the input dtype after, as in fla
        _gdn_chunk_intra_kernel[(p.num_chunks, self.H if cfg.intra_group_heads else self.HV)](
            p.k, p.v, p.g, p.beta, p.cu_seqlens, p.cu_chunks, p.w, p.u, p.gcum, p.k_rstd, p.num_seqs, p.k.stride(0),
            p.v.stride(0), p.g.stride(0), p.beta.stride(0), H=self.H, HV=self.HV, K=K, V=V, BK=_fit(cfg.intra_bk, K),
            BV=_fit(cfg.intra_bv, V), USE_L2NORM=self.use_qk_l2norm, DOT_PREC=self.prec, SOLVE_PREC=solve_prec,
            LOG_NUM_SEQ=_log_num_seqs(p.num_seqs), GROUP_HEADS=cfg.intra_group_heads, num_warps=cfg.intra_warps,
            num_stages=2)

    def walk(self, p: _Piece, ssm_state: Tensor) -> None:
        """The state walk from each sequence's slot state (or zeros) to its final state, written back to the slot;
        split into segments after a prescan and a merge when `p.seg`."""
        cfg, H, HV, K, V, dev = self.cfg, self.H, self.HV, self.K, self.V, p.v.device
        B, log_b = p.num_seqs, _log_num_seqs(p.num_seqs)
        merge_prec = "tf32x3" if self.tensor_f32 else "ieee"  # ~fp32 accuracy: the merge chains the state itself
        num_segs_max = (p.num_chunks + p.seg - 1) // p.seg + B if p.seg else B
        h_start = p.gcum  # read only by segments after a sequence's first: none without a split
        walk_bv, walk_warps, walk_stages = _fit(cfg.walk_bv, V), cfg.walk_warps, cfg.walk_stages
        if p.seg:
            hm = torch.empty(num_segs_max, HV, K, V + K, dtype=torch.float32, device=dev)
            h_start = torch.empty(num_segs_max, HV, K, V, dtype=torch.float32, device=dev)
            pbv = _fit(_fit(cfg.prescan_bv, V), K)
            _gdn_chunk_prescan_kernel[((V + K) // pbv, num_segs_max, HV)](
                p.k, p.w, p.u, p.gcum, p.k_rstd, hm, p.cu_seqlens, p.cu_chunks, p.cu_segs, B, p.seg, p.k.stride(0),
                H=H, HV=HV, K=K, V=V, BV=pbv, DOT_PREC=self.prec, LOG_NUM_SEQ=log_b, K_HALVES=cfg.walk_k_halves,
                num_warps=cfg.prescan_warps, num_stages=cfg.cp_stages)
            mbv = _fit(cfg.merge_bv, V)
            _gdn_chunk_merge_kernel[(V // mbv, B, HV)](
                hm, h_start, ssm_state, p.slots, p.has_initial_state, p.cu_segs, HV=HV, K=K, V=V, BV=mbv,
                MERGE_PREC=merge_prec, num_warps=cfg.merge_warps, num_stages=2)  # [K, K] fp32: 96 KiB (160 at 3 stages)
            walk_bv, walk_warps, walk_stages = _fit(cfg.cp_walk_bv, V), cfg.cp_walk_warps, cfg.cp_stages
        _gdn_chunk_walk_kernel[(V // walk_bv, num_segs_max, HV)](
            p.k, p.w, p.u, p.gcum, p.k_rstd, p.h, p.v_new, ssm_state, p.slots, p.has_initial_state, h_start,
            p.cu_seqlens, p.cu_chunks, p.cu_segs, B, p.seg or NO_SPLIT, p.k.stride(0), H=H, HV=HV, K=K, V=V,
            BV=walk_bv, DOT_PREC=self.prec, LOG_NUM_SEQ=log_b, K_HALVES=cfg.walk_k_halves,
            TRANSPOSED=cfg.walk_transposed, PREFETCH=cfg.walk_prefetch, STAGE_U=cfg.walk_stage_u,
            num_warps=walk_warps, num_stages=walk_stages)

    def out(self, p: _Piece) -> None:
        cfg, K, V = self.cfg, self.K, self.V
        ovp = _fit(cfg.out_vp, V)
        _gdn_chunk_o_kernel[(V // ovp, p.num_chunks, self.HV)](
            p.q, p.k, p.h, p.v_new, p.gcum, p.k_rstd, p.o, p.cu_seqlens, p.cu_chunks, p.num_seqs, self.scale,
            p.q.stride(0), p.k.stride(0), H=self.H, HV=self.HV, K=K, V=V, BK=_fit(cfg.out_bk, K),
            BV=_fit(cfg.out_bv, ovp), VP=ovp, USE_L2NORM=self.use_qk_l2norm, DOT_PREC=self.prec,
            LOG_NUM_SEQ=_log_num_seqs(p.num_seqs), H_T=cfg.walk_transposed, num_warps=cfg.out_warps,
            num_stages=cfg.out_stages)


def _log_num_seqs(num_seqs: int) -> int:
    return max(1, (num_seqs - 1).bit_length())


def _pipelined(launch: _Launch, plan: PipelinePlan, q, k, v, g, beta, cu_seqlens, ssm_state, slots,
               has_initial_state, o) -> None:
    """The batch as pieces (`plan`) whose stages overlap: the long sequence is cut into chunk-aligned token ranges,
    and piece i's serial walk (a few programs, most SMs idle: one per v-head and 64 columns, 96 on 132 SMs at the
    real shape) runs beside piece i+1's intra stage and piece i-1's output stage. Piece i+1's walk starts the long
    sequence from the state piece i's walk wrote to its slot; the other sequences walk whole in the first or the last
    piece. Bitwise the one-piece call (every chunk's arithmetic is the same; the walk's state passes through the fp32
    slot).

    Streams (CUDA): one per stage, by priority the walks (the critical path), the intra stages, the outputs; each
    waits for its inputs by event and the caller's stream waits for all before returning, so the call is
    graph-capturable and every buffer, allocated on the caller's stream before the fork, is freed after the join.
    Elsewhere (the Triton interpreter) the pieces run in order on one stream."""
    T, HV, K, V = q.shape[0], launch.HV, launch.K, launch.V
    dev, dt = v.device, v.dtype
    pieces = plan.pieces()
    chunks = [(hi - lo) // BT + (s1 - s0) for lo, hi, s0, s1 in pieces]  # a bound on each piece's chunks
    buffers = (torch.empty(T, HV, K, dtype=dt, device=dev), torch.empty(T, HV, V, dtype=dt, device=dev),
               torch.empty(T, HV, dtype=torch.float32, device=dev),
               torch.empty(T, launch.H, dtype=torch.float32, device=dev), torch.empty(T, HV, V, dtype=dt, device=dev))
    h = torch.empty(sum(chunks), HV, *((V, K) if launch.cfg.walk_transposed else (K, V)), dtype=dt, device=dev)
    started = torch.ones_like(has_initial_state[:1])  # the long sequence after the first piece: from its slot state
    parts, h_at = [], 0
    for (lo, hi, s0, s1), n_chunks in zip(pieces, chunks):
        cu = (cu_seqlens[s0:s1 + 1] - lo).clamp(0, hi - lo)  # [0, .., hi - lo]: the piece's own varlen batch
        init = has_initial_state[s0:s1] if lo == 0 else torch.cat((started, has_initial_state[s0 + 1:s1]))
        parts.append(launch.piece(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], cu, init, slots[s0:s1],
                                  o[lo:hi], s1 - s0, n_chunks, 0, buffers=tuple(x[lo:hi] for x in buffers),
                                  h=h[h_at:h_at + n_chunks]))
        h_at += n_chunks
    if dev.type != "cuda":
        for p in parts:
            launch.intra(p)
            launch.walk(p, ssm_state)
            launch.out(p)
        return
    main = torch.cuda.current_stream(dev)
    # priorities (lower runs first when SMs free up): the walk, then the intra stage that the next walk waits for,
    # then the outputs, which nothing in the call waits for (against intra on the caller's stream at the outputs'
    # priority: no change beyond run-to-run noise on an H100, RESULTS.md K1b)
    walk_stream, intra_stream, out_stream = (torch.cuda.Stream(dev, priority=p) for p in (-2, -1, 0))
    for stream in (walk_stream, intra_stream, out_stream):
        stream.wait_stream(main)
    for p in parts:
        with torch.cuda.stream(intra_stream):
            launch.intra(p)
            intra_done = intra_stream.record_event()
        with torch.cuda.stream(walk_stream):
            walk_stream.wait_event(intra_done)
            launch.walk(p, ssm_state)
            walk_done = walk_stream.record_event()
        with torch.cuda.stream(out_stream):
            out_stream.wait_event(walk_done)
            launch.out(p)
    for stream in (walk_stream, intra_stream, out_stream):
        main.wait_stream(stream)

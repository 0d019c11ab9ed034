"""Varlen addressing shared by the chunked-prefill kernels (chunk_intra, chunk_state, chunk_out).

A flat batch of B sequences (cu_seqlens int32 [B+1]) is cut into chunks of 64 tokens per
sequence; `cu_chunks` [B+1] is the running count of chunks, so a global chunk index names one
(sequence, chunk) pair. For the state walk each sequence is further cut into segments of
SEG_CHUNKS chunks (context parallelism: segments walk at the same time, see chunk_state.py);
`cu_segs` [B+1] counts them the same way. Both tables are built on the device by
`_gdn_chunk_index_kernel`, so no launch needs the lengths on the host (graph-capturable), and
every grid is sized by a host-known bound; programs past the real count exit at once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..conv1d import _find_seq

BT = 64  # tokens per chunk


@triton.jit(do_not_specialize=["NUM_SEQ", "SEG_CHUNKS"])  # one build for any batch
def _gdn_chunk_index_kernel(cu_seqlens, cu_chunks, cu_segs, NUM_SEQ, SEG_CHUNKS, BLOCK: tl.constexpr):
    """cu_chunks = [0, cumsum(ceil(len / 64))], cu_segs = [0, cumsum(ceil(chunks / SEG_CHUNKS))]."""
    o_b = tl.arange(0, BLOCK)
    m_b = o_b < NUM_SEQ
    bos = tl.load(cu_seqlens + o_b, mask=m_b, other=0)
    eos = tl.load(cu_seqlens + o_b + 1, mask=m_b, other=0)
    n_chunks = (eos - bos + 63) // 64
    n_segs = (n_chunks + SEG_CHUNKS - 1) // SEG_CHUNKS
    tl.store(cu_chunks + 1 + o_b, tl.cumsum(n_chunks, 0), mask=m_b)
    tl.store(cu_segs + 1 + o_b, tl.cumsum(n_segs, 0), mask=m_b)
    zero = tl.zeros([BLOCK], dtype=tl.int32)
    tl.store(cu_chunks + o_b, zero, mask=o_b == 0)
    tl.store(cu_segs + o_b, zero, mask=o_b == 0)


@triton.jit
def _chunk_rows(cu_seqlens, cu_chunks, i_c, NUM_SEQ, LOG_NUM_SEQ: tl.constexpr):
    """Global chunk index -> its 64 token rows (int64) and which of them exist (the last chunk of a
    sequence may be partial)."""
    i_b = _find_seq(cu_chunks, i_c, NUM_SEQ, LOG_NUM_SEQ)
    t0 = tl.load(cu_seqlens + i_b) + (i_c - tl.load(cu_chunks + i_b)) * 64
    o_r = tl.arange(0, 64)
    return (t0 + o_r).to(tl.int64), t0 + o_r < tl.load(cu_seqlens + i_b + 1)


@triton.jit
def _segment_bounds(cu_seqlens, cu_chunks, cu_segs, i_s, NUM_SEQ, SEG_CHUNKS, LOG_NUM_SEQ: tl.constexpr):
    """Global segment index -> (sequence, its first token, its end, the segment's chunk range
    [c_lo, c_hi) counted inside the sequence, the sequence's chunk count, its first global chunk)."""
    i_b = _find_seq(cu_segs, i_s, NUM_SEQ, LOG_NUM_SEQ)
    bos = tl.load(cu_seqlens + i_b)
    eos = tl.load(cu_seqlens + i_b + 1)
    c_base = tl.load(cu_chunks + i_b)
    n_chunks = tl.load(cu_chunks + i_b + 1) - c_base
    c_lo = (i_s - tl.load(cu_segs + i_b)) * SEG_CHUNKS
    c_hi = tl.minimum(c_lo + SEG_CHUNKS, n_chunks)
    return i_b, bos, eos, c_lo, c_hi, n_chunks, c_base

"""Prefix-cache keys and the hybrid hit rule.

Block j of a sequence is keyed by a chained hash over its `block_size` token ids and the key
of block j-1, so a key names the whole prefix [0, (j+1) * block_size), not just one block. The
same key names the state snapshot taken at that block's end boundary. `extra_keys` lets a
caller mix more into a block's key (media content hashes of the placeholder tokens inside the
block, later a LoRA id); it defaults to nothing.

Keys are 128-bit BLAKE2b digests of the token bytes: deterministic across processes and
restarts (no PYTHONHASHSEED dependence) and with negligible collision odds.

A hit of k blocks needs all of: the K/V of blocks 0..k-1 (on the GPU or in the CPU tier) and a
state snapshot at boundary k * block_size (GPU or CPU), because the recurrent GDN/PLE state
cannot be rebuilt from K/V. The hit is capped at len(tokens) - 1: the last known token is
always recomputed, since logits come only from computed positions.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence

# extra_keys(start, end) -> hashable extras for the tokens [start, end)
ExtraKeysFn = Callable[[int, int], tuple]

_ROOT = b"revolta-prefix-v1"


def hash_block(parent: int | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> int:
    """Chained key of one full block: parent key (None for block 0) + its token ids (+ extras)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(_ROOT if parent is None else parent.to_bytes(16, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return int.from_bytes(h.digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, num_blocks: int, *, start: int = 0,
                 parent: int | None = None, extra_keys: ExtraKeysFn | None = None) -> list[int]:
    """Keys of blocks start .. num_blocks-1 (each must be full), chained from `parent` (block start-1's key)."""
    out = []
    for j in range(start, num_blocks):
        lo, hi = j * block_size, (j + 1) * block_size
        if hi > len(token_ids):
            raise ValueError(f"block {j} needs tokens up to {hi}, only {len(token_ids)} known")
        parent = hash_block(parent, token_ids[lo:hi], extra_keys(lo, hi) if extra_keys else ())
        out.append(parent)
    return out


def longest_hit(hashes: Sequence[int], has_kv: Callable[[int], bool], has_state: Callable[[int], bool]) -> int:
    """Number of leading blocks k such that blocks 0..k-1 all have K/V and block k-1 has a state
    snapshot at its end (0 when none). `hashes` should already be capped at (len - 1) // block_size."""
    for k in range(kv_hit_blocks(hashes, has_kv), 0, -1):
        if has_state(hashes[k - 1]):
            return k
    return 0


def kv_hit_blocks(hashes: Sequence[int], has_kv: Callable[[int], bool]) -> int:
    """Leading blocks with K/V, state ignored (a longer K/V hit than `longest_hit` marks a junction)."""
    k = 0
    while k < len(hashes) and has_kv(hashes[k]):
        k += 1
    return k

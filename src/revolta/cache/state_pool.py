"""State slots: one slot id addresses a request's fixed-size state in every stateful layer at once.

A slot holds, per GDN layer, the recurrent state `ssm_state[slot]` and `conv_state[slot]`; per
PLE layer its conv history and n-gram context ids; per QSA layer (and the MTP layer) the
pending raw index keys of the incomplete compress block, with their positions (see
`storage.CacheStorage`). Slot 0 is the dummy slot that padded CUDA-graph rows write into.

Slots play three roles, all handed out by the same `BlockPool` bookkeeping:

- running slot: one per scheduled request, ref 1, uncached;
- per-draft slots: with speculative decoding and no replay, the verifier writes the state after
  draft j into its own slot; `HybridAllocator.commit` keeps the accepted one as the new running
  slot and frees the rest (the slot ids rotate; nothing is copied);
- snapshot slots: a copy of a running state taken at a block boundary, cached under that
  block's chain hash (a prefix hit restores it). Ref 0 while cached, so LRU-evictable; a hit
  pins it (ref 1) until the request's next commit, so no one reuses it before the copy ran.
"""

from __future__ import annotations

from .block_pool import NULL_ID, BlockPool

DUMMY_SLOT = NULL_ID


class StatePool(BlockPool):
    """`num_slots` slots, slot 0 the dummy; same API as `BlockPool`."""

"""Decode context parallelism (DCP): the trunk QSA layers' K/V striped over the ranks that share a KV head.

At tp > num_key_value_heads, tp / kv ranks hold the same KV head; DCP of size dcp makes each group of dcp
consecutive ranks (which share one KV head) hold 1/dcp of every sequence's K/V instead of a copy each:
token t on group rank t % dcp (kernels/qsa/dcp.py has the layout). The compressed index keys, the selection,
the GDN / PLE state and the MTP layer's K/V stay replicated, so the sparse selection is the single-process one.

Per trunk QSA layer and step (prefill, decode and verify alike; two all-gathers in the DCP group):
  1. store only this rank's stripe of the new K/V (`local_slot_mapping`; every rank computed the same K/V);
  2. all-gather the queries of the group's heads [T, dcp * H, D] (they all read this rank's KV head);
  3. attend every row's selected groups + tail over the local stripe: un-gated out and log-sum-exp per head
     (`ops.qsa_partial`: the torch reference, or the Triton row kernel with no host sync);
  4. all-gather (out, lse), merge this rank's heads exactly (`merge_partials`), apply the output gate.
The all-gather in 4 moves every head's partial output where each rank needs only its own (vLLM reduce-scatters
or all-to-alls them): simpler, and gloo has no all-to-all for uneven shapes; a GPU version would use one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..config import TextConfig
from ..kernels.qsa.dcp import local_slot_mapping, merge_partials
from ..layers.qsa import QSAttention
from .context import ParallelContext


class DCPAttention(QSAttention):
    """A trunk QSA layer (local heads of a rank) whose paged K/V is this rank's stripe in a DCP group `dcp`.
    The per-sequence (non-paged) torch path is QSAttention's: it keeps whole K/V (a reference path)."""

    def __init__(self, cfg: TextConfig, state_key: str, cache_key: int, dcp: ParallelContext):
        super().__init__(cfg, state_key, cache_key)
        if cfg.num_key_value_heads != 1:
            raise ValueError(f"DCP splits the tokens of one KV head per rank; this rank holds {cfg.num_key_value_heads}")
        self.dcp = dcp

    def _kv_slots(self, pm) -> Tensor:
        return local_slot_mapping(pm.slot_mapping, pm.storage.layout.block_size, self.dcp.size, self.dcp.rank)

    def _paged_attention(self, q: Tensor, gate: Tensor, iq: Tensor, cache, kv_dtype: str, pm) -> Tensor:
        """q, gate [T, H, D] (this rank's heads) -> [T, H, D] gated, over every rank's tokens."""
        T, H, D = q.shape
        r, n = self.dcp.rank, self.dcp.size
        group_q = self.dcp.all_gather(q.contiguous(), dim=1)  # [T, n * H, D], group rank order = head order
        out, lse = pm.ops.qsa_partial(group_q, cache.k_cache, cache.v_cache, pm.block_table, pm.cu_seqlens,
                                      pm.seq_lens, D**-0.5, self.block_budget, iq.contiguous(), cache.index_cache, n,
                                      r, kv_dtype, cache.k_scale, cache.v_scale, self.ratio)
        parts = self.dcp.all_gather(torch.cat([out, lse[..., None]], dim=-1)[None], dim=0)  # [n, T, n * H, D + 1]
        mine = parts[:, :, r * H:(r + 1) * H]
        att = merge_partials(mine[..., :D], mine[..., D])  # [T, H, D] fp32
        return (att * torch.sigmoid(gate.float())).to(q.dtype)

"""QSA (Qwen Sparse Attention) mixer: gated GQA attention over indexer-selected blocks (spec §4).

Each query sees the top-`budget` complete blocks of `c` tokens by indexer score plus the
tail of its own incomplete block. While a query has at most budget/c complete blocks in
view it sees the whole causal prefix, so QSA equals dense attention up to the sparse onset.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..config import TextConfig
from ..forward import ForwardMeta
from ..state import QSAState
from .merged_linear import MergedLinear, MergedQuant, merge_linears, merge_quant_linears, project
from .norm import ZCRMSNorm
from .rope import apply_rope


def select_blocks(scores: Tensor, num_visible: Tensor, budget: int) -> Tensor:
    """Top-`budget` blocks per query with a deterministic tie policy.

    scores: [Tq, NB] fp32 block scores; num_visible: [Tq] complete blocks each query may see.
    Returns a bool mask [Tq, NB] of chosen blocks. Ties are broken by descending score, then
    ascending block index (spec §4.4; the references' torch.topk leaves ties undefined).
    """
    nb = scores.shape[-1]
    visible = torch.arange(nb, device=scores.device)[None, :] < num_visible[:, None]
    masked = scores.masked_fill(~visible, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices  # stable: lower index first on ties
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(nb, device=scores.device).expand_as(order))
    return visible & (rank < budget)


def norm_rope_or(x: Tensor, norm: ZCRMSNorm, cos: Tensor, sin: Tensor, rope, norm_rope) -> Tensor:
    """RoPE(norm(x)) for x [T, H, D]: one fused launch when `norm_rope` is given (kernels/norm_rope.py, which
    rounds between the two as here), else the norm module and then `rope`."""
    if norm_rope is not None:
        return norm_rope(x, norm.weight, norm.eps, cos, sin)
    return rope(norm(x).contiguous(), cos, sin)


class QSAIndexer(nn.Module):
    """Projects index queries and raw index keys; scores compressed blocks (spec §4.3)."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.indexer_n_heads, cfg.indexer_head_dim
        self.index_qk_proj = nn.Linear(cfg.hidden_size, (self.n_heads + 1) * self.head_dim, bias=False)
        self.q_layernorm = ZCRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_layernorm = ZCRMSNorm(self.head_dim, cfg.rms_norm_eps)

    def project(self, x: Tensor, cos: Tensor, sin: Tensor, rope=apply_rope, norm_rope=None,
                qk: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x: [T, d] -> (index queries [T, Hi, Di] normed + RoPEd, raw index keys [T, Di]).
        norm_rope: kernels.norm_rope.zc_norm_rope (norm and RoPE in one launch) instead of the norm, then `rope`.
        qk: index_qk_proj(x) when the caller computed it (QSAttention's merged input projection)."""
        qk = self.index_qk_proj(x) if qk is None else qk
        q, k = qk.split([self.n_heads * self.head_dim, self.head_dim], dim=-1)
        q = norm_rope_or(q.unflatten(-1, (self.n_heads, self.head_dim)), self.q_layernorm, cos, sin, rope, norm_rope)
        return q, k

    def block_keys(self, raw: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Compress complete blocks. raw: [nb, c, Di]; cos/sin: [nb, R] of each block's first token -> [nb, Di]."""
        pooled = raw.float().mean(dim=1).to(raw.dtype)  # fp32 mean, one rounding
        return apply_rope(self.k_layernorm(pooled)[:, None, :], cos, sin)[:, 0, :]

    def scores(self, q: Tensor, keys: Tensor) -> Tensor:
        """q: [..., Tq, Hi, Di], keys: [..., NB, Di] -> [..., Tq, NB] fp32: Σ_heads ReLU(q·k) / sqrt(Di)."""
        dots = torch.einsum("...thd,...nd->...thn", q.float(), keys.float())
        return dots.relu().sum(dim=-2) / math.sqrt(self.head_dim)


class QSAttention(nn.Module):
    def __init__(self, cfg: TextConfig, state_key: str, cache_key: int | str):
        super().__init__()
        self.state_key, self.cache_key = state_key, cache_key  # cache_key: layer index, or "mtp"
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.ratio, self.block_budget = cfg.indexer_compress_ratio, cfg.qsa_block_budget
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim * 2, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)
        self.q_norm = ZCRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZCRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.indexer = QSAIndexer(cfg)
        self.merged_in_proj: MergedLinear | None = None  # see merge_projections (not a parameter: names unchanged)
        self.merged_packed_in_proj: MergedQuant | None = None  # the packed (quantized) parts' merge

    def in_projections(self) -> tuple[nn.Module, ...]:
        """The projections that read the block input, in the order `forward` unpacks them."""
        return self.q_proj, self.k_proj, self.v_proj, self.indexer.index_qk_proj

    def merge_projections(self) -> None:
        """One GEMM for the four input projections from now on, and one packed GEMV for those stored quantized
        (layers/merged_linear.py); call after the weights are loaded (ModelRunner and the loaders do). Idempotent."""
        parts = self.in_projections()
        self.merged_in_proj = merge_linears(parts, self.merged_in_proj)
        self.merged_packed_in_proj = merge_quant_linears(parts, self.merged_packed_in_proj)

    def new_state(self, x: Tensor, rotary_dim: int) -> QSAState:
        kv = x.new_zeros(0, self.num_kv_heads, self.head_dim)
        idx = x.new_zeros(0, self.indexer.head_dim)
        table = torch.zeros(0, rotary_dim, device=x.device)
        return QSAState(k=kv, v=kv.clone(), index_keys=idx, block_keys=idx.clone(), block_cos=table,
                        block_sin=table.clone())

    def forward(self, x: Tensor, meta: ForwardMeta) -> Tensor:
        """x: [T, d] -> [T, d]."""
        T = x.shape[0]
        # column views of one GEMM once merged (their row stride is the merged width; the kernels take it)
        qg, k, v, index_qk = project(self.in_projections(), (self.merged_in_proj, self.merged_packed_in_proj), x)
        qg = qg.view(T, self.num_heads, 2 * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim :]  # per head [query | gate]
        ops = meta.paged.ops if meta.paged is not None else None
        rope = ops.apply_rope if ops is not None and ops.apply_rope is not None else apply_rope
        norm_rope = ops.zc_norm_rope if ops is not None else None
        q = norm_rope_or(q, self.q_norm, meta.cos, meta.sin, rope, norm_rope)  # norms before RoPE
        k = norm_rope_or(k.view(T, self.num_kv_heads, self.head_dim), self.k_norm, meta.cos, meta.sin, rope, norm_rope)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        iq, ik = self.indexer.project(x, meta.cos, meta.sin, rope, norm_rope, qk=index_qk)
        if meta.paged is not None:
            out = self._attend_paged(q, gate, k, v, iq, ik, meta)
            return self.o_proj(out.flatten(-2))
        if meta.uniform_fresh:
            out = self._attend_batch(q, k, v, iq, ik, meta)
            return self.o_proj(out.flatten(-2) * torch.sigmoid(gate.flatten(-2)))
        out = torch.empty(T, self.num_heads, self.head_dim, dtype=x.dtype, device=x.device)
        for _, start, end, seq in meta.seq_slices():
            st = seq.layers.get(self.state_key)
            if st is None:
                st = seq.layers[self.state_key] = self.new_state(x, meta.cos.shape[-1])
            self._append(st, k[start:end], v[start:end], ik[start:end], meta.cos[start:end], meta.sin[start:end])
            out[start:end] = self._attend(st, q[start:end], iq[start:end])
        out = out.flatten(-2) * torch.sigmoid(gate.flatten(-2))  # elementwise gate per (head, dim)
        return self.o_proj(out)

    def _attend_paged(self, q: Tensor, gate: Tensor, k: Tensor, v: Tensor, iq: Tensor, ik: Tensor,
                      meta: ForwardMeta) -> Tensor:
        """Store K/V and index keys in the paged cache, then gated sparse attention -> [T, H, D]."""
        pm = meta.paged
        cache = pm.storage.mtp if self.cache_key == "mtp" else pm.storage.qsa[self.cache_key]
        kv_dtype = pm.storage.layout.draft_kv_cache_dtype if self.cache_key == "mtp" \
            else pm.storage.layout.kv_cache_dtype
        # v, a column slice of the merged projection, goes with its row stride (store_kv takes it: no copy)
        pm.ops.store_kv(k.contiguous(), v, cache.k_cache, cache.v_cache, self._kv_slots(pm), kv_dtype,
                        cache.k_scale, cache.v_scale)
        # every group this step completes is compressed before selection: a query's own complete
        # group is a candidate like any other (spec §4.4); ik, a column slice, goes with its row stride
        pm.ops.index_compress(ik, meta.cos, meta.sin, pm.storage.pending_keys[self.cache_key],
                              pm.group_cos, pm.group_sin, self.indexer.k_layernorm.weight,
                              self.indexer.k_layernorm.eps, cache.index_cache, pm.block_table, pm.cu_seqlens,
                              pm.seq_lens, pending_slots=pm.slots, max_new_tokens=pm.max_new_tokens,
                              ratio=self.ratio)
        return self._paged_attention(q, gate, iq, cache, kv_dtype, pm)

    def _kv_slots(self, pm) -> Tensor:
        """Where this rank stores the step's K/V (parallel/dcp.py stores a stripe)."""
        return pm.slot_mapping

    def _paged_attention(self, q: Tensor, gate: Tensor, iq: Tensor, cache, kv_dtype: str, pm) -> Tensor:
        """Gated sparse attention of the step's rows over the paged cache (which holds them) -> [T, H, D]."""
        scale = self.head_dim**-0.5
        if pm.is_decode or (pm.spec is not None and pm.spec.equal_rows):
            # decode, or a verify whose requests all have R rows: the decode kernels' [B, R] row form (rows at
            # seq_len - R .. seq_len - 1), each row computed as the decode of its token would be
            lead = (pm.spec.num_seqs, pm.spec.num_rows) if pm.spec is not None else (q.shape[0],)
            iq, q = (x.contiguous().view(*lead, *x.shape[1:]) for x in (iq, q))
            gate = gate.view(*lead, *gate.shape[1:])  # a strided view of q_proj's output: the kernels take row strides
            selected = pm.ops.qsa_select_decode(iq, cache.index_cache, pm.block_table, pm.seq_lens,
                                                self.block_budget, ratio=self.ratio)
            out = pm.ops.qsa_sparse_decode(q, gate, cache.k_cache, cache.v_cache, pm.block_table, pm.seq_lens,
                                           selected, scale, kv_dtype, cache.k_scale, cache.v_scale, ratio=self.ratio)
            return out.flatten(0, len(lead) - 1)
        return pm.ops.qsa_prefill(q.contiguous(), gate.contiguous(), cache.k_cache, cache.v_cache, pm.block_table,
                                  pm.cu_seqlens, pm.seq_lens, scale, self.block_budget, index_q=iq.contiguous(),
                                  index_cache=cache.index_cache, kv_dtype=kv_dtype, k_scale=cache.k_scale,
                                  v_scale=cache.v_scale, ratio=self.ratio)

    def _append(self, st: QSAState, k: Tensor, v: Tensor, ik: Tensor, cos: Tensor, sin: Tensor) -> None:
        """Add new tokens' K/V and index keys; compress every block they complete."""
        c = self.ratio
        st.k, st.v = torch.cat([st.k, k]), torch.cat([st.v, v])
        st.index_keys = torch.cat([st.index_keys, ik])
        st.block_cos, st.block_sin = torch.cat([st.block_cos, cos]), torch.cat([st.block_sin, sin])
        done, total = st.block_keys.shape[0], st.num_tokens // c
        if total > done:
            raw = st.index_keys[done * c : total * c].unflatten(0, (total - done, c))  # [nb, c, Di]
            first = torch.arange(done, total, device=k.device) * c
            new = self.indexer.block_keys(raw, st.block_cos[first], st.block_sin[first])
            st.block_keys = torch.cat([st.block_keys, new])

    def _attend(self, st: QSAState, q: Tensor, iq: Tensor) -> Tensor:
        """Queries are the last len(q) tokens of the state. q: [Tq, H, D] -> [Tq, H, D]."""
        c = self.ratio
        n, tq = st.num_tokens, q.shape[0]
        pos = torch.arange(n - tq, n, device=q.device)  # absolute token index of each query
        keys = torch.arange(n, device=q.device)
        allowed = keys[None, :] <= pos[:, None]  # [Tq, n] causal
        num_blocks = torch.div(pos + 1, c, rounding_mode="floor")  # complete blocks in view (own token counts)
        sparse = num_blocks > self.block_budget
        if bool(sparse.any()):
            scores = self.indexer.scores(iq[sparse], st.block_keys)  # [Ts, NB]
            chosen = select_blocks(scores, num_blocks[sparse], self.block_budget)  # [Ts, NB]
            chosen_tokens = chosen.repeat_interleave(c, dim=-1)  # [Ts, NB * c]
            sel = torch.zeros(chosen.shape[0], n, dtype=torch.bool, device=q.device)
            sel[:, : chosen_tokens.shape[1]] = chosen_tokens
            tail = keys[None, :] >= (num_blocks[sparse] * c)[:, None]  # the incomplete block, up to the query
            allowed[sparse] = allowed[sparse] & (sel | tail)
        rep = self.num_heads // self.num_kv_heads  # q-head h reads kv-head h // rep
        kk = st.k.repeat_interleave(rep, dim=1).float()  # [n, H, D]
        vv = st.v.repeat_interleave(rep, dim=1).float()
        logits = torch.einsum("qhd,khd->hqk", q.float(), kk) / math.sqrt(self.head_dim)
        logits = logits.masked_fill(~allowed[None], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, vv).to(q.dtype)

    def _attend_batch(self, q: Tensor, k: Tensor, v: Tensor, iq: Tensor, ik: Tensor, meta: ForwardMeta) -> Tensor:
        """`_append` + `_attend` for B fresh sequences of equal length S, as one batch (training) -> [T, H, D].
        Same arithmetic per sequence; each sequence's state is kept as the per-sequence path keeps it."""
        B, c = meta.num_seqs, self.ratio
        S = q.shape[0] // B
        q, k, v, iq, ik = (t.unflatten(0, (B, S)) for t in (q, k, v, iq, ik))
        cos, sin = meta.cos.unflatten(0, (B, S)), meta.sin.unflatten(0, (B, S))
        nb = S // c
        first = torch.arange(nb, device=q.device) * c
        raw = ik[:, : nb * c].unflatten(1, (nb, c)).flatten(0, 1)  # [B*nb, c, Di]
        blocks = self.indexer.block_keys(raw, cos[:, first].flatten(0, 1), sin[:, first].flatten(0, 1))
        blocks = blocks.unflatten(0, (B, nb))  # [B, nb, Di]
        pos = torch.arange(S, device=q.device)
        allowed = (pos[None, :] <= pos[:, None]).expand(B, S, S)  # [B, Sq, Sk] causal
        num_blocks = torch.div(pos + 1, c, rounding_mode="floor")
        sparse = num_blocks > self.block_budget
        if bool(sparse.any()):
            scores = self.indexer.scores(iq[:, sparse], blocks)  # [B, Ts, nb]
            chosen = select_blocks(scores, num_blocks[sparse], self.block_budget).repeat_interleave(c, dim=-1)
            sel = torch.zeros(B, chosen.shape[1], S, dtype=torch.bool, device=q.device)
            sel[..., : chosen.shape[-1]] = chosen
            tail = pos[None, :] >= (num_blocks[sparse] * c)[:, None]  # [Ts, S]
            allowed = allowed.clone()
            allowed[:, sparse] = allowed[:, sparse] & (sel | tail)
        rep = self.num_heads // self.num_kv_heads
        kk, vv = (t.repeat_interleave(rep, dim=2).float() for t in (k, v))  # [B, S, H, D]
        logits = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk) / math.sqrt(self.head_dim)
        probs = torch.softmax(logits.masked_fill(~allowed[:, None], float("-inf")), dim=-1)
        out = torch.einsum("bhqk,bkhd->bqhd", probs, vv).to(q.dtype)
        for b, _, _, seq in meta.seq_slices():
            seq.layers[self.state_key] = QSAState(k=k[b], v=v[b], index_keys=ik[b], block_keys=blocks[b],
                                                  block_cos=cos[b], block_sin=sin[b])
        return out.flatten(0, 1)

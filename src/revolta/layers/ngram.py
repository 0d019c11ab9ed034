"""PLE / Engram n-gram embedding (spec/model.md §5): hashed bigram/trigram rows gated into
every HyperConnection stream, plus a dilated causal conv.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import TextConfig
from ..forward import ForwardMeta, PLERecord
from ..kernels.conv1d import causal_conv1d_ref
from ..kernels.ple_rows import new_histories, ngram_contexts
from ..ple.ngram_host import row_ids
from ..ple.table import PLETable, StagedRows
from ..state import PLEState
from .norm import ZCRMSNorm

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def splitmix64(value: int) -> int:
    """One SplitMix64 output for state `value` (64-bit wrap-around arithmetic)."""
    z = (value + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def hash_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """Odd multipliers m_0..m_{n-1}, small enough that id * m fits in int64 (spec §5.2)."""
    half = max(1, ((2**63 - 1) // max(vocab_size, 1)) // 2)
    base = seed + 10007 * ple_index
    return [2 * (splitmix64((base + _GOLDEN * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)]


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def head_table_sizes(base: int, num_heads: int, ple_index: int) -> list[int]:
    """Successive primes >= base; PLE layer `ple_index` continues where the previous one stopped."""
    primes, p = [], base - 1
    while len(primes) < (ple_index + 1) * num_heads:
        p += 1
        while not _is_prime(p):
            p += 1
        primes.append(p)
    return primes[ple_index * num_heads :]


def ngram_context(ids: list[int], history: list[int], eos: int, order: int) -> list[list[int]]:
    """c_k for k = 0..order-1 at every new position (spec §5.3).

    ids: the new raw token ids; history: the previous order-1 ids (oldest first, EOS-filled at
    sequence start). c_k = id_{t-k} unless an EOS occurs at t-k..t-1, else EOS.
    """
    seq = history + ids
    out = []
    for t in range(len(history), len(seq)):
        ctx, broken = [seq[t]], False
        for k in range(1, order):
            broken = broken or seq[t - k] == eos  # EOS at t-k..t-1 cuts everything before it
            ctx.append(eos if broken else seq[t - k])
        out.append(ctx)
    return out


class NGramEmbedding(nn.Module):
    """The hashed table and its int64 buffers.

    By default the table is one [rows, head_dim] weight (`ngram_embedding`; on disk split into shards).
    With the table off the device or in FP8 (ple/load.py) that weight is removed and `table` holds a
    ple.table.PLETable (device or pinned host memory) or StagedRows (rows gathered by the PLE worker).
    """

    def __init__(self, cfg: TextConfig, ple_index: int):
        super().__init__()
        self.num_heads, self.heads_per_ngram, self.order = cfg.num_ngram_heads, cfg.heads_per_ngram, cfg.ngram_size
        self.sizes = head_table_sizes(cfg.ngram_vocab_size_base, self.num_heads, ple_index)
        self.multipliers = hash_multipliers(cfg.vocab_size, self.order, ple_index, cfg.seed)
        div = cfg.make_ngram_vocab_size_divisible_by
        rows = math.ceil(sum(self.sizes) / div) * div
        if rows % cfg.split_ngram_parts:
            raise ValueError(f"split_ngram_parts={cfg.split_ngram_parts} does not divide the n-gram table's {rows} "
                             "rows; the on-disk shards must be equal")
        self.num_rows, self.head_dim = rows, cfg.ngram_head_dim
        self.register_buffer("layer_multipliers", torch.zeros(self.order, dtype=torch.int64))
        self.register_buffer("ngram_heads_vocab_sizes", torch.zeros(self.num_heads, dtype=torch.int64))
        self.register_buffer("ngram_heads_offsets", torch.zeros(self.num_heads, dtype=torch.int64))
        self.init_buffers()
        self.ngram_embedding = nn.Embedding(rows, cfg.ngram_head_dim)
        self.table: PLETable | StagedRows | None = None

    def init_buffers(self) -> None:
        """Derive the int64 hash buffers from the config (a checkpoint that ships them overwrites them)."""
        if self.layer_multipliers.device.type == "meta":
            return
        offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.layer_multipliers.copy_(torch.tensor(self.multipliers, dtype=torch.int64))
        self.ngram_heads_vocab_sizes.copy_(torch.tensor(self.sizes, dtype=torch.int64))
        self.ngram_heads_offsets.copy_(torch.tensor(offsets, dtype=torch.int64))

    def attach_table(self, table: PLETable | StagedRows | None) -> None:
        """Look rows up in `table` from now on; the weight goes (ple/load.py loads the table instead;
        None: drop the weight now, the table follows once loaded)."""
        if "ngram_embedding" in self._modules:
            del self.ngram_embedding
        self.table = table

    def rows(self, contexts: Tensor) -> Tensor:
        """contexts: [T, order] int64 (c_0, c_1, ...) -> row ids [T, num_heads], bigram heads first."""
        d = contexts.device
        return row_ids(contexts, self.layer_multipliers.to(d), self.ngram_heads_vocab_sizes.to(d),
                       self.ngram_heads_offsets.to(d), self.heads_per_ngram, torch.stack)

    def start_lookup(self, contexts: Tensor, dtype: torch.dtype, backend: str = "torch") -> Callable[[], Tensor]:
        """Begin looking up [T, order] contexts; the returned function gives the rows [T, num_heads * head_dim]
        in `dtype` (a host table's read may still be running on a side stream until it is called)."""
        if isinstance(self.table, StagedRows):
            return self.table.start(contexts.shape[0], dtype)
        return self.start_rows(self.rows(contexts), dtype, backend)

    def start_rows(self, rows: Tensor, dtype: torch.dtype, backend: str = "torch") -> Callable[[], Tensor]:
        """`start_lookup` from the row ids [T, num_heads] (`rows`) instead of the contexts."""
        if isinstance(self.table, StagedRows):  # the PLE worker computed the same ids on the host
            return self.table.start(rows.shape[0], dtype)
        if self.table is not None:
            return self.table.start(rows, dtype, backend)
        weight = self.ngram_embedding.weight
        out = F.embedding(rows.to(weight.device), weight).flatten(-2).to(dtype)
        return lambda: out

    def forward(self, contexts: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """[T, order] contexts -> [T, num_heads * head_dim] concatenated rows in `dtype` (default: the
        weight's dtype; fp32 for a table held elsewhere)."""
        if dtype is None:
            dtype = self.ngram_embedding.weight.dtype if self.table is None else torch.float32
        return self.start_lookup(contexts, dtype)()


@dataclass
class _Lookup:
    """A started n-gram lookup: the carried contexts [B, n-1], its rows to come, and the step's ids [T] whose
    new contexts the layer stores (None: stored already, or a verify step, which stores nothing)."""

    history: Tensor
    rows: Callable[[], Tensor]
    ids: Tensor | None


class PLELayer(nn.Module):
    """Adds gated n-gram values and their dilated conv to the wide residual entering its layer."""

    def __init__(self, cfg: TextConfig, layer_idx: int, ple_index: int):
        super().__init__()
        self.state_key, self.layer_idx = f"ple{layer_idx}", layer_idx
        self.hc_count, self.hidden_size, self.eos = cfg.hc_count, cfg.hidden_size, cfg.eos_token_id
        self.order, self.dilation = cfg.ngram_size, cfg.ngram_size
        wide = cfg.wide_size
        self.ple_embedding = NGramEmbedding(cfg, ple_index)
        self.key_proj = nn.Linear(cfg.ple_embed_dim, wide, bias=False)
        self.value_proj = nn.Linear(cfg.ple_embed_dim, cfg.hidden_size, bias=False)
        self.norm_key = ZCRMSNorm(wide, cfg.rms_norm_eps, group_size=cfg.hidden_size)
        self.norm_query = ZCRMSNorm(wide, cfg.rms_norm_eps, group_size=cfg.hidden_size)
        self.norm_conv = ZCRMSNorm(wide, cfg.rms_norm_eps, group_size=cfg.hidden_size)
        self.conv1d = nn.Conv1d(wide, wide, cfg.ple_conv_kernel_size, groups=wide, dilation=self.dilation,
                                bias=False)
        self.history = (cfg.ple_conv_kernel_size - 1) * self.dilation

    def new_state(self, x: Tensor) -> PLEState:
        return PLEState(conv=x.new_zeros(self.history, x.shape[-1]), context=[self.eos] * (self.order - 1))

    def prefetch(self, meta: ForwardMeta, dtype: torch.dtype) -> None:
        """Start this layer's lookup before the trunk runs (the rows depend on the ids alone), so a host
        table's read overlaps the layers before this one. Paged steps only; `forward` picks it up."""
        if meta.paged is not None:
            meta.ple_lookups[self.state_key] = self._start_lookup(None, meta, dtype)

    def _start_lookup(self, x: Tensor | None, meta: ForwardMeta, dtype: torch.dtype) -> _Lookup:
        pm, emb = meta.paged, self.ple_embedding
        if pm is not None:  # row ids and the new contexts' store in one op (kernels/ple_rows.py)
            verify = pm.spec
            hist = None if verify is None else verify.record_buffer(
                f"{self.state_key}.history", (pm.slots.shape[0], self.order - 1), torch.int64, meta.input_ids.device)
            rows, history = pm.ops.ple_rows(
                meta.input_ids, pm.cu_seqlens, pm.storage.ple[self.layer_idx].context_ids, pm.slots,
                pm.has_initial_state, emb.layer_multipliers, emb.ngram_heads_vocab_sizes, emb.ngram_heads_offsets,
                emb.heads_per_ngram, self.eos, pm.max_new_tokens, store=verify is None, history_out=hist)
            return _Lookup(history, emb.start_rows(rows, dtype, pm.ops.backend), None)
        ids = meta.input_ids.long()
        seq_index, local_index = self._token_layout(meta, ids.device)
        history = self._histories(x, meta)  # [B, n-1] last ids of each sequence before this step
        contexts = ngram_contexts(ids, history, seq_index, local_index, self.eos)  # [T, n]
        return _Lookup(history, emb.start_lookup(contexts, dtype), ids)

    def forward(self, x: Tensor, meta: ForwardMeta) -> Tensor:
        """x: [T, h*d] wide residual entering the layer -> delta [T, h*d] to add to it."""
        lookup = meta.ple_lookups.pop(self.state_key, None) or self._start_lookup(x, meta, x.dtype)
        history = lookup.history
        verify = meta.paged.spec if meta.paged is not None else None
        if lookup.ids is not None:
            self._store_histories(meta, self._new_histories(lookup.ids, history, meta))
        emb = lookup.rows().to(x.dtype)
        h, d = self.hc_count, self.hidden_size
        ops = meta.paged.ops if meta.paged is not None else None  # the norms' kernel on the Triton path
        key = self.norm_key(self.key_proj(emb), ops).unflatten(-1, (h, d))  # [T, h, d]
        value = self.value_proj(emb)  # [T, d], shared by all branches
        query = self.norm_query(x, ops).unflatten(-1, (h, d))
        score = (key * query).sum(-1, keepdim=True) / math.sqrt(d)  # [T, h, 1]
        score = score.sign() * score.abs().clamp_min(1e-6).sqrt()  # signed square root
        gated = (torch.sigmoid(score) * value.unsqueeze(-2)).flatten(-2)  # [T, h*d]
        conv_in = self.norm_conv(gated, ops)
        conv_w = self.conv1d.weight[:, 0, :]
        pm = meta.paged
        if pm is not None:
            # a verify step only reads the window; spec/commit.py advances it by the accepted rows, from the
            # inputs the conv keeps in the record's storage
            kept = None if verify is None else \
                verify.record_buffer(f"{self.state_key}.conv_in", conv_in.shape, conv_in.dtype, conv_in.device)
            conv_out = pm.ops.causal_conv1d_varlen(conv_in, conv_w, pm.storage.ple[self.layer_idx].conv, pm.slots,
                                                   pm.cu_seqlens, pm.has_initial_state, activation="silu",
                                                   dilation=self.dilation, write_state=verify is None, x_copy=kept)
            if verify is not None:  # history: the record's buffer already (_start_lookup)
                verify.record[self.state_key] = PLERecord(self.layer_idx, kept, history)
            return gated + conv_out
        conv_out = torch.empty_like(gated)
        for _, start, end, seq in meta.seq_slices():
            st = seq.layers[self.state_key]
            y, st.conv = causal_conv1d_ref(conv_in[start:end], conv_w, st.conv, self.dilation)
            conv_out[start:end] = F.silu(y).to(x.dtype)
        return gated + conv_out

    # the simple (non-paged) path: per-sequence state in SequenceState, host cu_seqlens (the paged path's
    # equivalents are in kernels/ple_rows.py: token_layout, carried_histories, new_histories)
    @staticmethod
    def _token_layout(meta: ForwardMeta, device) -> tuple[Tensor, Tensor]:
        """[T] sequence index and in-step index of every token, from the host cu_seqlens."""
        T, cu = meta.input_ids.shape[0], meta.cu_seqlens
        lens = torch.tensor([cu[b + 1] - cu[b] for b in range(len(cu) - 1)], device=device)
        seq_index = torch.repeat_interleave(torch.arange(len(lens), device=device), lens)
        starts = torch.tensor(cu[:-1], device=device)
        return seq_index, torch.arange(T, device=device) - starts[seq_index]

    def _histories(self, x: Tensor, meta: ForwardMeta) -> Tensor:
        """[B, n-1] n-gram context carried into this step (EOS-filled at sequence start); a new sequence's
        state is made from x, the wide residual."""
        out = []
        for _, _, _, seq in meta.seq_slices():
            if self.state_key not in seq.layers:
                seq.layers[self.state_key] = self.new_state(x)
            out.append(seq.layers[self.state_key].context)
        return torch.tensor(out, dtype=torch.long, device=x.device).view(len(out), self.order - 1)

    def _new_histories(self, ids: Tensor, history: Tensor, meta: ForwardMeta) -> Tensor:
        """[B, n-1]: the last n-1 ids of each sequence after this step (history, then this step's ids)."""
        return new_histories(ids, history, torch.tensor(meta.cu_seqlens, device=ids.device))

    def _store_histories(self, meta: ForwardMeta, histories: Tensor) -> None:
        for (_, _, _, seq), hist in zip(meta.seq_slices(), histories.tolist()):
            seq.layers[self.state_key].context = hist

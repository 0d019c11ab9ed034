"""Test helpers for the cache: a tiny config, a minimal request, and a toy model + scheduler that
drive HybridAllocator and CacheStorage end to end on CPU (outputs must not depend on cache hits)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from revolta.cache.capacity import CacheLayout
from revolta.cache.hybrid import Allocation, HybridAllocator
from revolta.cache.storage import CacheStorage
from revolta.config import ModelConfig
from tiny_configs import F, L, T4_TEXT  # tests/parity, on sys.path via tests/conftest.py

TINY_TEXT = dict(T4_TEXT, mtp_num_hidden_layers=1)


def tiny_config() -> ModelConfig:
    return ModelConfig.from_dict(dict(model_type="qwen4_exp", architectures=["Qwen4ExpForConditionalGeneration"],
                                      text_config=dict(TINY_TEXT)))


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int = 0
    max_tokens: int = 0
    num_computed: int = 0  # the scheduler's mirror of the allocator's count

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.all_token_ids)
        self.prompt = list(self.all_token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def done(self) -> bool:
        return len(self.output_ids) >= self.max_tokens


@dataclass
class ToyModel:
    """One recurrent state (GDN layer 0's ssm_state) and one K cache (the QSA layer's), updated per
    token in a fixed order, so equal cache contents give bitwise-equal outputs."""

    cfg: ModelConfig
    vocab: int = 97

    def __post_init__(self) -> None:
        t = self.cfg.text
        self.gdn_layer = next(i for i, x in enumerate(t.layer_types) if x == L)
        self.qsa_layer = next(i for i, x in enumerate(t.layer_types) if x == F)

    def emb(self, x: int, shape) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        return torch.sin(torch.arange(n, dtype=torch.float32) * ((x + 1) * 0.001)).view(shape)

    def next_token(self, x: int, out: float) -> int:
        h = int(abs(out) * 1000)
        return (x * 7 + 3) % self.vocab if h % 3 else h % self.vocab

    def forward(self, st: CacheStorage, a: Allocation, block_ids, tokens: list[int], drafts: list[int]) -> list[int]:
        """Compute positions [c, c + n + k); return the greedy token after each position."""
        bs = st.layout.block_size
        ssm = st.gdn[self.gdn_layer].ssm_state
        kc = st.qsa[self.qsa_layer].k_cache
        flat = kc.view(-1, *kc.shape[2:])
        state = ssm[a.state_slot].clone()
        c, n = a.num_computed_tokens, a.num_new_tokens
        seq = tokens[c:c + n] + drafts
        outs = []
        for j, x in enumerate(seq):
            p = c + j
            state = state * 0.5 + self.emb(x, state.shape)
            flat[block_ids[p // bs] * bs + p % bs] = torch.cos(
                torch.arange(flat[0].numel(), dtype=torch.float32) * ((x + 3 * p + 1) * 0.01)).view(flat.shape[1:])
            addrs = torch.tensor([block_ids[q // bs] * bs + q % bs for q in range(p + 1)])
            out = float(state.sum()) + float(flat[addrs].float().sum(dim=(1, 2)).sum())
            outs.append(self.next_token(x, out))
            if j == n - 1:
                ssm[a.state_slot] = state
            elif j >= n:
                ssm[a.draft_slots[j - n]] = state
        return outs


def run_requests(cfg: ModelConfig, allocator: HybridAllocator, storage: CacheStorage, reqs: list[Req], *,
                 chunk: int = 8, num_drafts: int = 0, max_running: int = 4, cpu: CacheStorage | None = None,
                 check: bool = True, max_steps: int = 5000) -> dict[str, list[int]]:
    """A minimal scheduler: chunked prefill, greedy decode with toy drafts verified against the toy
    model, preemption by recompute (newest running first) when the allocator says None."""
    model = ToyModel(cfg)
    waiting, running = deque(reqs), []
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not waiting and not running:
            return outputs
        while waiting and len(running) < max_running:
            running.append(waiting.popleft())
        batch: list[tuple[Req, Allocation, list[int]]] = []
        for r in list(running):
            if r not in running:
                continue
            prefill = r.num_computed < len(r.all_token_ids) - 1
            n = len(r.all_token_ids) - r.num_computed if prefill else 1
            n = min(n, chunk) if prefill else n
            drafts = [] if prefill else _draft(model, r, num_drafts)
            a = allocator.allocate(r, n, len(drafts))
            while a is None:
                victims = [v for v in running if v is not r]
                if not victims:
                    break
                v = victims[-1]
                allocator.preempt(v)
                running.remove(v)
                batch = [b for b in batch if b[0] is not v]
                v.num_computed = 0
                waiting.appendleft(v)
                a = allocator.allocate(r, n, len(drafts))
            if a is None:
                running.remove(r)
                waiting.appendleft(r)
                continue
            r.num_computed += a.num_cached_tokens
            batch.append((r, a, drafts))
        storage.pre_forward([a for _, a, _ in batch], allocator.take_swap_outs(), cpu)
        results = [model.forward(storage, a, allocator.block_ids(r), r.all_token_ids, d) for r, a, d in batch]
        storage.post_forward([a for _, a, _ in batch])
        for (r, a, drafts), outs in zip(batch, results):
            r.num_computed += a.num_new_tokens
            accepted = 0
            if r.num_computed == len(r.all_token_ids):  # reached the end: sample
                n = a.num_new_tokens
                while accepted < len(drafts) and drafts[accepted] == outs[n - 1 + accepted]:
                    accepted += 1
                new = drafts[:accepted] + [outs[n - 1 + accepted]]
                r.num_computed += accepted
                r.all_token_ids += new[: r.max_tokens - len(r.output_ids)]
            allocator.commit(r, accepted)
            if r.done:
                outputs[r.request_id] = r.output_ids
                allocator.free(r)
                running.remove(r)
            if check:
                allocator.check()
    raise AssertionError("requests did not finish")


def _draft(model: ToyModel, r: Req, k: int) -> list[int]:
    out, x = [], r.all_token_ids[-1]
    for j in range(min(k, r.max_tokens - len(r.output_ids) - 1)):
        x = (x * 7 + 3) % model.vocab if (x + j) % 4 else (x + 1) % model.vocab
        out.append(x)
    return out


def layout(num_blocks: int, num_slots: int, block_size: int = 4, **kw) -> CacheLayout:
    base = dict(num_blocks=num_blocks, block_size=block_size, num_slots=num_slots, kv_cache_dtype="fp16",
                draft_kv_cache_dtype="fp16", dtype="float32")
    base.update(kw)
    return CacheLayout(**base)


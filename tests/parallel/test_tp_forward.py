"""TP on real processes (gloo, fp32): every rank of a TP2 / TP4 split of the tiny model gives the TP1 logits,
for a full-sequence forward and for an incremental prefill + decode with per-sequence state."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tiny_configs import T4_TEXT  # tests/parity, on sys.path via tests/conftest.py
from revolta.config import ModelConfig
from revolta.model import FlashNextModel, init_random_weights
from revolta.parallel import ParallelConfig, ParallelContext
from revolta.parallel.shard import build_rank_model, load_rank_weights
from revolta.state import SequenceState
from tp_run import COLLECTIVE_TIMEOUT, run_ranks

B, S, PREFILL = 2, 16, 14  # S, PREFILL > the tiny config's QSA sparse onset (11): sparse selection is exercised


def tiny(**text) -> ModelConfig:
    return ModelConfig.from_dict(dict(model_type="qwen4_exp", architectures=["Qwen4ExpForConditionalGeneration"],
                                      text_config=dict(T4_TEXT, mtp_num_hidden_layers=1, **text)))


def full_model(cfg: ModelConfig) -> FlashNextModel:
    model = FlashNextModel(cfg, with_vision=False)
    init_random_weights(model, seed=0)
    return model.eval()


@torch.no_grad()
def logits_of(model: FlashNextModel, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Full-sequence logits [B, S, V], and the flat incremental path: a prefill of PREFILL tokens per sequence,
    then one token at a time, with states -> [B, S - PREFILL + 1, V] (the prefill's last row, then each step)."""
    full = model(ids)
    states = [SequenceState() for _ in range(B)]
    flat = ids[:, :PREFILL].reshape(-1)
    cu = [b * PREFILL for b in range(B + 1)]
    rows = [model(flat, cu_seqlens=cu, states=states, logits_indices=torch.tensor(cu[1:]) - 1)]
    for p in range(PREFILL, S):
        rows.append(model(ids[:, p], cu_seqlens=list(range(B + 1)), states=states))
    return {"full": full, "incremental": torch.stack(rows, dim=1)}


def _rank(rank: int, tp: int, group, cfg: ModelConfig, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    ctx = ParallelContext.from_group(group, timeout=COLLECTIVE_TIMEOUT)
    model = build_rank_model(cfg, ParallelConfig(tp), ctx, with_vision=False)
    model = load_rank_weights(model, full_model(cfg).state_dict(), rank, tp)
    return logits_of(model, ids)


def _check(cfg: ModelConfig, tp: int, tmp_path) -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.text.vocab_size, (B, S))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on loaded shared cores a tiny forward takes ~1 s with 2 threads, ~15 ms with one
    try:
        ref = logits_of(full_model(cfg), ids)
    finally:
        torch.set_num_threads(threads)
    for rank, got in enumerate(run_ranks(_rank, tp, tmp_path, cfg, ids)):
        for key, want in ref.items():
            err = (got[key] - want).abs().max().item() / want.abs().max().item()
            assert err < 1e-5, f"TP{tp} rank {rank} {key} logits differ from TP1 by {err:.2e} (relative to max)"
            assert torch.equal(got[key].argmax(-1), want.argmax(-1)), f"TP{tp} rank {rank} {key}: greedy tokens differ"


def test_tp2_equals_tp1(tmp_path):
    _check(tiny(), 2, tmp_path)


def test_tp4_equals_tp1_with_shared_kv_heads_and_padded_vocab(tmp_path):
    # 4 GDN key heads so TP4 divides them; 2 KV heads: each is shared by 2 ranks; 510 ids: 128 rows per rank,
    # the last rank's 2 padding rows
    _check(tiny(linear_num_key_heads=4, vocab_size=510, eos_token_id=509), 4, tmp_path)

"""TP on real processes (gloo, fp32): every rank of a TP2 / TP4 split of the tiny model, loaded from a
checkpoint through the sliced loader, gives the TP1 logits: a full-sequence forward, an incremental prefill +
decode with per-sequence state, an MTP draft step, and a chunked prefill + decode on the paged cache (ModelRunner,
torch kernels) with each rank's cache sized for its part (CacheLayout.tp). With DCP (TP2 + DCP2, TP4 + DCP2) the
paged trunk K/V of each rank is its stripe of every block (CacheLayout.dcp) and decode attention merges the ranks'
partial outputs: the same logits."""

from __future__ import annotations


import torch

from revolta.cache.capacity import CacheLayout
from revolta.cache.storage import CacheStorage
from revolta.config import ModelConfig
from revolta.engine.runner import ModelRunner, StepSequence
from revolta.model import FlashNextModel
from revolta.parallel import ParallelConfig, ParallelContext
from revolta.parallel.load import load_rank_checkpoint
from revolta.parallel.shard import build_rank_model
from revolta.state import SequenceState
from revolta.weights import save_checkpoint
from tp_run import COLLECTIVE_TIMEOUT, run_ranks
from tp_tiny import full_model, tiny

B, S, PREFILL = 2, 16, 14  # S, PREFILL > the tiny config's QSA sparse onset (11): sparse selection is exercised
CHUNK = 6  # the paged prefill runs as two chunks: the second attends the first's (striped, at DCP) K/V


@torch.no_grad()
def logits_of(model: FlashNextModel, ids: torch.Tensor, tp: int, dcp: int = 1) -> dict[str, torch.Tensor]:
    """Full-sequence logits [B, S, V], and the flat incremental path: a prefill of PREFILL tokens per sequence,
    then one token at a time, with states -> [B, S - PREFILL + 1, V] (the prefill's last row, then each step);
    the MTP step's logits [B * S, V]; and the same prefill + decode on the paged cache of one rank [B, S, V]."""
    full, wide = model(ids, return_hidden=True)
    # MTP: the draft step from every position's wide state and the token after it
    nxt = torch.cat([ids[:, 1:], ids[:, :1]], dim=1).reshape(-1)
    pos = torch.arange(S).repeat(B)[None].expand(3, -1)
    cu_full = [b * S for b in range(B + 1)]
    mtp, _ = model.mtp_forward(wide, nxt, pos, cu_full, [SequenceState() for _ in range(B)])
    states = [SequenceState() for _ in range(B)]
    flat = ids[:, :PREFILL].reshape(-1)
    cu = [b * PREFILL for b in range(B + 1)]
    rows = [model(flat, cu_seqlens=cu, states=states, logits_indices=torch.tensor(cu[1:]) - 1)]
    for p in range(PREFILL, S):
        rows.append(model(ids[:, p], cu_seqlens=list(range(B + 1)), states=states))
    return {"full": full, "incremental": torch.stack(rows, dim=1), "mtp": mtp,
            "paged": paged_logits(model, ids, tp, dcp)}


def paged_logits(model: FlashNextModel, ids: torch.Tensor, tp: int, dcp: int = 1) -> torch.Tensor:
    """A chunked prefill then decode through ModelRunner on a CacheStorage sized for one of `tp` ranks (and its
    stripe of the trunk K/V at dcp > 1) -> [B, S, V]."""
    layout = CacheLayout(num_blocks=16, block_size=8, num_slots=B + 1, kv_cache_dtype="fp32",
                         draft_kv_cache_dtype="fp32", dtype="float32", tp=tp, dcp=dcp)
    storage = CacheStorage(model.cfg, layout)
    assert all(c.k_cache.shape[1] == 8 // dcp for c in storage.qsa.values())  # a stripe of each 8-token block
    runner = ModelRunner(model, storage, kernels="torch")
    blocks = [list(range(1 + 4 * b, 5 + 4 * b)) for b in range(B)]  # 4 pages of 8 tokens each
    rows = []
    for lo, hi in ((0, CHUNK), (CHUNK, PREFILL)):
        step = [StepSequence(ids[b, lo:hi].tolist(), lo, blocks[b], slot=b + 1) for b in range(B)]
        rows.append(runner.execute(step, all_logits=True).view(B, hi - lo, -1))
    for p in range(PREFILL, S):
        step = [StepSequence([int(ids[b, p])], p, blocks[b], slot=b + 1) for b in range(B)]
        rows.append(runner.execute(step)[:, None])
    return torch.cat(rows, dim=1)


def _rank(rank: int, tp: int, group, cfg: ModelConfig, ckpt: str, ids: torch.Tensor,
          dcp: int) -> dict[str, torch.Tensor]:
    ctx = ParallelContext.from_group(group, timeout=COLLECTIVE_TIMEOUT)
    model = build_rank_model(cfg, ParallelConfig(tp, dcp), ctx, with_vision=False)
    load_rank_checkpoint(model, ckpt, rank, tp)
    assert (type(model.model.language_model.layers[3].self_attn).__name__ == "DCPAttention") == (dcp > 1)
    return logits_of(model, ids, tp, dcp)


def _check(cfg: ModelConfig, tp: int, tmp_path, dcp: int = 1) -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.text.vocab_size, (B, S))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on loaded shared cores a tiny forward takes ~1 s with 2 threads, ~15 ms with one
    try:
        model = full_model(cfg)
        ref = logits_of(model, ids, 1)
        save_checkpoint(model, tmp_path / "ckpt", progress=False)
    finally:
        torch.set_num_threads(threads)
    for rank, got in enumerate(run_ranks(_rank, tp, tmp_path, cfg, str(tmp_path / "ckpt"), ids, dcp)):
        for key, want in ref.items():
            err = (got[key] - want).abs().max().item() / want.abs().max().item()
            what = f"TP{tp} DCP{dcp} rank {rank} {key}"
            assert err < 1e-5, f"{what} logits differ from TP1 by {err:.2e} (relative to max)"
            assert torch.equal(got[key].argmax(-1), want.argmax(-1)), f"{what}: greedy tokens differ"


def test_tp2_equals_tp1(tmp_path):
    _check(tiny(), 2, tmp_path)


def test_tp4_equals_tp1_with_shared_kv_heads_and_padded_vocab(tmp_path):
    # 4 GDN key heads so TP4 divides them; 2 KV heads: each is shared by 2 ranks; 510 ids: 128 rows per rank,
    # the last rank's 2 padding rows
    _check(tiny(linear_num_key_heads=4, vocab_size=510, eos_token_id=509), 4, tmp_path)


def test_tp2_dcp2_equals_tp1(tmp_path):
    # one KV head: both ranks share it, and DCP2 splits its tokens between them
    _check(tiny(num_key_value_heads=1), 2, tmp_path, dcp=2)


def test_tp4_dcp2_equals_tp1(tmp_path):
    # 2 KV heads at TP4: ranks {0, 1} share head 0, {2, 3} head 1; each pair is a DCP group
    _check(tiny(linear_num_key_heads=4), 4, tmp_path, dcp=2)

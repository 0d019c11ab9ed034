"""Sharded loading: each rank reads only its slices of the memory-mapped checkpoint, each once, and gets
exactly the tensors that slicing the full state dict gives (grouped and per-expert keys, several files)."""

from __future__ import annotations

import pytest
import torch

from revolta.parallel import ParallelConfig, ParallelContext
from revolta.parallel.load import load_rank_checkpoint
from revolta.parallel.shard import build_rank_model, shard_state_dict, tensor_slices
from revolta.weights import save_checkpoint
from tp_tiny import full_model, tiny

NO_GROUP = object()  # loading runs no collective


def _split_experts(sd: dict, prefix: str) -> dict:
    """The per-expert on-disk layout (`experts.{e}.{gate,up,down}_proj.weight`) for one layer's experts."""
    sd = dict(sd)
    gate_up, down = sd.pop(prefix + "gate_up_proj"), sd.pop(prefix + "down_proj")
    inter = down.shape[-1]
    for e in range(gate_up.shape[0]):
        sd[f"{prefix}{e}.gate_proj.weight"] = gate_up[e, :inter].clone()
        sd[f"{prefix}{e}.up_proj.weight"] = gate_up[e, inter:].clone()
        sd[f"{prefix}{e}.down_proj.weight"] = down[e].clone()
    return sd


def _expected_bytes(full: dict, cfg, rank: int, tp: int) -> int:
    """Bytes of the rank's part of every tensor: a split tensor's ranges (no padding), a replicated one whole."""
    total = 0
    for name, x in full.items():
        sl = tensor_slices(name, cfg.text, rank, tp)
        if sl is None:
            total += x.numel() * x.element_size()
        else:
            total += x.numel() // x.shape[sl.dim] * sum(e - s for s, e in sl.ranges) * x.element_size()
    return total


@pytest.mark.parametrize("tp,text", [(2, {}), (4, dict(linear_num_key_heads=4, vocab_size=510, eos_token_id=509))])
def test_each_rank_reads_its_slices_once(tmp_path, tp, text):
    cfg = tiny(**text)
    full = full_model(cfg).state_dict()
    disk = _split_experts(full, "model.language_model.layers.0.mlp.experts.")
    save_checkpoint(disk, tmp_path, max_shard_bytes=200_000, split_ngram_parts=1, progress=False)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    checkpoint_bytes = sum(x.numel() * x.element_size() for x in full.values())
    for rank in range(tp):
        model = build_rank_model(cfg, ParallelConfig(tp), ParallelContext(rank, tp, NO_GROUP), with_vision=False)
        stats = load_rank_checkpoint(model, tmp_path, rank, tp)
        want = shard_state_dict(full, cfg, rank, tp)
        got = model.state_dict()
        assert sorted(got) == sorted(want)
        for name in want:
            assert torch.equal(got[name], want[name]), f"rank {rank}/{tp}: {name} differs from its slice"
        assert stats.bytes_read == _expected_bytes(full, cfg, rank, tp)
        assert stats.bytes_read < checkpoint_bytes

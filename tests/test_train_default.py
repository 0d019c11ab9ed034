"""CPU smoke test of `revolta train-default` (presets/train_*.py): data recipe, training, resume, export, reload."""

from __future__ import annotations

import torch

from revolta.presets.train_data import EOS_ID, DataConfig, batches, is_heldout, load_token_data, stdlib_files
from revolta.presets.train_export import (TOTAL_LIMIT, export, load_target_state, read_shards, target_state,
                                          unpack)
from revolta.presets.train_loop import LoopConfig, evaluate, train
from revolta.presets.train_model import TrainNet, trained_config

KEPT = torch.tensor(sorted({EOS_ID, *range(100, 140)}))


def _rows(n: int = 24, seq: int = 32) -> torch.Tensor:
    """Learnable rows: a fixed cycle of 40 token ids, each row starting at a different offset."""
    cycle = torch.arange(100, 140)
    return torch.stack([cycle[(torch.arange(seq) + 7 * i) % 40] for i in range(n)])


class _Tok:
    def encode_batch(self, texts):
        return [[100 + len(line) % 40 for line in t.splitlines()] for t in texts]


def test_data_recipe_is_deterministic_split_by_path_and_packs_eos(tmp_path):
    for name in ["b.py", "a.py", "pkg/c.py", "test/skip.py", "pkg/tests/skip.py"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n" * 40)
    files = [rel for rel, _ in stdlib_files(DataConfig(root=str(tmp_path)))]
    assert files == ["a.py", "b.py", "pkg/c.py"]  # sorted, test directories skipped
    with_tests = [rel for rel, _ in stdlib_files(DataConfig(root=str(tmp_path), include_tests=True))]
    assert with_tests == ["a.py", "b.py", "pkg/c.py", "pkg/tests/skip.py", "test/skip.py"]
    held = [rel for rel in files if is_heldout(rel, 500)]
    assert 0 < len(held) < len(files)  # sha256 of the path: a fixed split of these three names
    data = load_token_data(DataConfig(root=str(tmp_path), seq_len=9, heldout_permille=500), _Tok())
    assert data.files == {"train": len(files) - len(held), "heldout": len(held)}
    doc = [100 + len("x = 1") % 40] * 40 + [EOS_ID]  # one file's tokens, then EOS
    flat = doc * len(held)
    assert data.heldout.flatten().tolist() == flat[: len(flat) // 9 * 9]
    run = [b for _, (_, b) in zip(range(8), batches(_rows(), 4, seed=3))]
    resumed = [b for _, (_, b) in zip(range(3), batches(_rows(), 4, seed=3, start_step=5))]
    assert all(torch.equal(a, b) for a, b in zip(run[5:], resumed))  # resume sees the batches it would have
    assert not torch.equal(run[0], run[6])  # a new permutation per epoch (6 batches an epoch)


def _net(seed: int = 0) -> TrainNet:
    return TrainNet(trained_config("tiny"), KEPT, seed=seed)


def test_training_lowers_the_loss_and_resume_continues(tmp_path):
    rows = _rows()
    torch.manual_seed(0)
    net = _net()
    assert trained_config("tiny").text.qsa_sparse_onset < rows.shape[1]  # the sparse QSA path is trained too
    before = evaluate(net, rows[:4])
    cfg = LoopConfig(batch_size=4, lr=1e-2, warmup_steps=1, schedule_s=1e9, time_budget_s=1e9, max_steps=12,
                     log_every_s=0.0, eval_every_s=0.0)
    out = train(net, rows, cfg, tmp_path / "ckpt", log=lambda _: None, heldout=rows[:2])
    after = evaluate(net, rows[:4])
    assert out["step"] == 12 and len(out["history"]) == 12
    assert out["history"][0]["heldout_ce"] > out["history"][-1]["heldout_ce"]  # evaluated along the way
    assert after["heldout_ce"] < before["heldout_ce"] - 0.5, (before, after)
    assert after["heldout_mtp_ce"] < before["heldout_mtp_ce"] - 0.3, (before, after)

    resumed = _net(seed=1)  # different init: the checkpoint must overwrite it
    lines = []
    out2 = train(resumed, rows, LoopConfig(**{**cfg.__dict__, "max_steps": 14}), tmp_path / "ckpt2",
                 resume=tmp_path / "ckpt", log=lines.append)
    assert lines[0].startswith("resumed at step 12")
    assert out2["step"] == 14 and [r["step"] for r in out2["history"]][-2:] == [12, 13]


def test_batched_rows_equal_one_by_one():
    """The training path runs GDN and QSA over the [B, S] batch at once (ForwardMeta.uniform_fresh): same logits."""
    torch.manual_seed(0)
    net = _net()
    ids = KEPT[torch.randint(0, KEPT.numel(), (3, 40))]  # past the sparse onset (19)
    with torch.no_grad():
        out = {}
        for batched in (False, True):
            net.batched = batched
            wide = net.trunk(ids)
            out[batched] = (net.logits(wide), net.mtp_logits(wide, ids))
    for a, b in zip(out[False], out[True]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_drafter_trains_on_the_frozen_target():
    from revolta.presets.train_drafter import DrafterConfig, drafter_export_state, train_drafter

    torch.manual_seed(0)
    net = _net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    cfg = DrafterConfig(batch_size=2, anchors_per_row=4, max_steps=2, log_every_s=1e9)
    trainer, metrics = train_drafter(net, _rows(8), _rows(2), cfg, log=lambda _: None)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())  # the target stays frozen
    moved = [n for n, p in trainer.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0]
    assert "mask_embedding" in moved and any(n.startswith("model.fc") for n in moved)
    assert 0.0 <= metrics["mean_accepted_length"] <= trainer.model.cfg.block_size - 1
    state = drafter_export_state(trainer, net)
    assert state["candidate_selector.successor_codebook.weight"].shape[0] == KEPT.numel()


def test_export_is_small_and_reloads_to_identical_logits(tmp_path):
    torch.manual_seed(0)
    net = _net()
    with torch.no_grad():  # bf16-representable values: a 16-bit export must then reload exactly
        for p in net.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    ids = _rows(2)
    for int8 in (False, True):
        summary = export(tmp_path / str(int8), target_state(net), None, {"note": "test"}, int8=int8)
        assert summary["total_bytes"] < TOTAL_LIMIT and all(b < 16 << 20 for b in summary["files"].values())
        tensors = read_shards(tmp_path / str(int8) / "weights", "target")
        assert tensors["kept"].tolist() == KEPT.tolist()
        assert tensors["net.lm_head.weight"].shape[0] == KEPT.numel()
        reloaded = _net(seed=5)
        load_target_state(reloaded, unpack(tensors))
        with torch.no_grad():
            a, b = net.logits(net.trunk(ids)), reloaded.logits(reloaded.trunk(ids))
        if int8:
            assert summary["int8_tensors"]
            assert all(tensors[name].dtype == torch.int8 for name in summary["int8_tensors"])
            assert (a - b).abs().max() < 0.05 * a.abs().max()
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_kept_ids_count_floor_row_cap_and_specials():
    from revolta.presets.train_run import kept_ids

    rows = torch.tensor([[5, 5, 5, 7, 7, 9, 3, 3, 3, 3]])
    assert kept_ids(rows, 2, 100, (EOS_ID,)).tolist() == [3, 5, 7, EOS_ID]  # 9 is seen once
    assert kept_ids(rows, 1, 3, (EOS_ID,)).tolist() == [3, 5, EOS_ID]  # the two most frequent, plus EOS


def test_heldout_eval_rows_take_one_row_per_file_spread_over_the_files():
    """Metrics rows come one from each held-out file (not consecutive rows of one long file), deterministically."""
    from revolta.presets.train_data import TokenData, _middle_rows, _pack

    docs = [[1] * 3, [2] * 400, [3] * 5, [4] * 7]  # the second: one long file (e.g. a codec table)
    rows = _pack(docs, 8)  # each doc + EOS: starts 0, 4, 405, 411; 419 tokens -> 52 rows
    want = [(s + len(d) // 2) // 8 for s, d in zip([0, 4, 405, 411], docs)]
    assert _middle_rows(docs, 8, rows.shape[0]) == want == [0, 25, 50, 51]
    assert _middle_rows(docs, 8, 51) == [0, 25, 50]  # middles past the packed rows are dropped
    data = TokenData(train=rows, heldout=rows, files={}, num_tokens={}, seconds=0.0, heldout_file_rows=want)
    assert torch.equal(data.heldout_eval_rows(8), rows[[0, 25, 50, 51]])  # one row per file
    assert torch.equal(data.heldout_eval_rows(2), rows[[0, 51]])  # spread: the first and the last file
    assert torch.equal(data.heldout_eval_rows(0), rows)

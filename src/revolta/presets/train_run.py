"""`revolta train-default`: data -> target training -> drafter training -> held-out metrics -> export.

Everything lands in `--out DIR`: `weights/` (the export, see train_export.py), `ckpt/` (resumable training
state), `loss.csv` and `loss.png` (when matplotlib is importable), `metrics.json`. Progress lines go to stdout.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch

from .train_data import DataConfig, load_token_data
from .train_export import export, load_target_state, roundtrip, target_state
from .train_loop import LoopConfig, evaluate, set_precision, train
from .train_model import TrainNet, trained_config


def add_parser(sub) -> None:
    p = sub.add_parser("train-default", help="train the embedded default on the Python stdlib (see issue 25)",
                       description="Train a small Flash-Next and a DFlash2 drafter on the running interpreter's "
                                   "standard library; write compact weights, the loss curve and held-out metrics.")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--resume", metavar="DIR", help="an earlier run's checkpoint directory (its --ckpt-dir, by "
                   "default OUT/ckpt) to continue from")
    p.add_argument("--size", default="default", help="model size preset: default or tiny")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--time-budget-s", type=float, default=300.0, help="target training seconds in this call")
    p.add_argument("--schedule-s", type=float, default=None,
                   help="planned target training seconds over all calls (the cosine's length; default: the budget)")
    p.add_argument("--drafter-time-budget-s", type=float, default=120.0, help="drafter training seconds (0: none)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--max-files", type=int, default=None, help="use a prefix of the sorted file list (tests)")
    p.add_argument("--include-tests", action="store_true",
                   help="also train on the stdlib's test suites (about 2.5x the tokens; default: library code only)")
    p.add_argument("--min-token-count", type=int, default=2,
                   help="keep embedding / LM-head rows for tokens seen at least this often in training")
    p.add_argument("--max-kept-tokens", type=int, default=26000,
                   help="at most this many embedding / LM-head rows, the most frequent tokens (bounds the export: "
                        "26000 rows at the default size give ~25 MiB)")
    p.add_argument("--eval-rows", type=int, default=64,
                   help="held-out files to evaluate, one row from each, spread over the sorted files (0: every row)")
    p.add_argument("--no-int8", action="store_true", help="export 16-bit weights only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", default="tf32", choices=("tf32", "fp32", "bf16"),
                   help="tf32 (default): fp32 weights, TF32 matmuls on CUDA; bf16: autocast")
    p.add_argument("--ckpt-dir", metavar="DIR", help="where the resumable training state goes (default: OUT/ckpt; "
                   "it holds the optimizer state, ~0.3 GB at the default size)")
    p.add_argument("--log-every-s", type=float, default=20.0)


def kept_ids(train_rows: torch.Tensor, min_count: int, max_rows: int, always: tuple[int, ...]) -> torch.Tensor:
    """Sorted ids seen at least `min_count` times in training, at most the `max_rows` most frequent (ties: lower
    id first), plus `always` (EOS, the drafter's mask token). The row cap bounds the export's size."""
    ids, counts = torch.unique(train_rows, return_counts=True)  # ids ascending
    ids, counts = ids[counts >= min_count], counts[counts >= min_count]
    order = torch.sort(counts, descending=True, stable=True).indices[: max(max_rows - len(always), 0)]
    kept = set(ids[order].tolist()) | set(always)
    return torch.tensor(sorted(kept), dtype=torch.long)


def run(args: argparse.Namespace, log=print) -> dict:
    from ..tokenizer import Tokenizer
    from .default_drafter import DRAFTER_CONFIG

    torch.manual_seed(args.seed)
    set_precision(args.precision)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    t0 = time.perf_counter()
    tok = Tokenizer.from_qwen_ranks(Path(tempfile.gettempdir()) / "revolta-train-tokenizer")
    data = load_token_data(DataConfig(seq_len=args.seq_len, max_files=args.max_files,
                                      include_tests=args.include_tests), tok)
    log(f"data: {data.files} files, {data.num_tokens} tokens, tokenized in {data.seconds:.1f} s")
    cfg = trained_config(args.size)
    mask_id = DRAFTER_CONFIG["dflash_config"]["mask_token_id"]
    kept = kept_ids(data.train, args.min_token_count, args.max_kept_tokens, (cfg.text.eos_token_id, mask_id))
    net = TrainNet(cfg, kept, seed=args.seed).to(device)
    n_all = sum(p.numel() for p in net.parameters())
    n_tok = net.text.embed_tokens.weight.numel() + net.net.lm_head.weight.numel()
    log(f"model: {n_all / 1e6:.2f} M parameters, {(n_all - n_tok) / 1e6:.2f} M without the {kept.numel()}-row "
        f"embedding and LM head; device {device}")
    loop = LoopConfig(batch_size=args.batch_size, lr=args.lr, seed=args.seed, time_budget_s=args.time_budget_s,
                      schedule_s=args.schedule_s or args.time_budget_s, max_steps=args.max_steps,
                      log_every_s=args.log_every_s, precision=args.precision)
    heldout = data.heldout_eval_rows(args.eval_rows)  # one row per held-out file, spread over the files
    ckpt = Path(args.ckpt_dir) if args.ckpt_dir else out / "ckpt"
    result = train(net, data.train, loop, ckpt, Path(args.resume) if args.resume else None, log,
                   heldout=data.heldout_eval_rows(16))  # the best-weights pick: one row from each of 16 files
    metrics = {"target": evaluate(net, heldout, precision=args.precision)}
    log(f"held-out: {metrics['target']}")
    drafter_state = None
    if args.drafter_time_budget_s > 0:
        from .train_drafter import DrafterConfig, drafter_export_state, train_drafter

        dcfg = DrafterConfig(time_budget_s=args.drafter_time_budget_s, seed=args.seed,
                             log_every_s=args.log_every_s, precision=args.precision)
        try:  # a one-shot GPU run keeps its trained target even if the drafter stage fails
            drafter, dmetrics = train_drafter(net, data.train, heldout, dcfg, log)
            metrics["drafter"] = dmetrics
            drafter_state = drafter_export_state(drafter, net)
        except Exception as e:  # noqa: BLE001 - reported in metrics.json and the log, the target is still exported
            log(f"drafter training failed, exporting the target alone: {traceback.format_exc()}")
            metrics["drafter_error"] = repr(e)
    state = target_state(net)
    if not args.no_int8:  # what int8 costs, measured on the same held-out rows
        probe = TrainNet(cfg, kept).to(device)
        load_target_state(probe, {k: v.to(device) for k, v in roundtrip(state, True).items()})
        metrics["target_int8"] = evaluate(probe, heldout, precision=args.precision)
        log(f"held-out after int8 round trip: {metrics['target_int8']}")
    meta = {"config": cfg.to_dict(), "size": args.size, "kept_tokens": kept.numel(), "data": {
        "files": data.files, "tokens": data.num_tokens, "seq_len": args.seq_len, "recipe": DataConfig.__doc__
        or "see revolta.presets.train_data"}, "loop": asdict(loop), "steps": result["step"],
        "trained_s": result["trained_s"], "metrics": metrics}
    summary = export(out, state, drafter_state, meta, int8=not args.no_int8)
    metrics["export_bytes"] = summary["total_bytes"]
    write_curve(out, result["history"])
    metrics["wall_s"] = time.perf_counter() - t0
    # a fixed eval set for CI (this interpreter's stdlib may differ from the one that checks the weights)
    metrics["python"] = sys.version.split()[0]
    metrics["heldout_eval_ids"] = data.heldout_eval_rows(8).tolist()  # one row from each of 8 held-out files
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    log(f"exported {summary['total_bytes'] / 2**20:.1f} MiB to {out / 'weights'}; total {metrics['wall_s']:.0f} s")
    return {"metrics": metrics, "result": result, "net": net, "summary": summary}


def write_curve(out: Path, history: list[dict]) -> None:
    if not history:
        return
    with open(out / "loss.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(history[0]))
        w.writeheader()
        w.writerows(history)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key in ("ce", "mtp"):
        ax.plot([r["time_s"] for r in history], [r[key] for r in history], label=key)
    ax.set_xlabel("training seconds")
    ax.set_ylabel("cross entropy (nats)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=100)
    plt.close(fig)

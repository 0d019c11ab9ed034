"""Training loop of the trained default: AdamW, warmup + cosine on the planned time, clip, time budget, resume.

The schedule runs on the fraction of the planned training time spent (`schedule_s`), not on steps, because the
step rate of a machine is not known ahead: a chunked run (`--time-budget-s` per call, `--resume` the next) follows
the same curve as one long run. Training stops cleanly (a checkpoint is saved) when the chunk's budget or the
planned time is spent, or at `max_steps`.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .train_data import batches
from .train_model import TrainNet

CKPT = "train_state.pt"


@dataclass(frozen=True)
class LoopConfig:
    batch_size: int = 32
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    clip: float = 1.0
    mtp_weight: float = 0.3
    seed: int = 0
    schedule_s: float = 300.0  # planned training seconds over all chunks (the cosine's length)
    time_budget_s: float = 300.0  # this chunk's budget
    max_steps: int | None = None
    log_every_s: float = 20.0
    precision: str = "tf32"  # "tf32", "fp32" or "bf16" (autocast)
    eval_every_s: float = 60.0  # held-out CE this often (with `heldout` rows); the best weights are kept


def lr_at(cfg: LoopConfig, step: int, trained_s: float) -> float:
    warm = min(1.0, (step + 1) / max(cfg.warmup_steps, 1))
    frac = min(1.0, trained_s / cfg.schedule_s)
    cos = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
    return cfg.lr * warm * cos


def autocast(device: torch.device, precision: str = "tf32"):
    """"bf16": bf16 autocast (CUDA or CPU); "tf32" / "fp32": no autocast, fp32 weights and activations (on CUDA
    the matmuls use TF32 when `set_precision` allowed it). TF32 is the default: this model is bound by kernel
    launches, not FLOPs, and the GDN chunk reference keeps its delta-rule algebra in fp32 only without autocast."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def set_precision(precision: str) -> None:
    if precision not in ("tf32", "fp32", "bf16"):
        raise ValueError(f"precision={precision!r}; use tf32, fp32 or bf16")
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"


def make_optimizer(net: TrainNet, cfg: LoopConfig) -> torch.optim.AdamW:
    decay = [p for p in net.parameters() if p.dim() >= 2]
    rest = [p for p in net.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))


def save_state(path: Path, net: TrainNet, opt, step: int, trained_s: float, history: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"net": net.state_dict(), "opt": opt.state_dict(), "step": step, "trained_s": trained_s,
                "history": history}, tmp)
    tmp.replace(path)  # never a half-written checkpoint


def train(net: TrainNet, rows: torch.Tensor, cfg: LoopConfig, ckpt_dir: Path, resume: Path | None = None,
          log=print, heldout: torch.Tensor | None = None) -> dict:
    """Train `net` (already on its device) on rows [N, S]; returns {"step", "trained_s", "history", "stopped"}.

    history rows: {"step", "time_s", "lr", "ce", "mtp", "tokens_per_s", "heldout_ce"} at each log line
    (heldout_ce: NaN between evaluations). With `heldout` rows, the held-out CE is measured every `eval_every_s`
    and at the end; the weights with the lowest one are kept (a small model on ~3 M tokens can overfit).
    """
    device = next(net.parameters()).device
    opt = make_optimizer(net, cfg)
    step, trained_s, history = 0, 0.0, []
    if resume is not None:
        state = torch.load(Path(resume) / CKPT, map_location=device, weights_only=False)
        net.load_state_dict(state["net"])
        opt.load_state_dict(state["opt"])
        step, trained_s, history = state["step"], state["trained_s"], state["history"]
        log(f"resumed at step {step} ({trained_s:.0f} s trained)")
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    net.train()
    start = last_log = time.perf_counter()
    tokens_since, stopped = 0, "budget"
    best, last_eval = (math.inf, None), start
    sums = {"ce": 0.0, "mtp": 0.0, "n": 0}
    for step, batch in batches(rows, cfg.batch_size, cfg.seed, start_step=step):
        elapsed = time.perf_counter() - start
        if elapsed >= cfg.time_budget_s or trained_s + elapsed >= cfg.schedule_s or \
                (cfg.max_steps is not None and step >= cfg.max_steps):
            stopped = "budget" if elapsed >= cfg.time_budget_s else "done"
            break
        lr = lr_at(cfg, step, trained_s + elapsed)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = batch.to(device, non_blocking=True)
        with autocast(device, cfg.precision):
            losses = net.losses(batch)
        loss = losses["ce"] + cfg.mtp_weight * losses.get("mtp", 0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.clip)
        opt.step()
        tokens_since += batch.numel()
        sums["ce"] += float(losses["ce"].detach())  # one sync a step: fine next to ~30 host-driven layers
        sums["mtp"] += float(losses.get("mtp", torch.zeros(())).detach())
        sums["n"] += 1
        now = time.perf_counter()
        if now - last_log >= cfg.log_every_s or step == 0:
            held = math.nan
            if heldout is not None and now - last_eval >= cfg.eval_every_s:
                held, best = _eval_keep_best(net, heldout, best, cfg.precision)
                last_eval = time.perf_counter()
            row = {"step": step, "time_s": round(trained_s + now - start, 1), "lr": lr,
                   "ce": sums["ce"] / sums["n"], "mtp": sums["mtp"] / sums["n"],
                   "tokens_per_s": tokens_since / (now - last_log) if step else 0.0, "heldout_ce": held}
            history.append(row)
            log(f"step {step:6d}  t {row['time_s']:7.1f}s  lr {lr:.2e}  ce {row['ce']:.3f}  mtp {row['mtp']:.3f}  "
                f"{row['tokens_per_s']:,.0f} tok/s" + ("" if math.isnan(held) else f"  held-out ce {held:.3f}"))
            last_log, tokens_since, sums = time.perf_counter(), 0, {"ce": 0.0, "mtp": 0.0, "n": 0}  # evals left out
    trained_s += time.perf_counter() - start
    if heldout is not None:
        held, best = _eval_keep_best(net, heldout, best, cfg.precision)
        if best[1] is not None and best[0] < held:
            net.load_state_dict(best[1])
            log(f"kept the best weights: held-out ce {best[0]:.3f} (the last were {held:.3f})")
    save_state(ckpt_dir / CKPT, net, opt, step, trained_s, history)
    log(f"stopped ({stopped}) at step {step}, {trained_s:.0f} s trained; saved {ckpt_dir / CKPT}")
    return {"step": step, "trained_s": trained_s, "history": history, "stopped": stopped,
            "config": asdict(cfg)}


def _eval_keep_best(net: TrainNet, heldout: torch.Tensor, best: tuple[float, dict | None], precision: str):
    held = evaluate(net, heldout, precision=precision)["heldout_ce"]
    if held < best[0]:
        best = (held, {k: v.detach().clone() for k, v in net.state_dict().items()})
    return held, best


@torch.no_grad()
def evaluate(net: TrainNet, rows: torch.Tensor, batch_size: int = 8, precision: str = "tf32") -> dict[str, float]:
    """Held-out CE, MTP CE and MTP position-1 acceptance (teacher forced: the MTP head's greedy token for p + 2
    equals the target's greedy token at p + 1, both given the true prefix)."""
    device = next(net.parameters()).device
    was = net.training
    net.eval()
    tot = {"ce": 0.0, "mtp": 0.0, "acc": 0.0, "n": 0, "n_acc": 0}
    for i in range(0, rows.shape[0], batch_size):
        ids = rows[i: i + batch_size].to(device)
        with autocast(device, precision):
            wide = net.trunk(ids)
            logits = net.logits(wide)  # [B, S, K]
            mtp = net.mtp_logits(wide, ids)[:, :-1]  # [B, S-2, K]: row p predicts p + 2
        tgt = net.targets(ids)
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tgt[:, 1:].flatten())
        mce = torch.nn.functional.cross_entropy(mtp.flatten(0, 1), tgt[:, 2:].flatten())
        agree = (mtp.argmax(-1) == logits[:, 1:-1].argmax(-1)).float()
        tot["ce"] += float(ce) * ids.shape[0]
        tot["mtp"] += float(mce) * ids.shape[0]
        tot["n"] += ids.shape[0]
        tot["acc"] += float(agree.sum())
        tot["n_acc"] += agree.numel()
    net.train(was)
    return {"heldout_ce": tot["ce"] / tot["n"], "heldout_mtp_ce": tot["mtp"] / tot["n"],
            "mtp_pos1_acceptance": tot["acc"] / max(tot["n_acc"], 1)}

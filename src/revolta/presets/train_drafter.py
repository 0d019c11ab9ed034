"""DFlash2 drafter training on the frozen trained default (the released drafter's architecture, scaled down).

Per training row [S] the frozen target runs once with its taps (the wide residuals leaving the
`target_layer_ids` layers, reduced by the config's `tap_reduction`, as `spec.dflash2.taps` gives the engine); the
drafter turns them into context K/V for positions 0 .. S-1. Then `anchors_per_row` anchors p are drawn; block p is
[token p, mask x (block_size - 1)] at positions p .. p + block_size - 1 and sees the context rows before p, as in
a decode round where the target has computed 0 .. p - 1. Block index i >= 1 predicts token p + i.

Losses: the drafter's logits (through the target's frozen LM head, over kept tokens) against the target's greedy
tokens (what acceptance compares with), decayed by position like DFlash (weight exp(-(i - 1) / 4)), plus the
candidate selector's cross entropy over its top-K candidates along the target's path (the walk's training signal).
The mask token's input embedding is a parameter trained here and exported with the drafter.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..spec.dflash2.draft_config import DFlash2DraftConfig
from ..spec.dflash2.model import DFlash2DraftModel, block_visibility
from ..spec.dflash2.taps import context_features
from .train_data import batches
from .train_loop import autocast, lr_at, LoopConfig
from .train_model import TrainNet


@dataclass(frozen=True)
class DrafterConfig:
    batch_size: int = 16
    anchors_per_row: int = 16
    lr: float = 2e-3
    time_budget_s: float = 120.0
    max_steps: int | None = None
    seed: int = 0
    selector_weight: float = 0.5
    log_every_s: float = 20.0
    precision: str = "tf32"


def drafter_config(net: TrainNet) -> DFlash2DraftConfig:
    """The default drafter's config (presets/default_drafter.py) at the trained target's width and depth."""
    return drafter_config_for(net.net.cfg.text)


def drafter_config_for(t) -> DFlash2DraftConfig:
    """`drafter_config` from the target's TextConfig `t` (the shipped drafter's config is rebuilt from it)."""
    from .default_drafter import DRAFTER_CONFIG

    raw = copy.deepcopy(DRAFTER_CONFIG)
    heads = max(2, t.hidden_size // 64)
    raw.update(hidden_size=t.hidden_size, intermediate_size=2 * t.hidden_size, num_attention_heads=heads,
               num_key_value_heads=max(1, heads // 2), head_dim=t.hidden_size // heads,
               num_target_layers=t.num_hidden_layers)
    n = t.num_hidden_layers
    raw["dflash_config"]["target_layer_ids"] = sorted({1, n // 2 - 1, n - 3} & set(range(n))) or [0]
    raw["dflash_config"]["conv_group_size"] = min(16, t.hidden_size)
    cfg = DFlash2DraftConfig.from_dict(raw, source="trained default drafter")
    cfg.check_target(n, t.hidden_size, t.vocab_size, "trained default drafter")
    return cfg


class DrafterTrainer(nn.Module):
    """The drafter plus its trained mask embedding; the target (frozen, not a submodule) is passed in."""

    def __init__(self, cfg: DFlash2DraftConfig, hidden_size: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.model = DFlash2DraftModel(cfg)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02)
        self.mask_embedding = nn.Parameter(torch.randn(hidden_size) * 0.02)

    def block_logits(self, net: TrainNet, ids: Tensor, anchors: Tensor, feats: Tensor) -> tuple[Tensor, Tensor]:
        """ids: [B, S]; anchors: [B, A] positions; feats: [B, S, taps*H] (`target_pass`) -> (drafter hidden
        [B*A, D, H], logits [B*A, D, K]), D drafts."""
        cfg, m = self.model.cfg, self.model
        B, S = ids.shape
        A, bs = anchors.shape[1], cfg.block_size
        ctx = m.hidden_norm(m.fc(feats.to(m.fc.weight.dtype)))  # [B, S, H]
        cos, sin = m._rope(torch.arange(S, device=ids.device))
        kv = [layer.self_attn.key_value(ctx.flatten(0, 1), cos.repeat(B, 1), sin.repeat(B, 1))
              for layer in m.layers]
        rows = torch.arange(B, device=ids.device).repeat_interleave(A)  # [B*A] row of each block
        p = anchors.reshape(-1)  # [B*A]
        emb = net.text.embed_tokens(net.remap[ids[rows, p]]).detach()  # [B*A, H] the anchor token
        x = torch.cat([emb[:, None], self.mask_embedding.expand(p.shape[0], bs - 1, -1).to(emb.dtype)], 1)
        x = x * cfg.input_embedding_scale
        bcos, bsin = m._rope((p[:, None] + torch.arange(bs, device=ids.device)).flatten())
        ctx_pos = torch.arange(S, device=ids.device).expand(p.shape[0], S)  # [B*A, S] context key positions
        masks: dict[tuple, Tensor] = {}  # one visibility mask per (causal, window) kind of layer
        for layer, (k, v) in zip(m.layers, kv):
            ck, cv = k.view(B, S, *k.shape[1:])[rows], v.view(B, S, *v.shape[1:])[rows]  # [B*A, S, Hkv, D]
            kind = (layer.self_attn.causal, layer.self_attn.window)
            if kind not in masks:  # context rows 0 .. p - 1, then the block at p
                masks[kind] = block_visibility(ctx_pos, ctx_pos < p[:, None], p, bs, *kind)
            x = layer(x, bcos, bsin, ck, cv, masks[kind])
        hidden = m.norm(x)[:, 1:]  # [B*A, D, H]
        logits = net.net.lm_head(hidden).float() * cfg.output_multiplier
        return hidden, logits

    def losses(self, net: TrainNet, ids: Tensor, anchors: Tensor, feats: Tensor,
               target_greedy: Tensor) -> dict[str, Tensor]:
        """feats, target_greedy: `target_pass` (greedy row p: the target's compact token for p + 1)."""
        cfg = self.model.cfg
        D = cfg.block_size - 1
        B, A = anchors.shape
        rows = torch.arange(B, device=ids.device).repeat_interleave(A)
        pos = anchors.reshape(-1)[:, None] + torch.arange(D, device=ids.device)  # [B*A, D] row predicting p + 1 + i
        want = target_greedy[rows[:, None], pos]  # [B*A, D] compact ids
        hidden, logits = self.block_logits(net, ids, anchors, feats)
        decay = torch.exp(-torch.arange(D, device=ids.device, dtype=torch.float32) / 4.0)
        ce = F.cross_entropy(logits.flatten(0, 1), want.flatten(), reduction="none").view(-1, D)
        ce = (ce * decay).sum() / (decay.sum() * ce.shape[0])
        return {"ce": ce, "selector": self.selector_loss(net, hidden, logits, want, ids[rows, anchors.reshape(-1)])}

    def selector_loss(self, net: TrainNet, hidden: Tensor, logits: Tensor, want: Tensor, anchor: Tensor) -> Tensor:
        """CE over the top-K candidates of each position, predecessor = the wanted token (when it is a candidate)."""
        sel = self.model.candidate_selector
        unary, cand = torch.topk(logits, sel.top_k, dim=-1)  # [N, D, K]
        full = net.kept[cand]  # the selector's codebooks are indexed by full ids
        first, rest = sel.lattice(hidden, unary, full, anchor)
        hit = cand == want[..., None]  # [N, D, K]
        present = hit.any(-1)  # [N, D]
        idx = hit.float().argmax(-1)  # [N, D] the wanted token's candidate index
        loss0 = F.cross_entropy(first, idx[:, 0], reduction="none")[present[:, 0]]
        prev = idx[:, :-1]  # predecessor index at t - 1
        row = rest.gather(2, prev[..., None, None].expand(-1, -1, 1, rest.shape[-1])).squeeze(2)  # [N, D-1, K]
        ok = present[:, 1:] & present[:, :-1]
        loss_rest = F.cross_entropy(row.flatten(0, 1), idx[:, 1:].flatten(), reduction="none")[ok.flatten()]
        both = torch.cat([loss0, loss_rest])
        return both.mean() if both.numel() else logits.sum() * 0.0


def _anchors(B: int, S: int, A: int, block: int, gen: torch.Generator, device) -> Tensor:
    """[B, A] anchor positions in [1, S - block]: at least one context row, the whole block inside the row."""
    return torch.randint(1, S - block + 1, (B, A), generator=gen).to(device)


@torch.no_grad()
def target_pass(net: TrainNet, cfg: DFlash2DraftConfig, ids: Tensor, precision: str = "tf32") -> tuple[Tensor, Tensor]:
    """One frozen target forward: (tapped context features [B, S, taps*H], greedy compact tokens [B, S])."""
    B, S = ids.shape
    with autocast(ids.device, precision):
        taps: dict[int, Tensor | None] = {i: None for i in cfg.target_layer_ids}
        greedy = net.logits(net.trunk(ids, taps)).argmax(-1)
        return context_features(net.text, cfg, taps).view(B, S, -1), greedy


def train_drafter(net: TrainNet, rows: Tensor, heldout: Tensor, cfg: DrafterConfig, log=print):
    """Train a drafter on the frozen `net`; returns (DrafterTrainer, held-out metrics)."""
    device = next(net.parameters()).device
    net.eval()
    for p in net.parameters():
        p.requires_grad_(False)
    trainer = DrafterTrainer(drafter_config(net), net.net.cfg.text.hidden_size, cfg.seed).to(device)
    dcfg = trainer.model.cfg
    opt = torch.optim.AdamW(trainer.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = LoopConfig(lr=cfg.lr, schedule_s=cfg.time_budget_s, warmup_steps=20)
    gen = torch.Generator().manual_seed(cfg.seed)
    start = last = time.perf_counter()
    step = 0
    for step, batch in batches(rows, cfg.batch_size, cfg.seed + 1):
        elapsed = time.perf_counter() - start
        if elapsed >= cfg.time_budget_s or (cfg.max_steps is not None and step >= cfg.max_steps):
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(sched, step, elapsed)
        ids = batch.to(device)
        anchors = _anchors(ids.shape[0], ids.shape[1], cfg.anchors_per_row, dcfg.block_size, gen, device)
        feats, greedy = target_pass(net, dcfg, ids, cfg.precision)
        with autocast(device, cfg.precision):
            losses = trainer.losses(net, ids, anchors, feats, greedy)
        loss = losses["ce"] + cfg.selector_weight * losses["selector"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainer.parameters(), 1.0)
        opt.step()
        now = time.perf_counter()
        if now - last >= cfg.log_every_s or step == 0:
            log(f"drafter step {step:5d}  t {now - start:6.1f}s  ce {float(losses['ce'].detach()):.3f}  "
                f"selector {float(losses['selector'].detach()):.3f}")
            last = now
    trainer.eval()
    metrics = evaluate_drafter(trainer, net, heldout, gen, precision=cfg.precision)
    metrics["steps"] = step
    log(f"drafter held-out: {metrics}")
    return trainer, metrics


@torch.no_grad()
def evaluate_drafter(trainer: DrafterTrainer, net: TrainNet, heldout: Tensor, gen: torch.Generator,
                     anchors_per_row: int = 16, batch_size: int = 8, precision: str = "tf32") -> dict[str, float]:
    """Mean accepted length of greedy drafts (teacher forced: drafts from the true prefix, each compared with the
    target's greedy token at its position; accepted = the leading run of matches, 0 .. block_size - 1) and the
    per-position match rate."""
    device = next(net.parameters()).device
    cfg = trainer.model.cfg
    D = cfg.block_size - 1
    lengths, matches = [], []
    for i in range(0, heldout.shape[0], batch_size):
        ids = heldout[i: i + batch_size].to(device)
        B, S = ids.shape
        anchors = _anchors(B, S, anchors_per_row, cfg.block_size, gen, device)
        feats, greedy = target_pass(net, cfg, ids, precision)
        rows = torch.arange(B, device=device).repeat_interleave(anchors_per_row)
        with autocast(device, precision):
            hidden, logits = trainer.block_logits(net, ids, anchors, feats)
        picked = greedy_walk(trainer, net, hidden.float(), logits, ids[rows, anchors.reshape(-1)])
        want = greedy[rows[:, None], anchors.reshape(-1)[:, None] + torch.arange(D, device=device)]
        match = (picked == want).float()  # [N, D]
        matches.append(match)
        lengths.append(match.cumprod(-1).sum(-1))
    match = torch.cat(matches)
    return {"mean_accepted_length": float(torch.cat(lengths).mean()),
            "per_position_match": [round(float(x), 4) for x in match.mean(0)]}


def greedy_walk(trainer: DrafterTrainer, net: TrainNet, hidden: Tensor, logits: Tensor, anchor: Tensor) -> Tensor:
    """CandidateSelector's greedy walk over compact logits [N, D, K] -> compact draft ids [N, D] (the codebooks
    are read at the candidates' full ids, as the engine's full-vocabulary logits give them)."""
    sel = trainer.model.candidate_selector
    unary, cand = torch.topk(logits, sel.top_k, dim=-1)
    first, rest = sel.lattice(hidden, unary, net.kept[cand], anchor)
    rows = torch.arange(first.shape[0], device=first.device)
    picks = [first.argmax(-1)]
    for t in range(1, cand.shape[1]):
        picks.append(rest[rows, t - 1, picks[-1]].argmax(-1))
    return cand.gather(-1, torch.stack(picks, 1)[..., None]).squeeze(-1)


def drafter_export_state(trainer: DrafterTrainer, net: TrainNet) -> dict[str, Tensor]:
    """The drafter's state dict with the selector codebooks cut to the kept rows, plus `mask_embedding`."""
    state = {k: v.detach() for k, v in trainer.model.state_dict().items()}
    for key in ("candidate_selector.predecessor_codebook.weight", "candidate_selector.successor_codebook.weight"):
        state[key] = state[key][net.kept]
    state["mask_embedding"] = trainer.mask_embedding.detach()
    return state

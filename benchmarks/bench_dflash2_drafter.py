"""The DFlash2 drafter's round alone (issue 19): the dense concatenating context (`DraftKVCache`, what the engine
ran before the context store) against the preallocated `DraftContextStore`, eager, on a released-shape drafter
(5 sliding layers of window 2048 at width 2560, 7 drafts, rank-256 selector; benchmarks/standin.py) with random
weights and a random target embedding and vocab-248,320 head.

One round per request: append `--accept` + 1 context rows, then draft one block (the selector walk included,
and the one `.tolist()` the engine does). Contexts start at `--contexts` rows (appended before timing).
`store` reads each layer's ring through the shortest power-of-two prefix that holds every context (eager
shapes), `store-static` always reads the whole window (the shapes a CUDA graph of the drafter would fix).

    python benchmarks/bench_dflash2_drafter.py                 (H200: prints a table, JSON in $OUT)
    python benchmarks/bench_dflash2_drafter.py --tiny --rounds 3 --contexts 40 --concurrency 1,2   (CPU smoke)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from standin import DrafterShape, standin_config  # noqa: E402
from standin import drafter_config as standin_drafter_config  # noqa: E402

from revolta.presets.default_drafter import init_drafter_weights  # noqa: E402
from revolta.spec.dflash2 import (  # noqa: E402
    DFlash2DraftConfig,
    DFlash2DraftModel,
    DraftContextStore,
    DraftKVCache,
)
from revolta.spec.dflash2.context_store import to_device  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def build(tiny: bool, dtype: torch.dtype):
    """(drafter, embedding, head) at the released shape (or the default preset's scale)."""
    target = standin_config(4, widths="tiny" if tiny else "real")  # the slice the drafter taps (widths, vocab)
    vocab, hidden = target.text.vocab_size, target.text.hidden_size
    raw = standin_drafter_config(target, DrafterShape.tiny() if tiny else DrafterShape())
    with torch.device(DEVICE):
        model = DFlash2DraftModel(DFlash2DraftConfig.from_dict(raw, source="bench drafter"))
        embed = torch.nn.Embedding(vocab, hidden)
        head = torch.nn.Linear(hidden, vocab, bias=False)
    init_drafter_weights(model, seed=7)
    return model.to(dtype).eval(), embed.to(dtype), head.to(dtype)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def time_rounds(mode: str, model, embed, head, batch: int, context: int, rows: int, rounds: int) -> float:
    """Median ms of one round for `batch` requests whose contexts start at `context` rows."""
    cfg, dtype = model.cfg, model.fc.weight.dtype
    g = torch.Generator(DEVICE).manual_seed(0)

    def feats(n: int) -> torch.Tensor:
        return torch.randn(n, model.fc.in_features, device=DEVICE, dtype=dtype, generator=g)

    anchors = list(range(batch))
    if mode == "dense":
        caches = [DraftKVCache() for _ in range(batch)]
        for c in caches:
            model.extend_context(c, feats(context))

        def round_() -> None:
            sel = model([feats(rows) for _ in caches], caches, torch.tensor(anchors, device=DEVICE), embed,
                        lambda h: head(h).float())
            sel.tokens.tolist()
    else:
        store = DraftContextStore(cfg, batch, context + (rounds + 3) * rows + 1, DEVICE, dtype,
                                  static_view=mode == "store-static")
        slots = [store.acquire(0) for _ in range(batch)]
        model.extend_slots(store, [(s, feats(context)) for s in slots])

        def round_() -> None:
            model.extend_slots(store, [(s, feats(rows)) for s in slots])
            ids = to_device(anchors, torch.device(DEVICE))
            hidden = model.block_hidden_slots(model.block_embeds(ids, embed), store, slots)
            model.select(hidden, ids, lambda h: head(h).float()).tokens.tolist()

    times = []
    for i in range(rounds + 2):  # the first two: allocator and kernel warm-up
        sync()
        t = time.perf_counter()
        round_()
        sync()
        if i >= 2:
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="the default preset's scale (a CPU smoke run)")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--contexts", default="128,1024,4096", help="context rows before the timed rounds")
    ap.add_argument("--accept", type=int, default=3, help="accepted drafts per round (rows appended: accept + 1)")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    model, embed, head = build(args.tiny, dtype)
    rows = []
    for batch in (int(c) for c in args.concurrency.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            row = {"concurrency": batch, "context": context}
            for mode in ("dense", "store", "store-static"):
                row[mode] = time_rounds(mode, model, embed, head, batch, context, args.accept + 1, args.rounds)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{DEVICE}, {'tiny' if args.tiny else 'released-shape'} drafter, {args.accept + 1} rows appended per round")
    print("| C | context | dense ms / round | store ms / round | store-static ms / round | dense / store |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['concurrency']} | {r['context']} | {r['dense']:.2f} | {r['store']:.2f} | "
              f"{r['store-static']:.2f} | {r['dense'] / r['store']:.2f}x |")
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_dflash2_drafter.json").write_text(json.dumps({"device": DEVICE, "tiny": args.tiny, "rows": rows},
                                                              indent=1))


if __name__ == "__main__":
    main()

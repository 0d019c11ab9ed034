"""The trained default's fixed held-out eval set: token ids of Python the model never saw, stored in the package.

`EVAL_FILES` are stdlib library files whose path hash puts them in the held-out split (train_data.is_heldout at the
default 20 permille), so no interpreter's training run read them; the codec tables (`encodings/`) are left out on
purpose: they are held out too, but their repetitive `'\\x00' # 0x00 -> NULL` lines make acceptance look far
better than on ordinary code. From each file, `SEGMENT_TOKENS` tokens starting at the first line that begins after a
third of the file (past the licence header and imports). `build_eval_set` wrote `trained/heldout_eval.json` from
Python 3.11.7's stdlib; it is stored as ids so every machine checks the same tokens.

`heldout_ce` is the next-token cross entropy of a loaded model over the segments (the CI threshold reads it);
`prompts` gives the first `prompt_tokens` of each segment (the benchmark's and notebook 04's held-out prompts).
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

EVAL_PATH = Path(__file__).with_name("trained") / "heldout_eval.json"
EVAL_FILES = ("idlelib/browser.py", "idlelib/editor.py", "idlelib/help.py", "idlelib/searchbase.py",
              "lib2to3/fixes/fix_idioms.py", "lib2to3/pgen2/pgen.py", "lib2to3/pgen2/tokenize.py", "sndhdr.py")
SEGMENT_TOKENS = 128


def build_eval_set(tokenizer, root: str | None = None) -> dict:
    """{"files", "segments": [[ids] x len(EVAL_FILES)], "python"} from the stdlib at `root` (default: this
    interpreter's); checks each file is in the held-out split."""
    import sys

    from .train_data import is_heldout

    base = Path(root or sysconfig.get_paths()["stdlib"])
    segments = []
    for rel in EVAL_FILES:
        if not is_heldout(rel, 20):
            raise ValueError(f"{rel} is not in the held-out split; the eval set must be text the model never saw")
        text = (base / rel).read_text(encoding="utf-8")
        start = text.index("\n", len(text) // 3) + 1
        ids = tokenizer.encode(text[start:])[:SEGMENT_TOKENS]
        if len(ids) < SEGMENT_TOKENS:
            raise ValueError(f"{rel} gives {len(ids)} tokens after its first third, fewer than {SEGMENT_TOKENS}")
        segments.append(ids)
    return {"files": list(EVAL_FILES), "segments": segments, "python": sys.version.split()[0],
            "recipe": "presets/trained_eval.py: SEGMENT_TOKENS ids from the first line after a third of each file"}


def load_eval_set() -> list[list[int]]:
    return json.loads(EVAL_PATH.read_text())["segments"]


def prompts(prompt_tokens: int = 64, count: int | None = None) -> list[list[int]]:
    """The first `prompt_tokens` ids of the first `count` segments (default all)."""
    segs = load_eval_set()
    return [s[:prompt_tokens] for s in segs[:count]]


def heldout_ce(model, segments: list[list[int]] | None = None) -> tuple[float, int]:
    """(mean next-token cross entropy in nats, number of targets left out) of a loaded FlashNextModel over the
    segments (one forward each). Targets the model may not predict (outside its `logit_mask`: tokens never seen in
    training) are left out, as training's loss leaves them out; their count is returned so a test can bound it."""
    import torch

    segments = load_eval_set() if segments is None else segments
    V = model.cfg.text.vocab_size
    allowed = torch.arange(V, device=model.device) if model.logit_mask is None else model.logit_mask.nonzero()[:, 0]
    row = torch.full((V,), -1, dtype=torch.long, device=model.device)
    row[allowed] = torch.arange(allowed.numel(), device=model.device)  # full id -> allowed row (-1: forbidden)
    head = model.lm_head.weight[allowed]  # [A, d]: forbidden logits are -inf, so they add nothing to the softmax
    total, n, skipped = 0.0, 0, 0
    with torch.no_grad():
        for seg in segments:
            ids = torch.tensor(seg, device=model.device)
            # the mixed hidden of every position, projected on the allowed rows only (10x less work than [S, V])
            _, wide = model(ids, logits_indices=ids.new_zeros(1), return_hidden=True)
            y = model.model.language_model.hyper_connection_mixer.read(wide[:-1])[0]  # [S-1, d]
            logits = (y @ head.T).float()  # [S-1, A]
            tgt = row[ids[1:]]
            ok = tgt >= 0
            total += float(torch.nn.functional.cross_entropy(logits[ok], tgt[ok], reduction="sum"))
            n += int(ok.sum())
            skipped += int((~ok).sum())
    return total / n, skipped

"""Training data of the trained default: the Python standard library of the running interpreter.

Text that exists offline on every machine that runs Python. The recipe (deterministic for one interpreter):
- files: every `*.py` under `sysconfig.get_paths()["stdlib"]`, sorted by relative path, skipping `site-packages`
  and, unless `include_tests`, the `test`/`tests`/`idle_test` directories (the test suites are 1.6x the library's
  bytes, repetitive and full of odd literals; the library code is what a user prompts for); files are cut at
  `max_bytes_per_file`;
- split: a file is held out when sha256(relative path) mod 1000 < `heldout_permille` (default 20, i.e. 2%), so
  the split does not move when files are added or removed elsewhere;
- tokens: the real Qwen tokenizer of the embedded default, one EOS (`<|endoftext|>`) after each file, files
  concatenated in sorted order and cut into rows of `seq_len` tokens (the tail that does not fill a row is dropped);
- order: rows are shuffled per epoch by a seeded torch generator (`batches`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

SKIP_DIRS = ("site-packages", "__pycache__")
TEST_DIRS = ("test", "tests", "idle_test")
EOS_ID = 248044  # <|endoftext|>: the document separator and the n-gram reset token (spec §5.3)


@dataclass(frozen=True)
class DataConfig:
    seq_len: int = 512
    heldout_permille: int = 20  # files held out per thousand, by path hash
    max_files: int | None = None  # tests: the first max_files training and max_files // 10 + 1 held-out files
    max_bytes_per_file: int = 200_000  # very large generated files (e.g. pydoc_data/topics.py) are cut here
    root: str | None = None  # default: the running interpreter's stdlib
    include_tests: bool = False


@dataclass
class TokenData:
    """Packed rows of token ids: train [N, seq_len] and heldout [M, seq_len], int64; `files` counts per split;
    `heldout_file_rows`: per held-out file, the row holding the middle of its tokens (None past the packed rows)."""

    train: Tensor
    heldout: Tensor
    files: dict[str, int]
    num_tokens: dict[str, int]
    seconds: float
    heldout_file_rows: list[int] = dataclasses.field(default_factory=list)

    def heldout_eval_rows(self, n: int) -> Tensor:
        """[<= n, seq_len] held-out rows for metrics: one row from each of n held-out files spread evenly over the
        sorted file list (deterministic), so one long, repetitive file (e.g. a codec table, where rows are
        consecutive) cannot stand for the whole split. n <= 0: every held-out row."""
        rows = sorted(set(self.heldout_file_rows))
        if n <= 0 or not rows:
            return self.heldout
        pick = rows if len(rows) <= n else [rows[round(i * (len(rows) - 1) / max(n - 1, 1))] for i in range(n)]
        return self.heldout[torch.tensor(sorted(set(pick)))]


def stdlib_files(cfg: DataConfig) -> list[tuple[str, Path]]:
    """(relative posix path, path) of every training file, sorted by relative path."""
    root = Path(cfg.root or sysconfig.get_paths()["stdlib"])
    out = []
    skip = SKIP_DIRS if cfg.include_tests else SKIP_DIRS + TEST_DIRS
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in skip for part in rel.parts[:-1]) or not path.is_file():
            continue
        out.append((rel.as_posix(), path))
    out.sort(key=lambda item: item[0])
    return out


def is_heldout(rel: str, permille: int) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 1000 < permille


def _pack(docs: list[list[int]], seq_len: int) -> Tensor:
    flat = [t for doc in docs for t in (*doc, EOS_ID)]
    n = len(flat) // seq_len
    return torch.tensor(flat[: n * seq_len], dtype=torch.long).view(n, seq_len)


def _middle_rows(docs: list[list[int]], seq_len: int, num_rows: int) -> list[int]:
    """The packed row holding the middle token of each doc, for docs whose middle was packed."""
    out, start = [], 0
    for doc in docs:
        row = (start + len(doc) // 2) // seq_len
        if row < num_rows:
            out.append(row)
        start += len(doc) + 1
    return out


def load_token_data(cfg: DataConfig, tokenizer) -> TokenData:
    """Read, split, tokenize and pack the stdlib (see the module docstring). tokenizer: a revolta Tokenizer."""
    start = time.perf_counter()
    texts: dict[str, list[str]] = {"train": [], "heldout": []}
    limit = {"train": cfg.max_files, "heldout": cfg.max_files // 10 + 1 if cfg.max_files else None}
    for rel, path in stdlib_files(cfg):
        split = "heldout" if is_heldout(rel, cfg.heldout_permille) else "train"
        if limit[split] is not None and len(texts[split]) >= limit[split]:
            continue
        texts[split].append(path.read_bytes()[: cfg.max_bytes_per_file].decode("utf-8", errors="replace"))
    docs = {split: tokenizer.encode_batch(t) if t else [] for split, t in texts.items()}
    rows = {split: _pack(d, cfg.seq_len) for split, d in docs.items()}
    if rows["train"].shape[0] == 0 or rows["heldout"].shape[0] == 0:
        raise ValueError(f"the data recipe left {rows['train'].shape[0]} training and {rows['heldout'].shape[0]} "
                         f"held-out rows of {cfg.seq_len} tokens; use more files (max_files) or a shorter seq_len")
    return TokenData(train=rows["train"], heldout=rows["heldout"], files={k: len(v) for k, v in texts.items()},
                     num_tokens={k: v.numel() for k, v in rows.items()}, seconds=time.perf_counter() - start,
                     heldout_file_rows=_middle_rows(docs["heldout"], cfg.seq_len, rows["heldout"].shape[0]))


def batches(rows: Tensor, batch_size: int, seed: int, start_step: int = 0):
    """Endless (step, [batch_size, seq_len]) batches: a seeded permutation per epoch; resumes at `start_step`."""
    per_epoch = max(rows.shape[0] // batch_size, 1)
    step = start_step
    while True:
        epoch, i = divmod(step, per_epoch)
        order = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(seed + epoch))
        idx = order[i * batch_size: (i + 1) * batch_size]
        if idx.numel() < batch_size:  # fewer rows than one batch (tiny test slices): wrap around
            idx = order.repeat(batch_size // max(order.numel(), 1) + 1)[:batch_size]
        yield step, rows[idx]
        step += 1

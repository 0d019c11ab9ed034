"""What speculation was measured to gain over plain decoding on a GPU: the start-up warning's figures.

`measured_speedup.json` beside this file holds rows of benchmarks/RESULTS.md (each names its row in
`source`): per method and concurrency, tokens/s with speculation over tokens/s without. The engine
warns at start-up on a GPU while any row of its method is below 1 and names the figures; once every
row is >= 1 the warning is gone. benchmarks/bench_fulldepth.py writes the same file from its run
($OUT/measured_speedup.json): copy it here together with the RESULTS.md rows it came from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MEASURED_SPEEDUP_FILE = Path(__file__).with_name("measured_speedup.json")
_METHOD_NAMES = {"mtp": "MTP", "dflash2": "DFlash2"}


@dataclass(frozen=True)
class MeasuredSpeedup:
    """One benchmark row: `speedup` = tokens/s with `method` over plain decoding at `concurrency`."""

    method: str
    num_speculative_tokens: int
    concurrency: int
    speedup: float
    basis: str  # how the figure was obtained (measured acceptance, or the cost model at an acceptance)
    device: str
    source: str  # the benchmarks/RESULTS.md row
    commit: str = ""


def load_measured(path: Path = MEASURED_SPEEDUP_FILE) -> list[MeasuredSpeedup]:
    """The rows of `path` ({"rows": [{field: value, ...}, ...]}); ValueError naming a malformed row."""
    rows = json.loads(path.read_text())["rows"]
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(MeasuredSpeedup(**row))
        except TypeError as e:
            raise ValueError(f"{path} row {i} ({row!r}) does not match MeasuredSpeedup: {e}") from None
    return out


def slower_warning(method: str | None, rows: list[MeasuredSpeedup] | None = None) -> str | None:
    """The start-up warning for `method` ("mtp", "dflash2"): None unless a recorded row is below 1."""
    rows = [r for r in (load_measured() if rows is None else rows) if r.method == method]
    if not any(r.speedup < 1 for r in rows):
        return None
    rows.sort(key=lambda r: r.concurrency)
    one_device = len({r.device for r in rows}) == 1  # else each figure names its own GPU
    figures = ", ".join(f"{r.speedup:.2f}x at C{r.concurrency}" + ("" if one_device else f" on {r.device}")
                        for r in rows)
    where = f" on {rows[0].device}" if one_device else ""
    sources = "; ".join(dict.fromkeys(f"{r.source}: {r.basis}" for r in rows))
    return (f"speculative decoding ({_METHOD_NAMES.get(method, method)}, {rows[0].num_speculative_tokens} drafts) "
            f"reached {figures} of plain decoding's tokens/s{where} ({sources}); below 1x it is "
            "slower than decoding without it: pass speculative_config={'method': None} for plain decoding")

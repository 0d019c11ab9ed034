"""The start-up warning that speculation is slower than plain decoding follows the benchmark rows in
spec/measured_speedup.json: it names their ratios and disappears once every row is >= 1x."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from revolta.spec.measured import MeasuredSpeedup, load_measured, slower_warning


def test_shipped_table_names_its_results_rows():
    rows = load_measured()
    assert {r.method for r in rows} >= {"mtp", "dflash2"}
    for r in rows:
        assert r.speedup > 0 and r.concurrency >= 1 and r.source.startswith("benchmarks/RESULTS.md")


def test_warning_names_every_recorded_ratio_of_its_method():
    rows = load_measured()
    for method in ("mtp", "dflash2"):
        mine = [r for r in rows if r.method == method]
        warning = slower_warning(method)
        if any(r.speedup < 1 for r in mine):
            for r in mine:
                assert f"{r.speedup:.2f}x at C{r.concurrency}" in warning
            assert mine[0].source in warning and "{'method': None}" in warning
        else:
            assert warning is None


def test_warning_disappears_when_every_row_is_at_least_1x():
    row = MeasuredSpeedup("mtp", 4, 1, 0.53, "cost model at acceptance 0.7", "NVIDIA H200", "benchmarks/RESULTS.md F2")
    fast = replace(row, concurrency=8, speedup=1.4)
    assert "0.53x at C1, 1.40x at C8" in slower_warning("mtp", [fast, row])
    assert slower_warning("mtp", [fast, replace(row, speedup=1.0)]) is None
    assert slower_warning("dflash2", [row]) is None  # no row for the method: nothing measured, no claim
    assert slower_warning(None, [row]) is None
    elsewhere = replace(row, concurrency=8, speedup=0.9, device="NVIDIA H100 80GB HBM3")
    assert "0.53x at C1 on NVIDIA H200, 0.90x at C8 on NVIDIA H100 80GB HBM3 of plain decoding's tokens/s (" \
        in slower_warning("mtp", [row, elsewhere])  # rows of two GPUs: each figure names its own
    assert "tokens/s on NVIDIA H200 (" in slower_warning("mtp", [row, replace(row, concurrency=8)])


def test_malformed_row_is_named(tmp_path):
    path = tmp_path / "measured_speedup.json"
    path.write_text(json.dumps({"rows": [{"method": "mtp", "speedup": 0.5}]}))
    with pytest.raises(ValueError, match="row 0"):
        load_measured(path)

"""Human-readable sizes for messages and reports (a leaf: every layer may use it)."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """Binary units: 6442450944 -> '6.00 GiB'."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"

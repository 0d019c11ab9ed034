"""Ops of the hot path. Each op has a torch reference (`*_ref`), the numerics contract."""

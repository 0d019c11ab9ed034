"""Gated delta rule ops (spec/model.md §3.5)."""

from .ref import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref

__all__ = ["chunk_gated_delta_rule_ref", "recurrent_gated_delta_rule_ref"]

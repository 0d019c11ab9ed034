"""Gated delta rule ops (spec/model.md §3.5): torch references and Triton kernels on a slot pool."""

from .chunk import gdn_chunk_prefill
from .recurrent import gdn_commit, gdn_recurrent_update, gdn_replay_commit, gdn_verify
from .ref import (chunk_gated_delta_rule_ref, gdn_chunk_prefill_ref, gdn_commit_ref, gdn_recurrent_update_ref,
                  gdn_replay_commit_ref, gdn_verify_ref, recurrent_gated_delta_rule_ref)

__all__ = ["chunk_gated_delta_rule_ref", "gdn_chunk_prefill", "gdn_chunk_prefill_ref", "gdn_commit", "gdn_commit_ref",
           "gdn_recurrent_update", "gdn_recurrent_update_ref", "gdn_replay_commit", "gdn_replay_commit_ref",
           "gdn_verify", "gdn_verify_ref", "recurrent_gated_delta_rule_ref"]

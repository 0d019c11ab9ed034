"""The one switch between the torch references and the Triton kernels.

`kernel_ops("torch")` and `kernel_ops("triton")` return the same set of functions with the
same signatures; layers call whatever the ForwardMeta carries, so the whole model runs on
either path (the torch path is the numerics contract, the Triton path is checked against it).
The references live beside their kernels, so both tables import Triton (without a GPU the
kernels run under TRITON_INTERPRET=1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class KernelOps:
    backend: str
    causal_conv1d_varlen: Callable
    causal_conv1d_update: Callable
    gdn_chunk_prefill: Callable
    gdn_recurrent_update: Callable
    gdn_verify: Callable  # speculative verify, keeps per-row states or nothing (replay)
    gdn_replay_commit: Callable
    causal_conv1d_commit: Callable
    store_kv: Callable
    index_compress: Callable
    qsa_prefill: Callable
    qsa_select_decode: Callable
    qsa_sparse_decode: Callable
    qsa_partial: Callable  # DCP: a rank's un-gated partial attention + lse (kernels/qsa/dcp.py)
    hc_read: Callable | None  # None: the layer's own torch code
    hc_combine: Callable | None  # bitwise equal to the layer's torch code, one launch instead of two
    moe_route: Callable | None
    fused_moe: Callable | None
    quant_fused_moe: Callable | None  # packed experts (kernels.quant.moe); None: the layer's torch reference
    gated_rms_norm: Callable | None
    apply_rope: Callable | None
    # decode-path fusions (issue 19: a C1 step is a chain of small launches); None: the layer's torch code
    zc_rms_norm: Callable | None  # ZCRMSNorm in one launch instead of ~10 torch kernels
    zc_norm_rope: Callable | None  # QSA's per-head norm + RoPE in one launch (kernels/norm_rope.py)
    gdn_gates: Callable | None  # GDN's g and beta in one launch (kernels/gdn/gates.py)
    hc_combine_read: Callable | None  # an HC write inside the next HC read's first pass (kernels/hc.py), bitwise
    ple_rows: Callable  # the PLE layer's n-gram row ids and history store, one launch per paged decode / verify step


def kernel_ops(backend: str) -> KernelOps:
    """The op table of `backend` ("torch" references or "triton" kernels)."""
    if backend not in BACKENDS:
        raise ValueError(f"kernels={backend!r}; use one of {BACKENDS}")
    from importlib import import_module

    def op(module: str, name: str) -> Callable:
        return getattr(import_module(f"{__package__}.{module}"), name)

    sfx = "_ref" if backend == "torch" else ""
    table = {name: op(module, name + sfx) for module, name in (
        ("conv1d", "causal_conv1d_varlen"), ("conv1d", "causal_conv1d_update"),
        ("gdn.chunk" if sfx == "" else "gdn.ref", "gdn_chunk_prefill"),
        ("gdn.recurrent" if sfx == "" else "gdn.ref", "gdn_recurrent_update"),
        ("gdn.recurrent" if sfx == "" else "gdn.ref", "gdn_verify"),
        ("gdn.recurrent" if sfx == "" else "gdn.ref", "gdn_replay_commit"),
        ("conv1d", "causal_conv1d_commit"),
        ("qsa.store_kv", "store_kv"), ("qsa.index_compress", "index_compress"), ("qsa.prefill", "qsa_prefill"),
        ("qsa.select", "qsa_select_decode"), ("qsa.sparse_attn", "qsa_sparse_decode"),
        ("qsa.dcp", "qsa_partial"), ("ple_rows", "ple_rows"))}
    fused = dict.fromkeys(("hc_read", "hc_combine", "moe_route", "fused_moe", "quant_fused_moe", "gated_rms_norm",
                           "apply_rope", "zc_rms_norm", "zc_norm_rope", "gdn_gates", "hc_combine_read"))
    if backend == "triton":
        fused = {"hc_read": op("hc", "hc_read"), "hc_combine": op("hc", "hc_combine"),
                 "moe_route": op("moe", "moe_route"), "fused_moe": op("moe", "fused_moe"),
                 "quant_fused_moe": op("quant.moe", "quant_fused_moe"),
                 "gated_rms_norm": op("norm", "gated_rms_norm"), "apply_rope": op("rope", "apply_rope"),
                 "zc_rms_norm": op("norm", "zc_rms_norm"), "zc_norm_rope": op("norm_rope", "zc_norm_rope"),
                 "gdn_gates": op("gdn.gates", "gdn_gates"), "hc_combine_read": op("hc", "hc_combine_read")}
    return KernelOps(backend=backend, **table, **fused)

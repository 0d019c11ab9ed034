"""QSA kernels (spec/model.md §4, spec/engine.md §5.3): one module per op, each a Triton kernel, a torch
reference `<op>_ref` with the same signature, and a checking wrapper.

Step order per QSA layer: store_kv -> index_compress -> qsa_select_decode / qsa_select_rows ->
qsa_sparse_decode (decode, verify) or qsa_prefill.
"""

from .common import e4m3_decode_ref, e4m3_encode_ref, int8_quant_ref
from .index_compress import index_compress, index_compress_ref
from .prefill import qsa_prefill, qsa_prefill_ref
from .select import qsa_select_decode, qsa_select_decode_ref, qsa_select_rows, qsa_select_rows_ref
from .sparse_attn import qsa_sparse_decode, qsa_sparse_decode_ref
from .store_kv import store_kv, store_kv_ref

__all__ = [
    "store_kv", "store_kv_ref", "index_compress", "index_compress_ref", "qsa_select_decode", "qsa_select_decode_ref",
    "qsa_select_rows", "qsa_select_rows_ref", "qsa_sparse_decode", "qsa_sparse_decode_ref", "qsa_prefill",
    "qsa_prefill_ref", "e4m3_encode_ref", "e4m3_decode_ref", "int8_quant_ref",
]

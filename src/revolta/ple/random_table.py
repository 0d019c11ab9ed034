"""Random FP8 PLE tables for benchmark models that have no checkpoint (e.g. the full-size AWQ model drawn on the
GPU, quantized.random_quantized_model): each PLE layer's n-gram weight is dropped before it is ever materialised
and a table of the real size is drawn straight into its placement's memory, like ple/load.py would read it.
"""

from __future__ import annotations

import torch
from torch import nn

from .load import host_tensor, ple_embeddings
from .placement import check_placement
from .table import PLETable

DRAW_ROWS = 1 << 20  # rows drawn per chunk (160 MiB of fp32 at the real width): bounded scratch memory


@torch.no_grad()
def attach_random_tables(model: nn.Module, placement: str, device: str | torch.device, seed: int = 0) -> int:
    """Replace every PLE layer's n-gram weight of `model` (meta or real) by a random FP8 E4M3 table [rows,
    head_dim] with a global scale of 1.0: in pinned host memory ("host"; ordinary memory on a CPU run) or on
    `device` ("device"). Values ~N(0, 1) as init_random_weights draws embeddings, drawn in chunks on `device`
    (fast on a GPU; the host table is filled by copies). Returns the tables' bytes."""
    if check_placement(placement) == "disk":
        raise ValueError("attach_random_tables draws tables into memory; ple_placement='disk' needs table shards "
                         "on disk (save a checkpoint and load it with ple_placement='disk')")
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    total = 0
    for _, _, emb in ple_embeddings(model):
        rows, width = emb.num_rows, emb.head_dim
        emb.attach_table(None)  # the 16-bit weight goes first: at the real size it would not fit beside the table
        if placement == "host":
            weight = host_tensor(rows * width).view(torch.float8_e4m3fn).view(rows, width)
        else:
            weight = torch.empty(rows, width, dtype=torch.float8_e4m3fn, device=device)
        # a CUDA host table is pinned here, so the chunk copies below are DMA transfers
        table = PLETable(weight, torch.ones((), device=device), placement, device)
        for lo in range(0, rows, DRAW_ROWS):
            hi = min(rows, lo + DRAW_ROWS)
            chunk = torch.randn(hi - lo, width, device=device, generator=gen).to(torch.float8_e4m3fn)
            weight[lo:hi].copy_(chunk)
        emb.attach_table(table)
        total += table.nbytes
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return total

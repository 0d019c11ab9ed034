"""Logits over a checkpoint's allowed vocabulary only.

A small model trained on the ids its corpus uses keeps the large tokenizer's vocabulary for its ids but may
predict only those (`vocab_mask.json`, `FlashNextModel.logit_mask`). The embedded default allows 23,568 of
248,320 ids: the full LM head product spends ~90% of its bytes on rows whose logits are masked to -inf anyway
(on a 2-core CPU 32 ms of a 60 ms decode step, and 9 of those per MTP4 round). Projecting onto the allowed rows
and writing them into a row of -inf gives the same logits up to the GEMM's summation order, which every logit
path shares (next token, MTP and DFlash2 drafts), so greedy speculation stays equal to greedy without.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

MAX_ALLOWED_FRACTION = 0.5  # above this share of the vocabulary the full product and a mask cost about the same


def _version(t: Tensor) -> int:
    """In-place writes through `t` so far; inference-mode tensors keep no count (their storage decides)."""
    return -1 if t.is_inference() else t._version


class AllowedVocabHead:
    """Holds the allowed ids [A] and the LM head's rows at those ids [A, d] (the gathered copy is the saving),
    rebuilt whenever the mask or the weight changes: a new tensor, a new storage, or an in-place write through
    the parameter (its version counter); sleep's byte-exact restores keep the rows they had. The rows are a copy
    outside the module's parameters and buffers (A / V of the head: 12 MB for the embedded default in fp16), so
    they stay where they are while the engine sleeps."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._ids: Tensor | None = None  # [A] int64, ascending
        self._rows: Tensor | None = None  # [A, d] in the weight's dtype

    def prepare(self, weight: Tensor, mask: Tensor) -> bool:
        """Build (or keep) the gathered rows for `weight` [V, d] and `mask` [V] bool; False when the mask
        allows too much of the vocabulary for the gather to pay. Syncs with the device when it rebuilds (call
        it before capturing a CUDA graph: `FlashNextModel.prepare_logits`)."""
        key = (weight.data_ptr(), _version(weight), weight.dtype, weight.device, weight.shape,
               mask.data_ptr(), _version(mask))
        if key != self._key:
            ids = mask.nonzero()[:, 0]
            use = ids.numel() <= MAX_ALLOWED_FRACTION * mask.numel()
            self._ids = ids if use else None
            self._rows = weight.detach().index_select(0, ids) if use else None
            self._key = key
        return self._ids is not None

    def logits(self, y: Tensor, vocab_size: int) -> Tensor:
        """y [N, d] -> [N, V] fp32: the allowed ids' logits, -inf elsewhere (after `prepare` returned True)."""
        part = F.linear(y, self._rows).float()  # [N, A]
        out = torch.full((y.shape[0], vocab_size), float("-inf"), dtype=torch.float32, device=y.device)
        return out.index_copy_(1, self._ids, part)

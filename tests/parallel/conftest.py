"""Fixtures shared by the tensor-parallel tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """One intra-op thread in this (rank 0) process for the test: the spawned ranks run beside it on the CI's 2
    shared cores, and with 2 threads each a tiny forward takes ~1 s instead of ~15 ms (oversubscription)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

import os
import sys

import pytest
import torch

# tests/parity holds the oracle helpers (hf_oracle.py); make them importable by name
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "parity"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

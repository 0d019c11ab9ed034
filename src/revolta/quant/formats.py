"""The registry: a checkpoint's WeightScheme -> the WeightFormat that stores it (awq.py, ct_int4.py, nvfp4.py).
Apart from format.py, so that the formats can build on its base class without a cycle."""

from __future__ import annotations

from . import awq, ct_int4, nvfp4
from .config import WeightScheme
from .format import WeightFormat


def weight_format(scheme: WeightScheme) -> WeightFormat:
    """The format object of a scheme."""
    formats = {f.name: f for f in (awq.AWQ, ct_int4.CTInt4, nvfp4.ModelOptNVFP4, nvfp4.CTNVFP4)}
    return formats[scheme.format](scheme)

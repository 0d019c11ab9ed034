"""Quantized checkpoints: the quantization config (`config`), the packed formats (one module each), and
`weight_format(scheme)` to get a format's tensors and arithmetic. Kernels live in revolta.kernels.quant."""

from .config import QuantConfig, QuantConfigError, WeightScheme, parse_quant_config
from .format import TensorSpec, WeightFormat
from .formats import weight_format

__all__ = ["QuantConfig", "QuantConfigError", "TensorSpec", "WeightFormat", "WeightScheme", "parse_quant_config",
           "weight_format"]

"""ConfigError: a config.json that cannot describe a model. Its own module so that the quantization config
(quant/config.py), which config.py reads, can raise it without importing config.py back."""


class ConfigError(ValueError):
    """A config.json that cannot describe a Qwen3.8-Flash-Next model; the message names the field."""

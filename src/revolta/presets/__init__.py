"""Embedded presets: the default model (`default.py`) and the preset chat template (`chat_template.jinja`)."""

from .default import default_config, ensure_default_model

__all__ = ["default_config", "ensure_default_model"]

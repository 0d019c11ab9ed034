"""Embedded presets: the default model (`default.py`), its DFlash2 drafter (`default_drafter.py`) and the preset
chat template (`chat_template.jinja`)."""

from .default import default_config, ensure_default_model
from .default_drafter import ensure_default_drafter

__all__ = ["default_config", "ensure_default_drafter", "ensure_default_model"]

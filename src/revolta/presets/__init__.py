"""Embedded presets: the trained default (`trained.py`, weights in `trained/`), the random-weight default
(`default.py`), their DFlash2 drafters (`trained.py`, `default_drafter.py`) and the preset chat template
(`chat_template.jinja`)."""

from pathlib import Path

from .default import default_config, ensure_default_model
from .default_drafter import ensure_default_drafter


def default_drafter_for(model_dir: Path) -> Path:
    """The embedded DFlash2 drafter of an embedded default's directory: the trained drafter for the trained default
    (its preset marker says so), else the random default's."""
    import json

    from .default import PRESET_MARKER

    marker = Path(model_dir) / PRESET_MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("preset") == "trained-default":
        from .trained import ensure_trained_drafter

        return ensure_trained_drafter(Path(model_dir).parent)
    return ensure_default_drafter()


__all__ = ["default_config", "default_drafter_for", "ensure_default_drafter", "ensure_default_model"]

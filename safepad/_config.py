"""Reading a model's (text) config: multimodal wrappers keep the decoder's options in a sub-config."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["text_config_value"]


def text_config_value(module: nn.Module, name: str, default: Any = None) -> Any:
    """``name`` of ``module.config``'s decoder text config (``get_text_config(decoder=True)``), else ``default``."""
    cfg = getattr(module, "config", None)
    get_text = getattr(cfg, "get_text_config", None)
    if callable(get_text):
        try:
            cfg = get_text(decoder=True)
        except (TypeError, ValueError):
            pass
    return getattr(cfg, name, default)

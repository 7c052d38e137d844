"""Trainer integrations for safepad (re-exported by ``safepad``)."""

from __future__ import annotations

from .callback import KIND_TOKENIZER, PaddingGuardCallback

__all__ = ["KIND_TOKENIZER", "PaddingGuardCallback"]

"""Trainer integrations for safepad (re-exported by ``safepad``)."""

from __future__ import annotations

from .callback import KIND_DROPPED_BOUNDARIES, KIND_TOKENIZER, PaddingGuardCallback

__all__ = ["KIND_DROPPED_BOUNDARIES", "KIND_TOKENIZER", "PaddingGuardCallback"]

"""The one registry of recurrent families safepad knows about but does not (yet) make padding-correct.

Every ``config.model_type`` whose modules keep conv / recurrent cache state (found by
:func:`safepad.specs.discovery.discover_recurrent_families`) is either served by a spec (its stateful mixer
classes are all claimed in :mod:`safepad.specs.registry`) or listed here with a one-line reason. The
discovery test fails for a family that is neither, so a transformers release that adds one is noticed.
``safepad.wrap`` raises :class:`~safepad.UnsupportedModelError` with the reason for a model of a listed family,
and the guard warns for it like for any other unwrapped recurrent model.

A few families are listed although they exist only in some transformers versions; an entry for a model type
the installed transformers does not have is harmless.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["UNSUPPORTED_FAMILIES", "unsupported_reason"]

UNSUPPORTED_FAMILIES: Mapping[str, str] = MappingProxyType(
    {
        "minimax": "lightning attention (decayed linear attention, no conv) with its own linear cache; no core yet",
        "lfm3_vl_vision": (
            "not a causal model: its 'conv' layer type is a 2-D spatial conv over image patches that never "
            "reads or writes a cache (the lfm3_vl language model is supported)"
        ),
    }
)


def unsupported_reason(model_type: str) -> str | None:
    """The one-line reason ``model_type`` is not supported, or ``None`` when it is not listed."""
    return UNSUPPORTED_FAMILIES.get(model_type)

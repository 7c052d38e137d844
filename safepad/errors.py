"""Exceptions and warnings raised by safepad.

``PaddingWarning`` and ``PaddingError`` report a batch layout that an unwrapped state-space model would
process silently wrong (right padding with a cache, packed rows, holes in the mask); see
:func:`safepad.guard`. ``UnsupportedModelError`` is raised when :func:`safepad.wrap` finds nothing it can fix. ``UntestedVersionError`` is
raised by ``import safepad`` on a transformers / torch outside the tested range (safepad._compat).
"""

from __future__ import annotations

__all__ = ["PaddingError", "PaddingWarning", "UnsupportedModelError", "UntestedVersionError"]


class PaddingWarning(UserWarning):
    """A batch layout that gives wrong results on an unwrapped SSM / linear-attention model.

    ``kind`` names what was detected (``"right_padding_with_cache"``, ``"packed"``, ``"mask_holes"``,
    ``"right_padding_tokenizer"``), or is ``None``.
    """

    def __init__(self, message: str, kind: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind


class PaddingError(ValueError):
    """Raised instead of :class:`PaddingWarning` when the guard runs with ``mode="error"``.

    ``kinds`` names everything detected in the offending forward (see :class:`PaddingWarning`).
    """

    def __init__(self, message: str, kinds: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.kinds = tuple(kinds)


class UnsupportedModelError(ValueError):
    """Raised when :func:`safepad.wrap` finds nothing in the model that it can fix."""


class UntestedVersionError(ImportError):
    """``import safepad`` found a transformers or torch release outside the range CI tests.

    The message names the range and the pip command that installs a tested release; ``SAFEPAD_ALLOW_UNTESTED=1``
    turns the refusal into a warning (README.md, "Supported versions").
    """

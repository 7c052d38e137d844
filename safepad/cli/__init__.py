"""safepad command line: ``safepad audit`` (see :mod:`safepad.cli.audit`)."""

from __future__ import annotations

from .main import build_parser, main

__all__ = ["build_parser", "main"]

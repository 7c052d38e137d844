"""safepad: padding- and packing-correct Mamba-family and hybrid SSMs in HuggingFace transformers."""

from __future__ import annotations

import logging

from ._compat import check_transformers_version

logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = "0.1.0"

check_transformers_version()

__all__ = ["__version__"]

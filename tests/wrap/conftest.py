from __future__ import annotations

import pytest
import torch

from safepad.testing.tiny import tiny_model


@pytest.fixture(scope="module")
def nemotron():
    """A strengthened tiny Nemotron-H (stock) — tests deep-copy it before wrapping."""
    return tiny_model("nemotron_h")

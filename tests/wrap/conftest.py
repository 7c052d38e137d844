from __future__ import annotations

import logging

import pytest
import torch

from safepad.testing.tiny import tiny_model


@pytest.fixture(scope="module")
def nemotron():
    """A strengthened tiny Nemotron-H (stock) — tests deep-copy it before wrapping."""
    return tiny_model("nemotron_h")


@pytest.fixture(scope="module")
def quiet_transformers():
    """transformers' logger at ERROR for the module (tiny builds and right-padded calls warn on every call);
    use with ``pytestmark = pytest.mark.usefixtures("quiet_transformers")``."""
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    yield
    log.setLevel(level)

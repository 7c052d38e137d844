"""Shared fixtures for the collator tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread_torch():
    """Tiny tensors only: torch's intra-op thread pool costs ~30 ms per op on a loaded 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

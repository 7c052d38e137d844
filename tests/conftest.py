"""Suite-wide settings: one torch thread per test process (``make test`` runs two xdist workers on 2 cores;
two threads per worker oversubscribe the cores and make small ops 10-100x slower)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread_per_worker():
    torch.set_num_threads(1)
    yield

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny models on a shared 2-core box: intra-op threads only add contention (2 threads ran a scenario
    matrix ~40x slower than 1 under load), so these tests run single-threaded and restore the setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

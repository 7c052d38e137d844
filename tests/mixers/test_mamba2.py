"""The Mamba2 mixer's cached decode step (safepad/mixers/mamba2.py): its op count against the stock mixer's."""

from __future__ import annotations

import pytest
import torch

from .helpers import mixer_decode_ops

CASES = [
    pytest.param(family, dtype, side, id=f"{family}-{str(dtype)[6:]}-{side}")
    for family in ("nemotron_h", "bamba", "mamba2")
    for dtype in (torch.float32, torch.bfloat16)
    for side in ("right", "left")
]


@pytest.mark.parametrize(("family", "dtype", "side"), CASES)
def test_decode_step_dispatches_no_more_ops_than_the_stock_mixer(family, dtype, side):
    """Issue 38: each wrapped Mamba2 mixer's decode step (hold of pad rows, float64 CPU recurrence of half
    precision, dt clamp included) dispatches at most the ops of the stock mixer's step (on CUDA each op is a
    launch). The counts come from the stock model itself, not from a number fixed here."""
    stock, wrapped = mixer_decode_ops(family, dtype, side)
    assert stock and len(wrapped) == len(stock)
    assert all(w <= s for w, s in zip(wrapped, stock)), (wrapped, stock)

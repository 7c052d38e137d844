"""safepad.mixers.common: the decode step's hold of masked rows."""

from __future__ import annotations

import pytest
import torch

from safepad.mixers.common import hold_masked_rows


@pytest.mark.parametrize(
    "shape", [pytest.param((4, 5), id="2d-[B,N]"), pytest.param((4, 3, 2), id="3d-[B,D,K]"),
              pytest.param((4, 2, 3, 2), id="4d-[B,H,P,N]")],
)
def test_masked_rows_keep_their_old_state_bitwise(shape):
    g = torch.Generator().manual_seed(0)
    new, old = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g, dtype=torch.float64)
    new[1] = float("nan")  # a masked row's new state is dropped, even a NaN
    mask = torch.tensor([[True], [False], [True], [False]])  # [B, 1]
    out = hold_masked_rows(mask, new, old)
    assert out.dtype == new.dtype and out.shape == new.shape
    for b in range(4):
        assert torch.equal(out[b], new[b] if mask[b, 0] else old[b].to(new.dtype))


def test_no_mask_or_no_old_state_returns_the_new_state():
    new = torch.randn(2, 3)
    assert hold_masked_rows(None, new, torch.zeros(2, 3)) is new
    assert hold_masked_rows(torch.tensor([[True], [False]]), new, None) is new


def test_a_mask_of_several_tokens_raises():
    """The hold is for one decode token: a [B, T > 1] mask is named instead of read at its first column."""
    with pytest.raises(ValueError, match=r"\[batch, 1\]"):
        hold_masked_rows(torch.ones(2, 3, dtype=torch.bool), torch.zeros(2, 4), torch.zeros(2, 4))

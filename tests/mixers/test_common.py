"""safepad.mixers.common: the decode step's hold of masked rows."""

from __future__ import annotations

import pytest
import torch

from safepad.mixers.common import cached_conv_step, hold_masked_rows


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


class _Past:
    def __init__(self, conv):
        self.conv = conv


def _ref_step(x, state, weight, bias):
    """float64 token-by-token reference: ``y = sum_k w_k [state[:, :, 1:] || x]_k + b``; ``x`` ``[B, 1, D]``."""
    window = torch.cat([state[:, :, 1:], x.transpose(1, 2)], dim=2).double()  # [B, D, K]
    return ((window * weight[:, 0].double()).sum(-1) + bias.double())[:, None]  # [B, 1, D]


def _conv(D=4, K=3, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Conv1d(D, D, K, groups=D, bias=True).double()


def _inputs(seed=1, B=2, D=4, K=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, 1, D, generator=g, dtype=torch.float64)  # [B, 1, D]
    return x, torch.randn(B, D, K, generator=g, dtype=torch.float64)  # [B, D, K]


def _step(conv, x, state):
    with torch.no_grad():
        return cached_conv_step(x, conv, _Past(state), activation=None, backend="torch")[0]  # [B, 1, D]


@pytest.mark.parametrize(
    "change",
    [
        pytest.param("inplace", id="in-place-update"),
        pytest.param("data-inplace", id="data-in-place-peft-merge"),
        pytest.param("data-assign", id="data-reassigned"),
        pytest.param("new-parameter", id="new-parameter"),
        pytest.param("load_state_dict", id="load_state_dict"),
    ],
)
def test_step_weight_follows_every_weight_change(change):
    """After any change of the weight the decode step computes with the new weight (float64 reference), never a
    stale one."""
    conv = _conv()
    x, state = _inputs()
    torch.testing.assert_close(_step(conv, x, state), _ref_step(x, state, conv.weight, conv.bias), rtol=0, atol=1e-12)
    _step(conv, x, state)  # a second step before the change
    new = torch.randn_like(conv.weight)
    with torch.no_grad():
        if change == "inplace":
            conv.weight.copy_(new)
        elif change == "data-inplace":
            conv.weight.data.copy_(new)  # bypasses the version counter
        elif change == "data-assign":
            conv.weight.data = new.clone()
        elif change == "new-parameter":
            conv.weight = torch.nn.Parameter(new.clone())
        else:
            conv.load_state_dict({"weight": new, "bias": conv.bias.detach().clone()})
    torch.testing.assert_close(_step(conv, x, state), _ref_step(x, state, new, conv.bias), rtol=0, atol=1e-12)


def test_step_weight_under_autograd_reaches_the_parameter():
    """With autograd on, the step's weight gradient (float64 reference: d sum(y) / d w_k = sum over rows of the
    window) arrives, after no-grad steps too."""
    conv = _conv()
    x, state = _inputs()
    _step(conv, x, state)
    _step(conv, x, state)
    y = cached_conv_step(x, conv, _Past(state), activation=None, backend="torch")[0]
    y.sum().backward()
    window = torch.cat([state[:, :, 1:], x.transpose(1, 2)], dim=2)  # [B, D, K]
    torch.testing.assert_close(conv.weight.grad[:, 0], window.sum(0), rtol=0, atol=1e-12)

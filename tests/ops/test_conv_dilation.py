"""Dilated causal conv (Qwen4-Exp's PLE conv): ``causal_conv1d(..., dilation=d)`` against a float64 loop over each
sequence alone, and against torch's own dilated ``conv1d``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from safepad.ops.conv import causal_conv1d, causal_conv1d_step

D = 5


def _ref(x, w, history, d):
    """One sequence: x ``[T, D]``, w ``[D, K]``, history ``[D, S]`` | None -> (y ``[T, D]``, last (K-1)d inputs)."""
    x, w = x.double(), w.double()
    K = w.shape[1]
    S = (K - 1) * d
    hist = torch.zeros(D, S, dtype=torch.float64) if history is None else history.double()[:, -S:]
    seq = torch.cat([hist, x.T], dim=1)  # [D, S + T]
    ys = []
    for t in range(x.shape[0]):
        p = S + t
        ys.append(sum(w[:, j] * seq[:, p - (K - 1 - j) * d] for j in range(K)))
    return torch.stack(ys), seq[:, -S:]


def _seq_idx(lengths):
    return torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None]


@pytest.mark.parametrize("d", [pytest.param(2, id="d2"), pytest.param(3, id="d3")])
@pytest.mark.parametrize("lengths", [pytest.param((1,), id="len1"), pytest.param((8,), id="len-S-1"),
                                     pytest.param((3, 1, 10, 9), id="segments")])
def test_packed_dilated_conv_matches_each_sequence_alone(lengths, d):
    g = torch.Generator().manual_seed(0)
    K = 4
    x = torch.randn(1, sum(lengths), D, generator=g, dtype=torch.float64)
    w = torch.randn(D, K, generator=g, dtype=torch.float64)
    y = causal_conv1d(x, w, seq_idx=_seq_idx(lengths), dilation=d)
    start = 0
    for n in lengths:
        ref, _ = _ref(x[0, start : start + n], w, None, d)
        torch.testing.assert_close(y[0, start : start + n], ref, rtol=1e-12, atol=1e-12)
        start += n


def test_matches_torch_dilated_conv1d():
    g = torch.Generator().manual_seed(1)
    K, d, T = 4, 3, 20
    x = torch.randn(2, T, D, generator=g)
    w = torch.randn(D, K, generator=g)
    stock = F.conv1d(F.pad(x.transpose(1, 2), ((K - 1) * d, 0)), w[:, None], groups=D, dilation=d).transpose(1, 2)
    torch.testing.assert_close(causal_conv1d(x, w, dilation=d), stock, rtol=1e-5, atol=1e-5)


def test_states_mask_and_decode_steps():
    """Right-padded rows continuing from a history: outputs, final states (the last (K-1)d real inputs) and
    decode steps from those states equal each row alone."""
    g = torch.Generator().manual_seed(2)
    K, d, T = 3, 3, 9
    S = (K - 1) * d
    x = torch.randn(2, T, D, generator=g, dtype=torch.float64)
    w = torch.randn(D, K, generator=g, dtype=torch.float64)
    hist = torch.randn(2, D, S, generator=g, dtype=torch.float64)
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[1, 4:] = False
    x = torch.where(mask[..., None], x, torch.nan)
    y, state = causal_conv1d(x, w, initial_state=hist, token_mask=mask, return_final_state=True, dilation=d)
    assert state.shape == (2, D, S)
    nxt = torch.randn(2, D, generator=g, dtype=torch.float64)
    y1, _ = causal_conv1d_step(nxt, state, w, dilation=d)
    for b in range(2):
        real = x[b][mask[b]]
        ref, ref_state = _ref(real, w, hist[b], d)
        torch.testing.assert_close(y[b][mask[b]], ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(state[b], ref_state, rtol=0, atol=0)
        ref1, _ = _ref(torch.cat([real, nxt[b : b + 1]]), w, hist[b], d)
        torch.testing.assert_close(y1[b], ref1[-1], rtol=1e-12, atol=1e-12)


def test_gradient_reaches_only_the_real_taps():
    w = torch.randn(D, 3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(1, 12, D, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: causal_conv1d(a, b, dilation=2), (x, w))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_dilation_raises(bad):
    with pytest.raises(ValueError, match="dilation"):
        causal_conv1d(torch.randn(1, 4, D), torch.randn(D, 3), dilation=bad)

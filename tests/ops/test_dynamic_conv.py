"""safepad.ops.dynamic_conv against the float64 token-by-token reference: packed, padded, cached, decode."""

from __future__ import annotations

import pytest
import torch
from reference_dynamic_conv import ref_dynamic_conv

from safepad.ops.dynamic_conv import dynamic_causal_conv1d

D, K = 6, 4


def _inputs(B: int, T: int, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, D, generator=g, dtype=dtype), torch.randn(B, T, D, K, generator=g, dtype=dtype)


def _seq_idx(lengths: list[list[int]], T: int) -> torch.Tensor:
    rows = []
    for ls in lengths:
        ids = [i for i, n in enumerate(ls) for _ in range(n)]
        rows.append(ids + [ids[-1] if ids else 0] * (T - len(ids)))
    return torch.tensor(rows, dtype=torch.int32)


def _mask(lengths: list[list[int]], T: int) -> torch.Tensor:
    return torch.tensor([[t < sum(ls) for t in range(T)] for ls in lengths])


@pytest.mark.parametrize(
    "lengths",
    [
        pytest.param([[1, 3, 5]], id="packed-1-3-5"),
        pytest.param([[K - 1, K, K + 1]], id="packed-K-1-K-K+1"),
        pytest.param([[9]], id="one"),
    ],
)
def test_packed_rows_equal_each_sequence_alone(lengths):
    T = sum(lengths[0])
    x, taps = _inputs(1, T)
    y, final = dynamic_causal_conv1d(x, taps, seq_idx=_seq_idx(lengths, T), return_final_state=True)
    ry, rfinal = ref_dynamic_conv(x, taps, lengths)
    assert torch.allclose(y, ry, atol=1e-12)
    assert torch.allclose(final, rfinal, atol=1e-12)


@pytest.mark.parametrize("real", [pytest.param([7, 2, 1], id="7-2-1"), pytest.param([7, 7, 7], id="full")])
def test_right_padded_rows_with_a_cache_continue_from_their_last_real_inputs(real):
    T = 7
    x, taps = _inputs(3, T, seed=1)
    init = torch.randn(3, D, K, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    lengths = [[n] for n in real]
    y, final = dynamic_causal_conv1d(x, taps, initial_state=init, token_mask=_mask(lengths, T), return_final_state=True)
    ry, rfinal = ref_dynamic_conv(x, taps, lengths, initial_state=init)
    assert torch.allclose(y, ry, atol=1e-12)
    assert torch.allclose(final, rfinal, atol=1e-12)
    # the stock way (state = last K columns of the padded row) differs wherever a row is padded
    stock_state = torch.cat([init, x.transpose(1, 2)], -1)[..., -K:]
    for b, n in enumerate(real):
        assert torch.equal(final[b], stock_state[b]) == (n == T)


def test_decode_steps_equal_the_full_conv_and_a_masked_step_holds_the_state():
    T = 10
    x, taps = _inputs(2, T, seed=2)
    full = dynamic_causal_conv1d(x, taps)
    y, state = dynamic_causal_conv1d(x[:, :4], taps[:, :4], return_final_state=True)
    outs = [y]
    for t in range(4, T):
        y_t, state = dynamic_causal_conv1d(
            x[:, t : t + 1], taps[:, t : t + 1], initial_state=state, return_final_state=True
        )
        outs.append(y_t)
    assert torch.allclose(torch.cat(outs, 1), full, atol=1e-12)
    held = dynamic_causal_conv1d(
        x[:, :1], taps[:, :1], initial_state=state, token_mask=torch.tensor([[True], [False]]), return_final_state=True
    )[1]
    assert torch.equal(held[1], state[1]) and not torch.equal(held[0], state[0])


def test_float32_gradients_match_float64():
    x, taps = _inputs(2, 9, seed=3, dtype=torch.float32)
    x.requires_grad_(True)
    taps.requires_grad_(True)
    seq_idx = _seq_idx([[4, 5], [9]], 9)
    dynamic_causal_conv1d(x, taps, seq_idx=seq_idx).square().sum().backward()
    x64, t64 = x.detach().double().requires_grad_(True), taps.detach().double().requires_grad_(True)
    dynamic_causal_conv1d(x64, t64, seq_idx=seq_idx).square().sum().backward()
    assert torch.allclose(x.grad.double(), x64.grad, atol=1e-4)
    assert torch.allclose(taps.grad.double(), t64.grad, atol=1e-4)


def test_bad_inputs_raise_clear_errors():
    x, taps = _inputs(1, 5)
    with pytest.raises(ValueError, match="taps must have shape"):
        dynamic_causal_conv1d(x, taps[:, :4])
    with pytest.raises(ValueError, match="right-padded"):
        dynamic_causal_conv1d(x, taps, token_mask=torch.tensor([[False, True, True, True, True]]))
    with pytest.raises(ValueError, match="initial_state"):
        dynamic_causal_conv1d(x, taps, initial_state=torch.zeros(1, D, K + 1, dtype=torch.float64))

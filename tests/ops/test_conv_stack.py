"""safepad.ops.conv_stack against each sequence run alone in float64 (the ZAYA CCA conv pair)."""

from __future__ import annotations

import pytest
import torch
from reference_conv_stack import ref_conv_stack

from safepad.ops.conv_stack import causal_conv_stack

C, GROUPS = 6, 3  # a depthwise conv (K0 = 3) then a grouped conv (K1 = 2) over 3 groups of 2 channels


def _layers(seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    w1, b1 = torch.randn(C, 1, 3, generator=g, dtype=dtype), torch.randn(C, generator=g, dtype=dtype)
    w2, b2 = torch.randn(C, C // GROUPS, 2, generator=g, dtype=dtype), torch.randn(C, generator=g, dtype=dtype)
    return [(w1, b1, C), (w2, b2, GROUPS)]


def _x(B: int, T: int, seed: int = 1, dtype=torch.float64):
    return torch.randn(B, T, C, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _seq_idx(lengths, T):
    rows = []
    for ls in lengths:
        ids = [i for i, n in enumerate(ls) for _ in range(n)]
        rows.append(ids + [ids[-1]] * (T - len(ids)))
    return torch.tensor(rows, dtype=torch.int32)


@pytest.mark.parametrize(
    "lengths",
    [pytest.param([[1, 2, 3, 4]], id="1-2-3-4"), pytest.param([[3, 4]], id="Kc-Kc+1"), pytest.param([[8]], id="one")],
)
def test_packed_rows_equal_each_sequence_alone_biases_included(lengths):
    T = sum(lengths[0])
    x, layers = _x(1, T), _layers()
    y, final = causal_conv_stack(x, layers, seq_idx=_seq_idx(lengths, T), return_final_state=True)
    ry, rfinal = ref_conv_stack(x, layers, lengths)
    assert torch.allclose(y, ry, atol=1e-12) and torch.allclose(final, rfinal, atol=1e-12)


def test_right_padded_rows_with_a_cache_then_decode_steps():
    T, layers = 7, _layers(2)
    x = _x(3, T, seed=3)
    init = torch.randn(3, C, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    lengths = [[7], [4], [1]]
    mask = torch.tensor([[t < ls[0] for t in range(T)] for ls in lengths])
    y, state = causal_conv_stack(x, layers, initial_state=init, token_mask=mask, return_final_state=True)
    ry, rstate = ref_conv_stack(x, layers, lengths, initial_state=init)
    assert torch.allclose(y * mask[..., None], ry, atol=1e-12) and torch.allclose(state, rstate, atol=1e-12)
    # decoding token by token from that state equals the prefill of the grown rows
    nxt = _x(3, 2, seed=5)
    outs = []
    for t in range(2):
        y_t, state = causal_conv_stack(nxt[:, t : t + 1], layers, initial_state=state, return_final_state=True)
        outs.append(y_t)
    for b, (n,) in enumerate(lengths):
        grown = torch.cat([x[b : b + 1, :n], nxt[b : b + 1]], 1)
        ref = ref_conv_stack(grown, layers, [[n + 2]], initial_state=init[b : b + 1])[0][0, n:]
        assert torch.allclose(torch.cat(outs, 1)[b], ref, atol=1e-12)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float64, id="fp64"), pytest.param(torch.float32, id="fp32")])
def test_masked_decode_step_holds_the_row_and_real_rows_equal_the_reference(dtype):
    """One token with a ``[B, 1]`` mask (a decode step where some rows' token is a pad): real rows' outputs and states
    equal the float64 reference of each row grown by its token; a masked row's state is its old state, bitwise."""
    layers = [(w.to(dtype), b.to(dtype), g) for w, b, g in _layers(8)]
    init = torch.randn(3, C, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    x = _x(3, 1, seed=10)
    mask = torch.tensor([[True], [False], [True]])
    y, state = causal_conv_stack(
        x.to(dtype), layers, initial_state=init.to(dtype), token_mask=mask, return_final_state=True
    )  # [3, 1, C], [3, C, 3]
    ry, rstate = ref_conv_stack(x, _layers(8), [[1], [1], [1]], initial_state=init)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for b in (0, 2):
        assert torch.allclose(y[b].double(), ry[b], atol=tol) and torch.allclose(state[b].double(), rstate[b], atol=tol)
    assert torch.equal(state[1], init[1].to(dtype))
    # the one-token path returns what the same token gets as the last column of a longer chunk (float64)
    x2 = torch.cat([_x(3, 2, seed=11), x], dim=1)  # [3, 3, C]
    y2 = causal_conv_stack(x2, _layers(8), initial_state=init)
    _, mid = causal_conv_stack(x2[:, :2], _layers(8), initial_state=init, return_final_state=True)
    y1 = causal_conv_stack(x2[:, 2:], _layers(8), initial_state=mid)
    assert torch.allclose(y1, y2[:, 2:], atol=1e-12)


def test_float32_gradients_match_float64():
    layers32 = [(w.float().requires_grad_(True), b.float().requires_grad_(True), g) for w, b, g in _layers(6)]
    x = _x(2, 9, seed=7, dtype=torch.float32).requires_grad_(True)
    seq_idx = _seq_idx([[4, 5], [9]], 9)
    causal_conv_stack(x, layers32, seq_idx=seq_idx).square().sum().backward()
    layers64 = [
        (w.detach().double().requires_grad_(True), b.detach().double().requires_grad_(True), g) for w, b, g in layers32
    ]
    x64 = x.detach().double().requires_grad_(True)
    causal_conv_stack(x64, layers64, seq_idx=seq_idx).square().sum().backward()
    assert torch.allclose(x.grad.double(), x64.grad, atol=1e-4)
    for (w, _, _), (w64, _, _) in zip(layers32, layers64):
        assert torch.allclose(w.grad.double(), w64.grad, rtol=1e-4, atol=1e-3)


def test_bad_inputs_raise_clear_errors():
    x, layers = _x(1, 5), _layers()
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv_stack(x, layers, initial_state=torch.zeros(1, C, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="right-padded"):
        causal_conv_stack(x, layers, token_mask=torch.tensor([[False, True, True, True, True]]))
    with pytest.raises(ValueError, match="at least one"):
        causal_conv_stack(x, [])

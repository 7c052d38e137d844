"""safepad.ops.rg_lru against a float64 token-by-token reference (each sequence alone) and the stock module."""

from __future__ import annotations

import pytest
import torch

from safepad.ops.rg_lru import rg_lru, rg_lru_step
from tests.ops.reference_rg_lru import ref_rg_lru

H, P = 2, 4
W = H * P


def _params(seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    wi = torch.randn(H, P, P, generator=g) * 0.6
    bi = torch.randn(H, P, generator=g) * 0.3
    wr = torch.randn(H, P, P, generator=g) * 0.6
    br = torch.randn(H, P, generator=g) * 0.3
    lam = torch.randn(W, generator=g) * 0.5 - 1.0
    return [t.to(dtype) for t in (wi, bi, wr, br, lam)]


def _x(T: int, B: int = 1, seed: int = 1, dtype=torch.float64):
    return (torch.randn(B, T, W, generator=torch.Generator().manual_seed(seed)) * 1.5).to(dtype)


def _seq_idx(lengths):
    return torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None]


def test_reference_matches_stock_rglru():
    """The float64 reference is the stock RecurrentGemmaRglru (one sequence, reset at position 0)."""
    from transformers import AutoConfig
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru

    cfg = AutoConfig.for_model("recurrent_gemma", hidden_size=W, lru_width=W, num_attention_heads=H)
    mod = RecurrentGemmaRglru(cfg)
    wi, bi, wr, br, lam = _params(dtype=torch.float32)
    with torch.no_grad():
        for p, v in zip((mod.input_gate_weight, mod.input_gate_bias, mod.recurrent_gate_weight,
                         mod.recurrent_gate_bias, mod.recurrent_param), (wi, bi, wr, br, lam)):
            p.copy_(v)
    x = _x(13, dtype=torch.float32)
    with torch.no_grad():
        stock = mod(x, torch.arange(13)[None])
    ref, _ = ref_rg_lru(x[0], wi, bi, wr, br, lam, None)
    torch.testing.assert_close(stock[0].double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [pytest.param(4, id="chunk4"), pytest.param(64, id="chunk64")])
@pytest.mark.parametrize(
    "lengths",
    [pytest.param((1,), id="len1"), pytest.param((3,), id="len3"), pytest.param((1, 3, 17, 9), id="segments"),
     pytest.param((5, 1, 1, 70), id="long-and-ones")],
)
def test_packed_matches_each_sequence_alone(lengths, chunk):
    params = _params()
    T = sum(lengths)
    x = _x(T)
    y, final = rg_lru(x, *params, seq_idx=_seq_idx(lengths), return_final_state=True, chunk_size=chunk)
    start = 0
    for n in lengths:
        ref, h = ref_rg_lru(x[0, start : start + n], *params, None)
        torch.testing.assert_close(y[0, start : start + n], ref, rtol=1e-10, atol=1e-10)
        start += n
    torch.testing.assert_close(final[0], h, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("layout", ["right", "left", "holes"])
def test_token_mask_and_states(layout):
    """Masked tokens hold the state; outputs at real tokens and final states equal each row's real tokens alone,
    fresh and continuing from an initial state."""
    params = _params()
    T, B = 11, 3
    x = _x(T, B)
    mask = torch.ones(B, T, dtype=torch.bool)
    if layout == "right":
        mask[0, 7:] = False
        mask[2, 1:] = False
    elif layout == "left":
        mask[0, :4] = False
        mask[1, :10] = False
    else:
        mask[0, 2:5] = False
        mask[1, ::2] = False
    x = torch.where(mask[..., None], x, torch.nan)  # a NaN at a pad goes nowhere
    h0 = torch.randn(B, W, dtype=torch.float64)
    for init in (None, h0):
        y, final = rg_lru(x, *params, token_mask=mask, initial_state=init, return_final_state=True, chunk_size=4)
        for b in range(B):
            ref, h = ref_rg_lru(x[b][mask[b]], *params, None if init is None else init[b])
            torch.testing.assert_close(y[b][mask[b]], ref, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(final[b], h, rtol=1e-10, atol=1e-10)


def test_initial_state_feeds_only_the_first_sequence():
    params = _params()
    lengths = (4, 6, 2)
    x = _x(sum(lengths))
    h0 = torch.randn(1, W, dtype=torch.float64)
    y = rg_lru(x, *params, seq_idx=_seq_idx(lengths), initial_state=h0, chunk_size=4)
    start = 0
    for i, n in enumerate(lengths):
        ref, _ = ref_rg_lru(x[0, start : start + n], *params, h0[0] if i == 0 else None)
        torch.testing.assert_close(y[0, start : start + n], ref, rtol=1e-10, atol=1e-10)
        start += n


def test_steps_continue_the_scan():
    params = _params()
    x = _x(9, B=2)
    mask = torch.tensor([[True] * 9, [True] * 5 + [False] + [True] * 3])
    y_full, _ = rg_lru(x[:, :4], *params, return_final_state=True)
    _, state = rg_lru(x[:, :4], *params, return_final_state=True)
    ys = []
    for t in range(4, 9):
        y, state = rg_lru_step(x[:, t], state, *params, token_mask=mask[:, t])
        ys.append(y)
    for b in range(2):
        keep = mask[b].clone()
        ref, _ = ref_rg_lru(x[b][keep], *params, None)
        got = torch.cat([y_full[b], torch.stack(ys, 1)[b]])[keep]
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


def test_packed_gradients_equal_per_sequence():
    params = [p.requires_grad_() for p in _params()]
    lengths = (3, 1, 12, 7)
    x = _x(sum(lengths)).requires_grad_()
    w = torch.randn(sum(lengths), W, dtype=torch.float64)
    (rg_lru(x, *params, seq_idx=_seq_idx(lengths), chunk_size=4)[0] * w).sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in params]
    for t in [x, *params]:
        t.grad = None
    start, loss = 0, 0.0
    for n in lengths:
        y = rg_lru(x[:, start : start + n], *params)  # each sequence alone through the op
        loss = loss + (y[0] * w[start : start + n]).sum()
        start += n
    loss.backward()
    for g, t in zip(got, [x, *params]):
        torch.testing.assert_close(g, t.grad, rtol=1e-9, atol=1e-10)
    # and the per-sequence op agrees with the reference's autograd
    xs = x.detach()[0, :12].clone().requires_grad_()
    ref, _ = ref_rg_lru(xs, *[p.detach() for p in params], None)
    ref.sum().backward()
    xo = x.detach()[:, :12].clone().requires_grad_()
    rg_lru(xo, *[p.detach() for p in params]).sum().backward()
    torch.testing.assert_close(xo.grad[0], xs.grad, rtol=1e-9, atol=1e-10)


def test_nan_in_one_sequence_stays_there():
    params = [p.requires_grad_() for p in _params(dtype=torch.float32)]
    lengths = (5, 9, 3)
    x = _x(sum(lengths), dtype=torch.float32)
    x[0, 5 + 4, 2] = torch.nan
    x.requires_grad_()
    y = rg_lru(x, *params, seq_idx=_seq_idx(lengths), chunk_size=4)
    (y[0, :5].sum() + y[0, 14:].sum()).backward()  # a loss on the clean sequences only
    assert torch.isfinite(x.grad[0, :5]).all() and torch.isfinite(x.grad[0, 14:]).all()
    start = 0
    for i, n in enumerate(lengths):
        seg = y[0, start : start + n].detach()
        ref, _ = ref_rg_lru(x.detach()[0, start : start + n], *[p.detach() for p in params], None)
        if i == 1:
            assert not torch.isfinite(seg[4:]).all()
        else:
            torch.testing.assert_close(seg.double(), ref, rtol=1e-5, atol=1e-5)
        start += n


@pytest.mark.parametrize(
    "kwargs, match",
    [
        pytest.param({"token_mask": torch.ones(1, 4, dtype=torch.bool)}, "token_mask", id="mask-length"),
        pytest.param({"token_mask": torch.ones(1, 5)}, "bool or integer", id="mask-float"),
        pytest.param({"initial_state": torch.zeros(2, W)}, "initial_state", id="state-batch"),
        pytest.param({"seq_idx": torch.tensor([[0, 1, 0, 1, 1]])}, "seq_idx", id="seq-idx-decreasing"),
        pytest.param({"chunk_size": 6}, "power of two", id="chunk"),
    ],
)
def test_invalid_inputs_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rg_lru(_x(5), *_params(), **kwargs)


@pytest.mark.parametrize(
    "dtype, tol",
    [pytest.param(torch.float64, 1e-12, id="float64"), pytest.param(torch.float32, 1e-5, id="float32"),
     pytest.param(torch.bfloat16, 1e-5, id="bf16-float32-compute")],
)
def test_step_resets_unstarted_rows_and_holds_masked_ones(dtype, tol):
    """One step of four rows: started, not started (a reset: the row's first token alone), and two masked rows
    (NaN inputs) whose state is kept bit for bit; the state is float32 (float64 for float64), as the cache's."""
    params = _params(dtype=dtype)
    x = _x(1, B=4, dtype=dtype)[:, 0]  # [4, W]
    x[2:] = torch.nan
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    state = torch.randn(4, W, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(sdt)
    mask = torch.tensor([True, True, False, False])
    started = torch.tensor([True, False, True, False])
    y, new = rg_lru_step(x, state, *params, token_mask=mask, started=started)
    assert new.dtype == sdt and y.dtype == dtype
    for b, h0 in ((0, state[0]), (1, None)):
        _, ref = ref_rg_lru(x[b][None], *params, h0)
        torch.testing.assert_close(new[b].double(), ref, rtol=tol, atol=tol)
    assert torch.equal(y[:2], new[:2].to(dtype))
    assert torch.equal(new[2:], state[2:])

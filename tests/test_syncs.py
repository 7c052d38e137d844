"""Host syncs: a packed training step costs the same number whatever the depth, and a cached decode step no more
than the stock model's (issue 22). Counted on CPU by ``safepad.testing.syncs`` (a TorchDispatchMode)."""

from __future__ import annotations

import copy

import pytest
import torch

import safepad
from safepad.ops import causal_conv1d, ssd_scan
from safepad.ops.selective_scan import selective_scan
from safepad.testing import tiny_model
from safepad.testing.inputs import ssd_inputs
from safepad.testing.syncs import KIND_FAMILIES, count_syncs, decode_step, depth_overrides, packed_train_step

def _kinds():
    for kind, family in KIND_FAMILIES.items():
        yield pytest.param(family, id=kind.replace(" ", "_").replace("(", "").replace(")", ""))


def _model(family: str, n_layers: int):
    return tiny_model(family, **depth_overrides(family, n_layers))


# ---------------------------------------------------------------------------------------------------------------
# the counter itself
# ---------------------------------------------------------------------------------------------------------------

_x = torch.randn(6)
_m = _x > 0
_v = torch.zeros(int(_m.sum()))  # one value per True of _m
_r = torch.tensor([1, 2, 3])


@pytest.mark.parametrize(
    "fn, op",
    [
        pytest.param(lambda: bool(_m.any()), "aten._local_scalar_dense", id="bool"),
        pytest.param(lambda: _x.sum().item(), "aten._local_scalar_dense", id="item"),
        pytest.param(lambda: int(_r[0]), "aten._local_scalar_dense", id="int"),
        pytest.param(lambda: _x.tolist(), "Tensor.tolist", id="tolist"),
        pytest.param(lambda: torch.equal(_x, _x), "aten.equal", id="equal"),
        pytest.param(lambda: _m.nonzero(), "aten.nonzero", id="nonzero"),
        pytest.param(lambda: torch.where(_m), "aten.nonzero", id="where_1arg"),
        pytest.param(lambda: _x[_m], "aten.index", id="bool_index"),
        # (a tensor of values: torch 2.15 turns `x[mask] = scalar` into masked_fill_, which needs no sync)
        pytest.param(lambda: _x.clone().__setitem__(_m, _v), "aten.index_put_", id="bool_setitem"),
        pytest.param(lambda: torch.repeat_interleave(_r), "aten.repeat_interleave", id="repeat_interleave"),
        pytest.param(lambda: _x.masked_select(_m), "aten.masked_select", id="masked_select"),
    ],
)
def test_counts_each_sync_op(fn, op):
    _, n, ops = count_syncs(fn)
    assert n == 1 and ops[op] == 1, ops


@pytest.mark.parametrize(
    "fn",
    [
        pytest.param(lambda: torch.repeat_interleave(_r, output_size=6), id="repeat_interleave_output_size"),
        pytest.param(lambda: _x.repeat_interleave(2), id="repeat_interleave_int"),
        pytest.param(lambda: torch.where(_m, _x, 0.0), id="where_3arg"),
        pytest.param(lambda: _x[torch.tensor([0, 2])], id="int_index"),
        pytest.param(lambda: torch._assert_async(_m.any() | True), id="assert_async"),
        pytest.param(lambda: (_x.cumsum(0) * _m).softmax(0), id="math"),
    ],
)
def test_sync_free_ops_count_zero(fn):
    assert count_syncs(fn).count == 0


def test_counts_syncs_in_backward():
    class ReadsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * (2 if bool((g > -1e9).all()) else 0)

    x = torch.randn(3, requires_grad=True)
    _, n, ops = count_syncs(lambda: ReadsInBackward.apply(x).sum().backward())
    assert n == 1 and ops["aten._local_scalar_dense"] == 1


# ---------------------------------------------------------------------------------------------------------------
# the targets, for every mixer kind
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(_kinds()))
def test_packed_train_step_syncs_independent_of_depth(family):
    counts = {}
    for n_layers in (2, 8):
        model = safepad.wrap(_model(family, n_layers).train())
        step = packed_train_step(model)
        loss, counts[n_layers], ops = count_syncs(step)
        assert torch.isfinite(loss)
        counts[n_layers, "ops"] = ops
    assert counts[8] <= counts[2] + 2, (counts[2], counts[8], counts[8, "ops"])


@pytest.mark.parametrize("family", list(_kinds()))
def test_decode_step_syncs_at_most_stock(family):
    stock = _model(family, 2)
    _, n_stock, _ = count_syncs(decode_step(stock))
    for n_layers in (2, 8):
        stock_n = _model(family, n_layers)
        wrapped = safepad.wrap(copy.deepcopy(stock_n))
        step = decode_step(wrapped)
        logits, n, ops = count_syncs(step)
        assert n <= n_stock, (n_layers, n, n_stock, ops)
        if n_layers == 2:  # the unread decode mask changes no result: each row alone through the stock model
            with torch.no_grad():
                for b, row in enumerate(step.rows):
                    ref = stock_n(input_ids=row[None], use_cache=False).logits[0, -1]
                    torch.testing.assert_close(logits[b, -1], ref.float(), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("side", [pytest.param("right", id="right_padded"), pytest.param("none", id="unpadded")])
@pytest.mark.parametrize("family", list(_kinds()))
def test_decode_after_right_padded_prefill_syncs_at_most_stock(family, side):
    """A decode step on a cache a right-padded prefill re-laid (rows of 6, 5 and 4 real tokens), or on an unpadded
    one: the re-lay is decided and done on the device (safepad.layout.slots), so no more syncs than stock's step,
    and each row's logits are the row's alone through the stock model."""
    stock = _model(family, 2)
    _, n_stock, _ = count_syncs(decode_step(stock, padding_side=side))
    _, n_deep, ops = count_syncs(decode_step(safepad.wrap(_model(family, 8)), padding_side=side))
    assert n_deep <= n_stock, (8, n_deep, n_stock, ops)  # whatever the depth
    step = decode_step(safepad.wrap(copy.deepcopy(stock)), padding_side=side)
    logits, n, ops = count_syncs(step)
    assert n <= n_stock, (n, n_stock, ops)
    with torch.no_grad():
        for b, row in enumerate(step.rows):
            ref = stock(input_ids=row[None], use_cache=False).logits[0, -1]
            torch.testing.assert_close(logits[b, -1], ref.float(), atol=1e-3, rtol=1e-3)


# ---------------------------------------------------------------------------------------------------------------
# ops called directly (no model hook) still check their inputs; a record does not outlive an in-place write
# ---------------------------------------------------------------------------------------------------------------


def _bad_seq_idx(T: int) -> torch.Tensor:
    s = torch.zeros(1, T, dtype=torch.int32)
    s[0, T // 2 :] = 2
    s[0, -1] = 1  # decreases at the last token
    return s


def test_direct_ssd_scan_still_validates_seq_idx():
    kw = ssd_inputs(1, 32, heads=2, head_dim=4, groups=1, state=4)
    kw.pop("initial_state")
    with pytest.raises(ValueError, match="seq_idx decreases inside row 0"):
        ssd_scan(**kw, chunk_size=16, seq_idx=_bad_seq_idx(32))


def test_direct_conv_revalidates_after_in_place_write():
    x, w = torch.randn(1, 16, 4), torch.randn(4, 4)
    good = torch.zeros(1, 16, dtype=torch.int32)
    good[0, 8:] = 1
    causal_conv1d(x, w, seq_idx=good)  # validated (and recorded as valid)
    _, n, _ = count_syncs(lambda: causal_conv1d(x, w, seq_idx=good))
    assert n == 0  # the record spares the second check
    good[0, -1] = 0  # in place: now decreasing, and the record is void
    with pytest.raises(ValueError, match="decreases"):
        causal_conv1d(x, w, seq_idx=good)


def test_direct_selective_scan_still_checks_sign_of_A():
    B, T, D, N = 1, 8, 4, 3
    u, dt = torch.randn(B, T, D), torch.randn(B, T, D)
    Bm, Cm = torch.randn(B, T, N), torch.randn(B, T, N)
    with pytest.raises(ValueError, match="A must be non-positive"):
        selective_scan(u, dt, torch.rand(D, N) + 0.1, Bm, Cm)

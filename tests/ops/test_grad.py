"""safepad.ops.grad: an identity whose gradient comes back as a fresh contiguous tensor."""

from __future__ import annotations

import pytest
import torch

from safepad.ops.grad import contiguous_grad


def test_forward_is_the_identity_and_the_gradient_a_contiguous_copy() -> None:
    x = torch.randn(2, 5, 3, 4, requires_grad=True)
    y = contiguous_grad(x)
    assert torch.equal(y, x)
    seen = {}

    def grab(g):
        seen["in"] = g

    y.register_hook(grab)
    # a permuted upstream gradient: the layout the chunked scans hand back
    (y * torch.randn(2, 4, 3, 5).permute(0, 3, 2, 1)).sum().backward()
    assert not seen["in"].is_contiguous()
    assert x.grad.is_contiguous()
    assert torch.equal(x.grad, seen["in"])


def test_a_contiguous_gradient_is_copied_too() -> None:
    # a copy even where the layout is already contiguous: under AOT autograd, ``.contiguous()`` is skipped wherever
    # the predicted strides say so, and those predictions are what can be wrong
    x = torch.randn(3, 4, requires_grad=True)
    g = torch.randn(3, 4)
    (grad,) = torch.autograd.grad(contiguous_grad(x), x, g)
    assert torch.equal(grad, g) and grad.data_ptr() != g.data_ptr()


@pytest.mark.parametrize(
    "t", [pytest.param(64, id="one_whole_chunk"), pytest.param(70, id="padded_last_chunk")]
)
@pytest.mark.parametrize("per_channel", [pytest.param(False, id="per_head_g"), pytest.param(True, id="per_channel_g")])
def test_the_chunked_rule_hands_back_contiguous_input_gradients(t: int, per_channel: bool) -> None:
    # one whole chunk: the permute's backward arrived as is (permuted) before; a padded chunk: F.pad's backward copied
    from safepad.ops import chunk_gated_delta_rule

    torch.manual_seed(0)
    B, H, Dk, Dv = 2, 2, 8, 8
    leaves = [torch.randn(B, t, H, d, requires_grad=True) for d in (Dk, Dk, Dv)]
    g = -torch.rand(B, t, H, Dk) if per_channel else -torch.rand(B, t, H)
    leaves += [g.requires_grad_(), torch.rand(B, t, H).requires_grad_()]
    inputs = [x * 1.0 for x in leaves]  # non-leaves: a leaf's .grad is a contiguous copy whatever arrives
    seen = {}
    for name, x in zip("q k v g beta".split(), inputs):
        x.register_hook(lambda grad, name=name: seen.__setitem__(name, grad))
    mask = torch.ones(B, t, dtype=torch.bool)
    mask[0, -3:] = False
    chunk_gated_delta_rule(*inputs, chunk_size=64, use_qk_l2norm=True, token_mask=mask, backend="torch").sum().backward()
    assert sorted(seen) == sorted("q k v g beta".split())
    assert [name for name, grad in seen.items() if not grad.is_contiguous()] == []


@pytest.mark.parametrize(
    "grad_mode, requires_grad",
    [pytest.param(False, True, id="no_grad_mode"), pytest.param(True, False, id="input_without_grad")],
)
def test_no_op_where_no_gradient_can_flow(grad_mode: bool, requires_grad: bool) -> None:
    # a decode step runs under no_grad: the identity must cost nothing there (issue 38: one aten.view per call before)
    from safepad.testing.launches import count_ops

    x = torch.randn(2, 3, requires_grad=requires_grad)
    with torch.set_grad_enabled(grad_mode):
        y, count, ops = count_ops(lambda: contiguous_grad(x))
    assert y is x and count == 0, ops

"""Gradients that come back as a fresh contiguous tensor, under AOT autograd as in eager.

The chunked scans permute their inputs into chunk-major layouts, so the gradients they hand back are permuted
views, and downstream backward code ``view``s them: the stock projections' splits (Qwen3-Next's
``fix_query_key_value_ordering``), a mixer's ``reshape`` to heads. Eager autograd reshapes where a view cannot
be taken. AOT autograd (``torch.compile``, any backend) decides view or copy once, from the strides its meta
functions predict, and with dynamic shapes those predictions can differ from what the kernels produce at run
time. Seen (bailing_hybrid, ``torch.compile(model, backend="aot_eager")``, the second of two packed calls, where the
token count became dynamic): the strides predicted for ``F.pad``'s backward differed between the query gradient
(contiguous) and the key / value gradients (permuted), which eager computes alike; a sum of such gradients was
predicted contiguous and produced permuted, and ``aten.view`` on it raised "view size is not compatible with input
tensor's size and stride".

:func:`contiguous_grad` is an identity whose backward returns ``grad.clone(memory_format=contiguous_format)``,
always a copy: a ``.contiguous()`` would be skipped wherever the prediction says the layout is already
contiguous, which is exactly where the prediction can be wrong. The cost is one copy of the gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["contiguous_grad"]


class _ContiguousGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.clone(memory_format=torch.contiguous_format)


def contiguous_grad(x: Tensor) -> Tensor:
    """``x`` unchanged (any shape); its gradient comes back as a new contiguous tensor of the same shape.

    Where no gradient can flow (grad mode off, as in ``generate`` and every decode step, or ``x`` not requiring
    grad) this is ``x`` itself: no autograd node, no op dispatched."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return x
    return _ContiguousGrad.apply(x)

"""Differentiable collectives over a process group (autograd.Function with the reverse exchange in backward).

* :func:`all_gather_stack`: every rank's tensor, stacked ``[world, ...]``. Backward: each rank's
  contribution receives the sum over ranks of the gradients flowing into its slot (an all-reduce of the
  stacked gradient, then this rank's slice; gloo has no reduce-scatter).
* :func:`sum_replicated`: the sum over ranks of a per-rank value, replicated on every rank, with an
  identity backward. That is the right derivative when every rank backpropagates the same replicated total
  ``L = sum_r L_r``: ``dL / dL_r = 1`` and only rank ``r`` holds ``L_r``'s graph.

Every rank of the group must make the same calls in the same order, forward and backward (they do: the
ranks run the same model on same-shaped shards).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["all_gather_stack", "sum_replicated", "sum_over_group"]


class _AllGatherStack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group, rank: int, world: int) -> Tensor:
        ctx.group, ctx.rank = group, rank
        x = x.contiguous()
        if x.is_cuda:  # NCCL: one buffer
            out = x.new_empty(world, *x.shape)  # [world, ...]
            dist.all_gather_into_tensor(out, x, group=group)
            return out
        parts = [torch.empty_like(x) for _ in range(world)]  # gloo has no all_gather_into_tensor
        dist.all_gather(parts, x, group=group)
        return torch.stack(parts)  # [world, ...]

    @staticmethod
    def backward(ctx, g: Tensor):
        g = g.contiguous().clone()  # [world, ...]
        dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ctx.group)
        return g[ctx.rank], None, None, None


def all_gather_stack(x: Tensor, group, rank: int, world: int) -> Tensor:
    """``x`` ``[...]`` of every rank, stacked ``[world, ...]`` (rank order), differentiable."""
    return _AllGatherStack.apply(x, group, rank, world)


class _SumReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group, grad_scale: float) -> Tensor:
        ctx.grad_scale = grad_scale
        out = x.detach().clone().contiguous()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        return (g if ctx.grad_scale == 1.0 else g * ctx.grad_scale), None, None


def sum_replicated(x: Tensor, group, grad_scale: float = 1.0) -> Tensor:
    """Sum of ``x`` over the ranks of ``group`` (replicated); backward is the identity (see module doc), times
    ``grad_scale`` (the group size when a DDP / FSDP wrapper averages the gradients over the same ranks)."""
    return _SumReplicated.apply(x, group, grad_scale)


def sum_over_group(x: Tensor, group) -> Tensor:
    """Non-differentiable in-place-free sum over ``group`` (bookkeeping: token counts, checksums)."""
    out = x.detach().clone().contiguous()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out

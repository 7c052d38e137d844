"""Keep a non-finite value inside the packed sequence it belongs to.

The chunked scans mix the tokens of a chunk (or a whole row) in matmuls and parallel scans whose
cross-sequence weights are exact zeros. ``0 * nan`` is ``nan``, so a NaN / inf in one packed sequence would
reach every later sequence of its row through those zero weights, although each of them, run alone, is
finite. Masking by multiplication cannot stop it; selection can:

1. :func:`isolate_nonfinite` finds the tokens with a non-finite input (``bad`` ``[B, T]``), replaces those
   tokens' inputs by zeros with ``torch.where`` (so every product in the scan is finite), and returns the
   tokens that a non-finite input reaches inside their own sequence: each bad token and every later token
   of the same sequence (``poison`` ``[B, T]``), as the token-by-token recurrence would.
2. :func:`poison` puts NaN back at exactly those tokens' outputs (and at the states they leave), so a
   sequence with a NaN still reads NaN, and no other sequence changes by a single bit.

Gradients: the selected-away inputs pass no gradient, so with a loss that leaves the NaN sequence out
(a zero gradient at its outputs) nothing non-finite reaches the other sequences' gradients either.

Cost, only for packed calls (``seq_idx`` given): a per-token ``isfinite`` reduction and one ``where`` per input,
a cumulative count over ``[B, T]`` and an add on the output, on every device and under ``torch.compile`` alike.
Nothing is read on the host: deciding first whether everything is finite would cost a sync per scan (per
layer), which stalls an accelerator's stream and breaks CUDA-graph capture.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["isolate_nonfinite", "poison", "poison_rows"]


def _bad_tokens(t: Tensor) -> Tensor:
    """``[B, T]`` bool: the token has a non-finite entry in ``t`` ``[B, T, ...]``.

    A sum is finite only if every summand is (NaN propagates, inf + finite = inf, inf - inf = NaN), and a
    float64 sum of fp32 / bf16 / fp16 entries cannot overflow, so one float64 reduction per token answers it
    exactly, in one read pass (``isfinite`` then ``all`` costs about five). fp64 inputs, whose finite sum could
    overflow, take ``isfinite``.
    """
    if t.dim() == 2:
        return ~torch.isfinite(t)
    if t.dtype == torch.float64:
        return ~torch.isfinite(t).flatten(2).all(-1)
    return ~torch.isfinite(t.flatten(2).sum(-1, dtype=torch.float64))


def _keep(t: Tensor, bad: Tensor) -> Tensor:
    """``t`` ``[B, T, ...]`` with the ``bad`` ``[B, T]`` tokens set to zero (selection, not a multiply)."""
    return torch.where(bad.view(*bad.shape, *([1] * (t.dim() - 2))), torch.zeros((), dtype=t.dtype, device=t.device), t)


def isolate_nonfinite(
    seq_idx: Tensor, tensors: list[Tensor], initial_state: Tensor | None = None
) -> tuple[list[Tensor], Tensor | None, Tensor]:
    """Zero the tokens with a non-finite input and find the outputs a NaN must reach.

    Args:
        seq_idx: ``[B, T]`` int, the packed boundaries (non-decreasing per row).
        tensors: the per-token inputs of one scan, each ``[B, T, ...]``.
        initial_state: ``[B, ...]`` | None; a non-finite initial state counts as a bad first token of its row
            (it reaches only the row's first sequence) and is zeroed.

    Returns:
        ``(tensors with bad tokens zeroed, initial_state likewise, poison [B, T] bool)``.
    """
    bad = _bad_tokens(tensors[0])
    for t in tensors[1:]:
        bad = bad | _bad_tokens(t)
    if initial_state is not None:
        bad_init = ~torch.isfinite(initial_state).flatten(1).all(-1)  # [B]
        bad = bad.clone()
        bad[:, 0] |= bad_init
        zero = torch.zeros((), dtype=initial_state.dtype, device=initial_state.device)
        keep_shape = (-1, *([1] * (initial_state.dim() - 1)))
        initial_state = torch.where(bad_init.view(keep_shape), zero, initial_state)
    clean = [_keep(t, bad) for t in tensors]
    # poison[t]: a bad token at or before t inside t's sequence (cumulative count since the sequence start)
    cs = bad.cumsum(1)  # [B, T] bad tokens up to and including t
    start = torch.ones_like(bad)
    start[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]  # [B, T] first token of a sequence
    before = torch.where(start, cs - bad.to(cs.dtype), torch.zeros_like(cs))  # count before each sequence start
    base = torch.cummax(before, dim=1).values  # [B, T] the count before t's sequence started (cs is monotone)
    return clean, initial_state, cs > base


def _nan_where(poisoned: Tensor, dtype: torch.dtype) -> Tensor:
    """NaN where ``poisoned``, else exactly 0 (added, so that the backward is the identity: no extra pass)."""
    return torch.where(
        poisoned, torch.full((), float("nan"), dtype=dtype, device=poisoned.device),
        torch.zeros((), dtype=dtype, device=poisoned.device),
    )


def poison(y: Tensor, poisoned: Tensor) -> Tensor:
    """``y`` ``[B, T, ...]`` with NaN at the ``poisoned`` ``[B, T]`` tokens (``y + 0`` elsewhere: unchanged)."""
    return y + _nan_where(poisoned, y.dtype).view(*poisoned.shape, *([1] * (y.dim() - 2)))


def poison_rows(state: Tensor, poisoned: Tensor) -> Tensor:
    """``state`` ``[S, ...]`` with NaN where ``poisoned`` ``[S]`` (states left by a poisoned token)."""
    return state + _nan_where(poisoned, state.dtype).view(-1, *([1] * (state.dim() - 1)))

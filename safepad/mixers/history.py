"""The recurrent-state history a cache that records its past asks a multi-token call for (transformers >= 5.25).

Assisted and speculative generation verify several draft tokens in one call, then ``crop`` the rejected ones off the
cache. A recurrent state cannot be cut back, so transformers 5.25 lets a linear-attention cache layer record it:
``activate_past_recording(recurrent_states_to_keep=N)``, after which a call of ``T`` tokens hands
``update_recurrent_state`` the list of the states after each of its last ``min(N, T)`` tokens (oldest first) and the
layer keeps them, with the state before the call, so that ``crop(-n)`` restores the state after token ``T - 1 - n``.
The stock mixers get that list by running their chunked scan on the first ``T - N`` tokens and a single-token step
on each of the last ``N``.

Here the call runs as one scan, as without recording (same outputs), and each earlier state of the list comes from
the same scan run again with the tokens after that column masked out: a masked token leaves a row's state as it
is, so the final state of such a run is the state after that column, in the caller's column order (a compacted
row is masked through its :class:`~safepad.layout.masks.Compaction` index), with pads and packed boundaries as the
call has them. This costs ``N - 1`` extra scans of the call, only while a cache records its past (the verification
call of assisted generation holds ``N + 1`` tokens; an assistant model's prefill holds the prompt).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor

from .._tracing import require
from ..cache import is_recording
from .common import Layout

logger = logging.getLogger(__name__)

__all__ = ["states_to_keep", "state_history"]


def states_to_keep(cache, layer_idx: int, T: int) -> int:
    """How many of a ``T``-token call's last states to hand a cache layer that records its past (0: it records
    nothing; T = 1 needs no list: the layer keeps the state before the step itself).

    One more than the layer's ``recurrent_states_to_keep`` N, up to T: the layer keeps the state before the call
    and the list less its last element, so ``crop(-n)`` finds the state after column ``T - 1 - n`` for every
    ``n <= N`` only with N + 1 states. With N (what the stock mixers hand), a verification call of N + 1 tokens
    (prompt lookup: the current token and N candidates) loses the state after its first token, and rejecting every
    candidate restores the state before the call: prompt-lookup decoding then departs from greedy (stock
    Nemotron-H, transformers 5.25).
    """
    if cache is None or T <= 1 or not is_recording(cache, layer_idx):
        return 0
    keep = getattr(cache, "get_recurrent_states_to_keep", None)  # transformers >= 5.25
    if keep is None:
        return 0
    n = int(keep(layer_idx) or 0)
    return min(n + 1, T) if n > 0 else 0


def state_history(
    layout: Layout, T: int, keep: int, final: Tensor, run: Callable[[Tensor], Tensor]
) -> Tensor | list[Tensor]:
    """``final`` (``keep`` = 0), or the states after each of the call's last ``keep`` columns, oldest first.

    Args:
        layout: the call's layout (its mask ``[B, T]`` and compaction, in the order the scan sees the tokens).
        T: the call's columns.
        keep: :func:`states_to_keep`.
        final: the state after the whole call (the last element of the list).
        run: ``run(token_mask)`` -> the final state of the call's scan with ``token_mask`` ``[B, T]`` bool (in the
            scan's token order) instead of the call's own mask.
    """
    if keep <= 0:
        return final
    mask = layout.mask
    B = final.shape[0]
    device = mask.device if mask is not None else final.device
    if layout.compaction is not None:
        cols = layout.compaction.index.to(device)  # [B, T]: the caller's column of each compacted slot
    else:
        cols = torch.arange(T, device=device).expand(B, T)  # [B, T]
    real = mask if mask is not None else torch.ones(B, T, dtype=torch.bool, device=device)
    if mask is not None:
        caller = torch.zeros_like(real).scatter(1, cols, real)  # [B, T] the mask in the caller's column order
        pad_after_real = ~caller & (caller.cumsum(1) > 0)  # [B, T]: a pad some real token of its row precedes
        require(
            ~pad_after_real[:, T - keep + 1 :].any(),  # the columns crop can drop (left pads before a row are fine)
            "a cache recording its past for crop (assisted generation) got a call whose rows end in pads; crop(-n) "
            "drops a call's last n columns, which must be real tokens: pad on the left",
        )
    states = [run(real & (cols <= t)) for t in range(T - keep, T - 1)]
    return [*states, final]

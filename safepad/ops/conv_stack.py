"""Varlen causal stack of (grouped) convolutions, ZAYA-CCA style: each token's output is the valid-mode result of
``conv_L(...conv_1(window))`` over its ``Kc + 1`` input window (``Kc = sum(K_i - 1)``), with the inputs before the
row coming from a cached state and inputs of another packed sequence read as zeros.

For one sequence alone this is exactly ``conv_L(...conv_1(pad_left(x, Kc)))`` with ``padding=0`` (what the stock
ZAYA module computes, biases included: the first layer's bias reaches the second layer even over the zero padding).
The convs may be grouped (not depthwise), so no per-channel recurrence exists; the windows are gathered explicitly
(``[B * T, C, Kc + 1]``, small for the 2-3 tap kernels this serves) and the convs run on them in one batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from safepad._tracing import require
from safepad.layout.boundaries import validate_seq_idx
from safepad.layout.masks import pads_before_real

__all__ = ["causal_conv_stack"]


def causal_conv_stack(
    x: Tensor,
    layers: Sequence[tuple[Tensor, Tensor | None, int]],
    *,
    seq_idx: Tensor | None = None,
    initial_state: Tensor | None = None,
    token_mask: Tensor | None = None,
    return_final_state: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Stacked causal convs over packed / right-padded rows.

    Args:
        x: ``[B, T, C]`` inputs.
        layers: ``(weight [C, C / groups, K], bias [C] or None, groups)`` per conv, applied in order.
        seq_idx: ``[B, T]`` int, non-decreasing per row: a window never reads another sequence's inputs.
        initial_state: ``[B, C, Kc]`` the ``Kc`` inputs before each row (oldest first), or None (zeros); it reaches
            only each row's first sequence.
        token_mask: ``[B, T]`` bool, right-padded (True = real token): pads are zeroed and not part of the state.
        return_final_state: also return ``[B, C, Kc]``: the last ``Kc`` real inputs of ``[initial_state ‖ x]``.

    Returns:
        ``y`` ``[B, T, C]`` (pads: unspecified), or ``(y, final_state)``.
    """
    if not isinstance(x, Tensor) or x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor [B, T, C], got {getattr(x, 'shape', type(x).__name__)}")
    if not layers:
        raise ValueError("layers must hold at least one (weight, bias, groups) conv")
    B, T, C = x.shape
    Kc = sum(int(w.shape[-1]) - 1 for w, _, _ in layers)
    if initial_state is not None and tuple(initial_state.shape) != (B, C, Kc):
        raise ValueError(
            f"initial_state must have shape [B, C, Kc] = [{B}, {C}, {Kc}], got {tuple(initial_state.shape)}"
        )
    if seq_idx is not None:
        seq_idx = validate_seq_idx(seq_idx, (B, T))
    if token_mask is not None:
        if tuple(token_mask.shape) != (B, T):
            raise ValueError(f"token_mask must have shape [B, T] = [{B}, {T}], got {tuple(token_mask.shape)}")
        token_mask = token_mask.to(torch.bool)
    prev = x.new_zeros(B, C, Kc) if initial_state is None else initial_state.to(x.dtype)
    if T == 1:
        return _one_token(x, layers, prev, token_mask, return_final_state)
    if token_mask is not None:
        msg = "token_mask must be right-padded (real tokens first); compact left pads / holes first"
        require(~pads_before_real(token_mask).any(), msg)  # on the device under torch.compile
        x = x * token_mask[..., None]  # (bool: promoted inside the one multiply)
    ctx = torch.cat([prev, x.transpose(1, 2)], dim=-1)  # [B, C, Kc + T]
    W = Kc + 1
    win = ctx.unfold(-1, W, 1)  # [B, C, T, W]
    if seq_idx is not None:
        first = seq_idx[:, :1].expand(B, Kc)  # the state columns belong to each row's first sequence
        ctx_seq = torch.cat([first, seq_idx], dim=1)  # [B, Kc + T]
        same = ctx_seq.unfold(-1, W, 1) == seq_idx[..., None]  # [B, T, W]
        win = win * same[:, None].to(win.dtype)
    h = win.permute(0, 2, 1, 3).reshape(B * T, C, W)  # [B * T, C, W]
    for weight, bias, groups in layers:
        h = F.conv1d(h, weight.to(h.dtype), None if bias is None else bias.to(h.dtype), groups=groups)
    y = h.view(B, T, C)  # [B * T, C, 1] -> [B, T, C]
    if not return_final_state:
        return y
    n = token_mask.sum(1) if token_mask is not None else torch.full((B,), T, device=x.device)  # [B]
    idx = (n[:, None] + torch.arange(Kc, device=x.device)[None]).long()  # [B, Kc]: the last Kc real ctx columns
    return y, ctx.gather(-1, idx[:, None, :].expand(B, C, Kc))


def _one_token(
    x: Tensor, layers: Sequence[tuple[Tensor, Tensor | None, int]], prev: Tensor, token_mask: Tensor | None,
    return_final_state: bool,
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`causal_conv_stack` of one token (a decode step): its window is ``[prev || x]`` itself, so the convs run
    on it as it is (no unfold / re-lay), and the new state is that window without its oldest column; a masked token
    (``token_mask`` ``[B, 1]`` False) leaves its row's state as it was (its output is unspecified, as at any pad, and
    one seq_idx cannot hold a boundary). ``x`` ``[B, 1, C]``, ``prev`` ``[B, C, Kc]``."""
    B, _, C = x.shape
    ctx = torch.cat([prev, x.transpose(1, 2)], dim=-1)  # [B, C, Kc + 1]: the token's whole window
    h = ctx
    for weight, bias, groups in layers:
        h = F.conv1d(h, weight.to(h.dtype), None if bias is None else bias.to(h.dtype), groups=groups)
    y = h.view(B, 1, C)  # [B, C, 1] -> [B, 1, C]
    if not return_final_state:
        return y
    state = ctx[:, :, 1:]  # [B, C, Kc]
    if token_mask is not None:
        state = torch.where(token_mask.view(B, 1, 1), state, prev)  # a masked token is not part of the state
    return y, state

"""Varlen causal convolution with per-token taps (Inkling2's dynamic short convolution), plus its decode step.

Per channel ``d`` and token ``t`` (lag 0 is the current token)::

    y_t[d] = sum_{l=0}^{K-1} taps_t[d, l] * x_{t-l}[d]

where ``x_{t-l}`` is zero before the row's first token (or comes from ``initial_state``, the K inputs before the
row, oldest first) and zero across a ``seq_idx`` boundary. ``token_mask`` marks the real tokens of right-padded
rows: pads are zeroed, never read by a real token, and the final state holds each row's last K *real* inputs.
A decode step is the same call with ``T = 1``.

Plain torch (unfold over ``[state ‖ x]``), differentiable; ``K`` is small (4 in Inkling2), so the ``[B, T, D, K]``
window tensor costs what the taps already cost.
"""

from __future__ import annotations

import torch
from torch import Tensor

from safepad._tracing import require
from safepad.layout.boundaries import validate_seq_idx
from safepad.layout.masks import pads_before_real

__all__ = ["dynamic_causal_conv1d"]


def _check(x: Tensor, taps: Tensor, initial_state: Tensor | None, token_mask: Tensor | None) -> Tensor | None:
    if not isinstance(x, Tensor) or x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor [B, T, D], got {getattr(x, 'shape', type(x).__name__)}")
    B, T, D = x.shape
    if not isinstance(taps, Tensor) or taps.dim() != 4 or tuple(taps.shape[:3]) != (B, T, D):
        raise ValueError(f"taps must have shape [B, T, D, K] = [{B}, {T}, {D}, K], got {getattr(taps, 'shape', None)}")
    K = taps.shape[-1]
    if initial_state is not None and tuple(initial_state.shape) != (B, D, K):
        raise ValueError(f"initial_state must have shape [B, D, K] = [{B}, {D}, {K}], got {tuple(initial_state.shape)}")
    if token_mask is None:
        return None
    if tuple(token_mask.shape) != (B, T):
        raise ValueError(f"token_mask must have shape [B, T] = [{B}, {T}], got {tuple(token_mask.shape)}")
    m = token_mask.to(torch.bool)
    msg = (
        "token_mask must be right-padded (real tokens first, then pads); compact left pads / holes first "
        "(safepad.layout.masks.Compaction)"
    )
    if T > 1:  # one token is right-padded as it is (and a decode step reads nothing on the host)
        require(~pads_before_real(m).any(), msg)  # on the device under torch.compile
    return m


def dynamic_causal_conv1d(
    x: Tensor,
    taps: Tensor,
    *,
    seq_idx: Tensor | None = None,
    initial_state: Tensor | None = None,
    token_mask: Tensor | None = None,
    return_final_state: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Causal conv with per-token taps over packed / right-padded rows.

    Args:
        x: ``[B, T, D]`` inputs.
        taps: ``[B, T, D, K]`` weights, ``taps[..., l]`` weighting the token ``l`` steps back.
        seq_idx: ``[B, T]`` int, non-decreasing per row: windows never reach across a change.
        initial_state: ``[B, D, K]`` the K inputs before each row (oldest first), or None (zeros). It reaches only
            each row's first sequence.
        token_mask: ``[B, T]`` bool, right-padded (True = real token), or None.
        return_final_state: also return ``[B, D, K]``: the last K real inputs of ``[initial_state ‖ x]``.

    Returns:
        ``y`` ``[B, T, D]`` in the promoted dtype of ``x`` and ``taps`` (pads: 0), or ``(y, final_state)``.
    """
    mask = _check(x, taps, initial_state, token_mask)
    B, T, D = x.shape
    K = taps.shape[-1]
    if seq_idx is not None:
        seq_idx = validate_seq_idx(seq_idx, (B, T))
    if mask is not None:
        x = x * mask[..., None].to(x.dtype)  # pads contribute nothing
    prev = x.new_zeros(B, D, K) if initial_state is None else initial_state.to(x.dtype)
    ctx = torch.cat([prev, x.transpose(1, 2)], dim=-1)  # [B, D, K + T]
    windows = ctx[..., 1:].unfold(-1, K, 1).flip(-1)  # [B, D, T, K]: windows[..., l] is token t - l
    windows = windows.permute(0, 2, 1, 3)  # [B, T, D, K]
    if seq_idx is not None:
        first = seq_idx[:, :1].expand(B, K - 1)  # the state columns belong to each row's first sequence
        ctx_seq = torch.cat([first, seq_idx], dim=1)  # [B, K - 1 + T]
        win_seq = ctx_seq.unfold(-1, K, 1).flip(-1)  # [B, T, K]
        same = (win_seq == seq_idx[..., None]).to(windows.dtype)  # [B, T, K]
        windows = windows * same[:, :, None, :]
    y = (windows * taps).sum(-1)  # [B, T, D]
    if mask is not None:
        y = y * mask[..., None].to(y.dtype)
    if not return_final_state:
        return y
    n = mask.sum(1) if mask is not None else torch.full((B,), T, device=x.device)  # [B] real tokens per row
    idx = (n[:, None] + torch.arange(K, device=x.device)[None]).long()  # [B, K]: ctx columns n .. n + K - 1
    final = ctx.gather(-1, idx[:, None, :].expand(B, D, K))  # [B, D, K]
    return y, final

"""The generic padding-correct CCA projection of ZAYA (compressed convolutional attention, transformers 5.23-5.24).

``ZayaCCAProjection`` turns hidden states into attention q / k / v::

    qk = [q_proj(x) | k_proj(x)]  -> depthwise conv (K0, bias) -> grouped conv (K1, one group per head, bias)
    q  = conv(qk)[:q] + (q + repeat(k)) / 2          k = conv(qk)[q:] + mean over the head group of the same
    v  = [v_proj_current(x_t) | v_proj_delayed(x_{t-1})]   (a one-token delayed half; v_proj_delayed(0) at a start)

Its cache keeps the last ``K0 - 1 + K1 - 1`` conv inputs ``qk`` (conv state) and the last token's delayed value
projection (recurrent state). The stock module takes both from the last columns of the padded row, lets both
cross packed boundaries, and delays the value across pads. Here the convs run on
:func:`safepad.ops.conv_stack.causal_conv_stack` (each token's ``K0 + K1 - 1`` input window, other sequences read as
zeros, exactly as the stock zero padding does for a sequence alone), rows are compacted so that pads are never
read, the delayed value restarts at every sequence start, and the states are each row's last real ones.
Shapes: ``B`` batch, ``T`` tokens, ``C`` conv channels.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cache import read_states, write_states
from ..ops.conv_stack import causal_conv_stack
from .common import pop_cache, prepare_layout

__all__ = ["cca_projection_forward"]


def cca_projection_forward(self, hidden_states: Tensor, cache=None, conv_mask: Tensor | None = None, **kwargs):
    """Padding/packing-correct ZAYA CCA projection: ``hidden_states [B, T, hidden]`` -> (q, k, v) ``[B, T, h, d]``."""
    cache = pop_cache(cache, kwargs)
    x, layout = prepare_layout(self, hidden_states, conv_mask, cache, kwargs)
    mask = layout.mask
    if mask is not None:
        x = x * mask[..., None]  # pads contribute nothing (bool mask: promoted inside the one multiply)
    B, T = x.shape[:2]
    d = self.head_dim
    past = read_states(cache, self.layer_idx)

    q = self.q_proj(x)  # [B, T, Hq * d]
    k = self.k_proj(x)  # [B, T, Hk * d]
    qk = torch.cat([q, k], dim=-1)  # [B, T, C]
    g = self.num_key_value_groups
    # each query head plus its key head, broadcast over the head group (the values of repeat_interleave, not a copy)
    qk_res = (q.view(B, T, -1, g, d) + k.view(B, T, -1, 1, d)) * 0.5  # [B, T, Hk, g, d]
    q_res = qk_res.view(B, T, -1, d)  # [B, T, Hq, d]
    k_res = qk_res.mean(dim=-2)  # [B, T, Hk, d]

    convs = [(c.weight, c.bias, c.groups) for c in (self.conv_qk_depthwise, self.conv_qk_grouped)]
    out = causal_conv_stack(
        qk, convs, seq_idx=layout.seq_idx, initial_state=past.conv, token_mask=mask,
        return_final_state=cache is not None,
    )
    conv, conv_state = out if cache is not None else (out, None)  # [B, T, C], [B, C, Kc]
    n_q = q_res.shape[-2] * d
    query = conv[..., :n_q].view(B, T, -1, d) + q_res
    key = conv[..., n_q:].view(B, T, -1, d) + k_res

    v_cur = self.v_proj_current(x)  # [B, T, Hk * d / 2]
    v_del = self.v_proj_delayed(x)  # [B, T, Hk * d / 2]
    restarts = layout.seq_idx is not None and T > 1
    start = None
    if past.recurrent is None or restarts:  # "no previous token": only where some sequence starts
        start = self.v_proj_delayed(x.new_zeros(B, 1, x.shape[-1]))  # [B, 1, Hk * d / 2]
    first = start if past.recurrent is None else past.recurrent[:, None].to(v_del.dtype)  # [B, 1, Hk * d / 2]
    shifted = first if T == 1 else torch.cat([first, v_del[:, :-1]], dim=1)  # [B, T, Hk * d / 2]
    if restarts:
        new_seq = torch.zeros(B, T, dtype=torch.bool, device=x.device)
        new_seq[:, 1:] = layout.seq_idx[:, 1:] != layout.seq_idx[:, :-1]  # [B, T] first token of a later sequence
        shifted = torch.where(new_seq[..., None], start.expand_as(shifted), shifted)
    value = torch.cat([v_cur, shifted], dim=-1).view(B, T, -1, d)  # [B, T, Hk, d]

    if cache is not None and T == 1:  # a decode step: its token's, or the held one where the token is masked
        v_last = v_del[:, 0]  # [B, Hk * d / 2]
        if past.recurrent is not None and mask is not None:
            v_last = torch.where(mask, v_last, past.recurrent.to(v_last.dtype))  # mask [B, 1]
    elif cache is not None:
        n = mask.sum(1) if mask is not None else torch.full((B,), T, device=x.device)  # [B] real tokens per row
        last = (n - 1).clamp(min=0).long()  # [B]
        v_last = v_del.gather(1, last.view(B, 1, 1).expand(B, 1, v_del.shape[-1]))[:, 0]  # [B, Hk * d / 2]
        if past.recurrent is not None:
            v_last = torch.where((n > 0)[:, None], v_last, past.recurrent.to(v_last.dtype))  # masked rows: hold
    if cache is not None:
        write_states(cache, self.layer_idx, tokens=T, conv=conv_state, recurrent=v_last)
    return layout.restore(query), layout.restore(key), layout.restore(value)

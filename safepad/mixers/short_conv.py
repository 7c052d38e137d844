"""The generic padding-correct gated short-convolution mixer (LFM2).

Structure (transformers 5.23 ``Lfm2ShortConv``)::

    in_proj(x) -> [b | c | x'] -> causal depthwise conv(b * x') -> c * conv -> out_proj

The only recurrent state is the conv state: the last ``K`` conv inputs ``b * x'`` of each row. The stock
mixer caches the last ``K`` columns of the padded row (pads included) and lets the conv window reach across
packed boundaries; here the conv runs on :func:`safepad.ops.conv.causal_conv1d` with ``seq_idx``, the
token mask and the cached state, and the cached state is each row's last ``K`` *real* inputs.

Spec ``options``: ``in_proj`` / ``conv`` / ``out_proj`` attribute names (defaults as in LFM2) and
``activation`` (``None`` for LFM2). Shapes: ``B`` batch, ``T`` tokens, ``D`` hidden size, ``K`` conv width.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from ..cache import read_states, write_states
from .common import cached_conv, cached_conv_step, hold_masked_rows, pop_cache, prepare_layout

logger = logging.getLogger(__name__)

__all__ = ["short_conv_mixer_forward"]


def short_conv_mixer_forward(
    self, hidden_states: Tensor, past_key_values=None, attention_mask: Tensor | None = None, **kwargs
) -> Tensor:
    """Padding/packing-correct forward of a gated short-conv mixer. ``hidden_states [B, T, D]`` -> same."""
    opts = self._safepad_spec.options
    backend = self._safepad.backend
    cache = pop_cache(past_key_values, kwargs)
    hidden_states, layout = prepare_layout(self, hidden_states, attention_mask, cache, kwargs)
    T = hidden_states.shape[1]
    dtype = hidden_states.dtype
    mask = layout.mask
    activation = opts.get("activation")
    conv = getattr(self, opts.get("conv", "conv"))

    if mask is not None:
        hidden_states = torch.where(mask[..., None], hidden_states, 0.0)  # pads contribute nothing (even a NaN)
    bcx = getattr(self, opts.get("in_proj", "in_proj"))(hidden_states)  # [B, T, 3 * D]
    b, c, x = bcx.chunk(3, dim=-1)  # [B, T, D] each
    u = b * x  # [B, T, D] conv input
    past = read_states(cache, self.layer_idx, recurrent=False)

    if past.has_previous and T == 1:
        y, conv_new = cached_conv_step(u, conv, past, activation=activation, backend=backend)  # [B, 1, D], [B, D, K]
        write_states(
            cache, self.layer_idx, tokens=1, conv=hold_masked_rows(mask, conv_new, past.conv), inputs=u, token_mask=mask
        )
    else:
        y, conv_final = cached_conv(
            u, conv, layout, past, activation=activation, want_state=cache is not None, backend=backend
        )  # [B, T, D], [B, D, K]
        if conv_final is not None:
            write_states(cache, self.layer_idx, tokens=T, conv=conv_final, inputs=u, token_mask=mask)
    out = getattr(self, opts.get("out_proj", "out_proj"))((c * y).to(dtype))  # [B, T, D]
    return layout.restore(out)

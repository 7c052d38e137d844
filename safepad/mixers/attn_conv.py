"""The generic padding-correct short convolutions of Inkling / Inkling2 (inside attention and on the residual stream).

transformers 5.23-5.24 ``InklingShortConvolution`` / ``Inkling2ShortConvolution`` / ``Inkling2Loop...``::

    y = (depthwise causal conv(x * mask) + x) * scale          # scale 1 (Inkling) or 1 / sqrt(K + 1) (Inkling2)

and ``Inkling2DynamicShortConvolution`` (keys / values of the full-attention layers)::

    taps_t = static_weight + weight_proj(dynamic_input_t)       # per key/value head, K taps per token
    y = (sum_l taps_t[l] * x_{t-l} + x) / sqrt(2K + 1)

Each keeps one conv state ``[B, D, K]`` in cache layer ``layer_idx + cache_offset`` at ``state_idx = conv_idx``
(the layer's other states belong to the other convolutions). The stock modules cache the last K columns of the
padded row (pads included); here the conv runs over compacted rows with ``seq_idx`` and the token mask, and the
cached state is each row's last K *real* inputs. Everything is computed in float32, as the stock modules do.
Inkling's attention measures relative positions (and its sliding window) in cache slots: the wrapped model's hook
keeps every cached row's real tokens contiguous at the end of the cache (:mod:`safepad.layout.slots`), so a cached
call reaches these convolutions with pads only before real tokens (and their own token mask in the call context).
A cached call with pads after real tokens that bypassed that hook raises.
Shapes: ``B`` batch, ``T`` tokens, ``D`` channels, ``H`` key/value heads, ``K`` conv width.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._tracing import require
from ..cache import read_states, write_states
from ..ops.dynamic_conv import dynamic_causal_conv1d
from ..layout.masks import normalize_mask, pads_after_real
from .common import cached_conv, cached_conv_step, hold_masked_rows, pop_cache, prepare_layout

__all__ = ["attention_conv_forward"]


def _taps(self, dynamic_input: Tensor) -> Tensor:
    """Per-token taps ``[B, T, D, K]`` (lag 0 = the current token) of a dynamic short convolution."""
    B, T = dynamic_input.shape[:2]
    H, K = self.num_heads, self.conv_kernel_size
    dyn = self.weight_proj(dynamic_input).float().view(B, T, H, 1, K)  # [B, T, H, 1, K]
    static = self.static_weight.float().T.reshape(H, -1, K)  # [K, D] -> [H, D / H, K]
    return (static + dyn).reshape(B, T, -1, K)  # [B, T, H, D / H, K] -> [B, T, D, K]


def attention_conv_forward(
    self,
    hidden_states: Tensor,
    dynamic_input: Tensor | None = None,
    cache=None,
    conv_mask: Tensor | None = None,
    cache_offset: int = 0,
    **kwargs,
) -> Tensor:
    """Padding/packing-correct forward of an Inkling short convolution. ``hidden_states [B, T, D]`` -> same."""
    backend = self._safepad.backend
    cache = pop_cache(cache, kwargs)
    input_dtype = hidden_states.dtype
    dynamic = hasattr(self, "static_weight")
    layer = self.layer_idx + cache_offset
    x = hidden_states.float()  # [B, T, D]
    if dynamic:
        if dynamic_input is None:
            raise ValueError(f"{type(self).__name__}: a dynamic short convolution needs dynamic_input [B, T, C]")
        both = torch.cat([x, dynamic_input.to(x.dtype)], dim=-1)  # compact both with one layout
        both, layout = prepare_layout(self, both, conv_mask, cache, kwargs)
        x, dyn_in = both.split([x.shape[-1], dynamic_input.shape[-1]], dim=-1)
    else:
        x, layout = prepare_layout(self, x, conv_mask, cache, kwargs)
    mask = layout.mask
    m = normalize_mask(conv_mask, x.shape[:2]) if cache is not None and mask is not None and x.shape[1] > 1 else None
    if m is not None:  # (eager: one host read; traced: checked on the device, no graph break)
        require(
            ~pads_after_real(m).any(),
            f"{type(self).__name__} (layer {layer}): a padded row whose pads are not all on the left (right padding "
            "or holes) came with a cache that safepad did not re-lay. This model's attention takes its relative "
            "positions from cache slots, which safepad keeps right by re-laying each row [pads | real tokens] in the "
            "wrapped model's eager pre-hook; a layer called directly skips it, and so does the model compiled whole "
            "(torch.compile(model)), whose traced pre-hook cannot re-lay a call of several tokens. Pad on the left "
            "(tokenizer.padding_side = 'left'), call without a cache, call the wrapped model itself, or compile its "
            "forward only (model.forward = torch.compile(model.forward): the pre-hook then runs eagerly).",
            f"{type(self).__name__}: right pads or holes came with a cache safepad did not re-lay; pad left, drop "
            "the cache, or compile model.forward only (docs/limits.md, check D6)",
        )
    if mask is not None:
        x = x * mask[..., None]  # pads contribute nothing (bool mask: promoted inside the one multiply)
    past = read_states(cache, layer, state_idx=self.conv_idx, recurrent=False)
    K = self.conv_kernel_size
    want_state = cache is not None
    if dynamic:
        out = dynamic_causal_conv1d(
            x, _taps(self, dyn_in.to(dynamic_input.dtype)), seq_idx=layout.seq_idx, initial_state=past.conv,
            token_mask=mask, return_final_state=want_state,
        )
        y, state = out if want_state else (out, None)  # [B, T, D], [B, D, K]
        if state is not None and past.conv is not None and x.shape[1] == 1:
            state = hold_masked_rows(mask, state, past.conv)
        scale = 1.0 / math.sqrt(2 * K + 1)
    else:
        if past.has_previous and x.shape[1] == 1:
            y, state = cached_conv_step(x, self.conv1d, past, activation=None, backend=backend)  # [B, 1, D], [B,D,K]
            state = hold_masked_rows(mask, state, past.conv)
        else:
            y, state = cached_conv(
                x, self.conv1d, layout, past, activation=None, want_state=want_state, backend=backend
            )  # [B, T, D], [B, D, K]
        scale = self._safepad_spec.options.get("residual_scale", 1.0)
        scale = 1.0 / math.sqrt(K + 1) if scale == "sqrt_k1" else float(scale)
    if state is not None:
        write_states(
            cache, layer, tokens=x.shape[1], conv=state.to(torch.float32), state_idx=self.conv_idx, inputs=x,
            token_mask=mask,
        )
    out = y.float() + x  # [B, T, D]
    if scale != 1.0:  # (Inkling's scale is 1: no multiply)
        out = out * scale
    return layout.restore(out.to(input_dtype))

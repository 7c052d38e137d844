"""4-D attention masks handed to a wrapped model: refused where they hide keys a causal mask keeps.

transformers passes a 4-D ``attention_mask`` ``[B, 1 | H, T, L]`` (bool, True = attend; or additive float, 0 =
attend, ``-inf`` / ``finfo.min`` = masked) to the attention layers as it is (``masking_utils``: "already
prepared"). The recurrent layers (SSM, conv, delta-rule) read padding and packed boundaries from a 2-D mask or
from ``seq_idx`` / ``cu_seq_lens`` only, so a 4-D mask that masks pads or packed sequences reaches attention
alone: the recurrent states run over the pads / across the boundaries and the outputs silently differ from each
row alone (nemotron_h, a left-padded row: 0.75). A 4-D mask that hides no key inside the causal triangle (a plain
causal mask) carries no padding and passes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._tracing import device_check, tracing

__all__ = ["check_four_d_mask"]

_MESSAGE = (
    "{model}: attention_mask is a 4-D mask {shape} that hides keys inside the causal triangle (row {row}, query "
    "{query}, key column {col}): padding or packed boundaries. Only the attention layers read a 4-D mask; the "
    "recurrent (SSM / conv) layers would run over those keys and give wrong outputs. Pass the 2-D [batch, seqlen] "
    "padding mask (1 real, 0 pad; the full length of the cached context plus the new tokens) instead, and "
    "describe packed rows with seq_idx / cu_seq_lens_q or restarting position_ids."
)

#: the device check's short message (CUDA's limit: safepad._tracing.device_check)
_DEVICE_MESSAGE = (
    "a 4-D attention_mask hides keys inside the causal triangle (padding / packing), which the recurrent layers "
    "cannot read: pass the 2-D [batch, seqlen] mask (docs/limits.md, check D10)"
)


def check_four_d_mask(attention_mask: object, model: str) -> None:
    """Raise ``ValueError`` when ``attention_mask`` is a 4-D tensor ``[B, 1 | H, T, L]`` (``L >= T``: the last
    ``T`` keys are the queries) that masks a key ``j <= L - T + i`` of a query ``i``; any other argument passes.

    bool masks: True = attend; floating masks are additive (0 attend, negative masked); others: nonzero = attend.
    One host read per call that carries a 4-D mask; while tracing, a device check (docs/limits.md, check D10).
    """
    if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 4 or attention_mask.numel() == 0:
        return
    B, _, T, L = attention_mask.shape
    if attention_mask.dtype == torch.bool:
        keep = attention_mask
    elif attention_mask.is_floating_point():
        keep = attention_mask == 0
    else:
        keep = attention_mask != 0
    q = torch.arange(T, device=keep.device)[:, None]
    k = torch.arange(L, device=keep.device)[None, :]
    causal = k <= q + (L - T)  # [T, L]
    hidden = ~keep & causal  # [B, H', T, L]
    if tracing():
        device_check(~hidden.any(), _DEVICE_MESSAGE)
        return
    if not bool(hidden.any()):
        return
    row, _, query, col = (int(x) for x in hidden.nonzero()[0].tolist())
    raise ValueError(_MESSAGE.format(model=model, shape=list(attention_mask.shape), row=row, query=query, col=col))

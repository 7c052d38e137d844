"""Float64 reference of the stacked causal convs (``safepad.ops.conv_stack``): each sequence alone, zero padded."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def ref_conv_stack(x: Tensor, layers, lengths: list[list[int]], initial_state: Tensor | None = None):
    """Each sequence of ``lengths[b]`` (packed in row ``b``) alone: ``conv_L(...conv_1([prefix ‖ seq]))`` in valid
    mode, the prefix being ``initial_state`` for a row's first sequence and zeros otherwise. Returns
    (``y [B, T, C]``, pads 0; final state ``[B, C, Kc]``: the last Kc inputs of [prefix ‖ last sequence])."""
    x = x.double()
    B, T, C = x.shape
    Kc = sum(w.shape[-1] - 1 for w, _, _ in layers)
    y = torch.zeros(B, T, C, dtype=torch.float64)
    final = torch.zeros(B, C, Kc, dtype=torch.float64)
    for b in range(B):
        start = 0
        for i, n in enumerate(lengths[b]):
            if i == 0 and initial_state is not None:
                prefix = initial_state[b].double()
            else:
                prefix = torch.zeros(C, Kc, dtype=torch.float64)
            seq = torch.cat([prefix, x[b, start : start + n].T], dim=-1)[None]  # [1, C, Kc + n]
            h = seq
            for w, bias, groups in layers:
                h = F.conv1d(h, w.double(), None if bias is None else bias.double(), groups=groups)
            y[b, start : start + n] = h[0].T
            final[b] = seq[0, :, -Kc:]
            start += n
    return y, final

"""Float64 token-by-token reference of the per-token-tap causal conv (``safepad.ops.dynamic_conv``)."""

from __future__ import annotations

import torch
from torch import Tensor


def ref_dynamic_conv(x: Tensor, taps: Tensor, lengths: list[list[int]], initial_state: Tensor | None = None):
    """``x [B, T, D]``, ``taps [B, T, D, K]``; ``lengths[b]``: the sequence lengths packed in row ``b`` (their sum
    may be < T: the rest is padding). Returns (``y [B, T, D]`` with pads 0, final state ``[B, D, K]``): each
    sequence is run alone, a row's first one continuing from ``initial_state``."""
    x, taps = x.double(), taps.double()
    B, T, D = x.shape
    K = taps.shape[-1]
    y = torch.zeros(B, T, D, dtype=torch.float64)
    final = torch.zeros(B, D, K, dtype=torch.float64)
    for b in range(B):
        start = 0
        hist = initial_state[b].double().T.tolist() if initial_state is not None else [[0.0] * D] * K  # K x [D]
        for i, n in enumerate(lengths[b]):
            if i == 0:
                buf = [torch.tensor(h, dtype=torch.float64) for h in hist]
            else:
                buf = [torch.zeros(D, dtype=torch.float64)] * K
            for t in range(start, start + n):
                buf = buf[1:] + [x[b, t]]  # the last K inputs, oldest first
                y[b, t] = sum(taps[b, t, :, lag] * buf[K - 1 - lag] for lag in range(K))
            start += n
            final[b] = torch.stack(buf, dim=-1)  # [D, K]
    return y, final

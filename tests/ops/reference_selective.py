"""Float64 token-by-token oracle for the Mamba1 selective scan (tests only).

Plain loops, no cleverness: one sequence at a time, one token at a time, everything in float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ref_selective_scan_packed", "ref_selective_scan_seq"]


def ref_selective_scan_seq(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    *,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = True,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One sequence. ``u, delta, z`` ``[L, Dm]``; ``A`` ``[Dm, N]``; ``B, C`` ``[L, N]``; ``initial_state`` ``[Dm, N]``.

    Returns ``(y [L, Dm], final_state [Dm, N])`` in float64.
    """
    f = torch.float64
    L, Dm = u.shape
    N = A.shape[1]
    h = torch.zeros(Dm, N, dtype=f) if initial_state is None else initial_state.to(f).clone()
    ys = []
    for t in range(L):
        dt = delta[t].to(f)
        if delta_bias is not None:
            dt = dt + delta_bias.to(f)
        if delta_softplus:
            dt = F.softplus(dt)
        h = torch.exp(dt[:, None] * A.to(f)) * h + (dt * u[t].to(f))[:, None] * B[t].to(f)[None, :]
        y = (h * C[t].to(f)[None, :]).sum(-1)
        if D is not None:
            y = y + D.to(f) * u[t].to(f)
        if z is not None:
            y = y * F.silu(z[t].to(f))
        ys.append(y)
    y = torch.stack(ys) if ys else torch.zeros(0, Dm, dtype=f)
    return y, h


def ref_selective_scan_packed(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    seq_idx: Tensor,
    *,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = True,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Packed rows ``[Bsz, T, ...]`` split by ``seq_idx`` and run sequence by sequence.

    ``initial_state`` ``[Bsz, Dm, N]`` goes to each row's first sequence only. Returns float64
    ``(y [Bsz, T, Dm], final_state [Bsz, Dm, N], varlen_states [S, Dm, N])``.
    """
    Bsz, T, Dm = u.shape
    y = torch.zeros(Bsz, T, Dm, dtype=torch.float64)
    finals, varlen = [], []
    for b in range(Bsz):
        start = 0
        while start < T:
            end = start
            while end < T and int(seq_idx[b, end]) == int(seq_idx[b, start]):
                end += 1
            sl = slice(start, end)
            h0 = initial_state[b] if (initial_state is not None and start == 0) else None
            y_s, h_s = ref_selective_scan_seq(
                u[b, sl], delta[b, sl], A, B[b, sl], C[b, sl],
                D=D, z=None if z is None else z[b, sl], delta_bias=delta_bias,
                delta_softplus=delta_softplus, initial_state=h0,
            )
            y[b, sl] = y_s
            varlen.append(h_s)
            start = end
        finals.append(varlen[-1])
    return y, torch.stack(finals), torch.stack(varlen)

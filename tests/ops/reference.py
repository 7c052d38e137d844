"""Float64 token-by-token references (the oracle for safepad.ops). Obviously-correct loops, tests only.

Every function here runs ONE sequence (no batch, no packing, no padding): tests split packed rows into
sequences themselves and compare against these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ref_conv", "ref_dt", "ref_ssd", "split_rows"]


def ref_dt(dt: Tensor, dt_bias: Tensor | None, dt_limit: tuple[float, float], dt_softplus: bool) -> Tensor:
    """dt ``[..., H]`` -> bias -> softplus -> clamp, in float64."""
    dt = dt.double()
    if dt_bias is not None:
        dt = dt + dt_bias.double()
    if dt_softplus:
        dt = F.softplus(dt)
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def ref_conv(
    x: Tensor, weight: Tensor, bias: Tensor | None, history: Tensor | None, activation: str | None, state_len: int
) -> tuple[Tensor, Tensor]:
    """One sequence. x ``[T, D]``; weight ``[D, K]``; history ``[D, S]`` previous inputs (oldest first) | None.

    Returns ``(y [T, D], state [D, state_len])`` where state = the last ``state_len`` inputs of
    ``[history || x]``, zero-filled on the left.
    """
    x, weight = x.double(), weight.double()
    T, D = x.shape
    K = weight.shape[1]
    hist = torch.zeros(D, 0, dtype=torch.float64) if history is None else history.double()
    seq = torch.cat([hist, x.T], dim=1)  # [D, S + T]
    off = hist.shape[1]
    ys = []
    for t in range(T):
        acc = torch.zeros(D, dtype=torch.float64) if bias is None else bias.double().clone()
        for k in range(K):
            src = off + t - (K - 1 - k)
            if src >= 0:
                acc = acc + weight[:, k] * seq[:, src]
        if activation in ("silu", "swish"):
            acc = F.silu(acc)
        ys.append(acc)
    y = torch.stack(ys, 0)  # [T, D]
    padded = torch.cat([torch.zeros(D, state_len, dtype=torch.float64), seq], dim=1)  # [D, L + S + T]
    return y, padded[:, padded.shape[1] - state_len :]


def ref_ssd(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    dt_softplus: bool = True,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One sequence of the Mamba2 recurrence, token by token in float64.

    x ``[T, H, P]``; dt ``[T, H]`` raw; A ``[H]``; B, C ``[T, G, N]``; D ``[H]`` | ``[H, P]`` | None;
    initial_state ``[H, P, N]`` | None.

        h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T;   y_t = C_t h_t + D x_t

    Returns ``(y [T, H, P], final_state [H, P, N])``.
    """
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    rep = H // G
    dtp = ref_dt(dt, dt_bias, dt_limit, dt_softplus)  # [T, H]
    h = torch.zeros(H, P, N, dtype=torch.float64) if initial_state is None else initial_state.double().clone()
    ys = []
    for t in range(T):
        Bt = B[t].double().repeat_interleave(rep, dim=0)  # [H, N]
        Ct = C[t].double().repeat_interleave(rep, dim=0)  # [H, N]
        decay = torch.exp(dtp[t] * A.double())  # [H]
        h = decay[:, None, None] * h + (dtp[t][:, None] * x[t].double())[:, :, None] * Bt[:, None, :]
        y = torch.einsum("hpn,hn->hp", h, Ct)
        if D is not None:
            Dd = D.double()
            y = y + (Dd[:, None] if Dd.dim() == 1 else Dd) * x[t].double()
        ys.append(y)
    return torch.stack(ys, 0), h


def split_rows(seq_idx: Tensor) -> list[tuple[int, int, int]]:
    """``seq_idx [B, T]`` -> list of ``(row, start, end)`` per sequence, row-major order of appearance."""
    out = []
    for b in range(seq_idx.shape[0]):
        s = seq_idx[b].tolist()
        start = 0
        for t in range(1, len(s) + 1):
            if t == len(s) or s[t] != s[t - 1]:
                out.append((b, start, t))
                start = t
    return out

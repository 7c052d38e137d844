"""Float64 token-by-token gated delta rule: the oracle for safepad.ops.delta_rule (tests only).

Written from the recurrence, one token at a time, one sequence at a time:

    S <- S * exp(g_t)                     (g_t per head, or per key channel: rows of S)
    S <- S + k_t ⊗ beta_t (v_t - S^T k_t)
    o_t = S^T (scale * q_t)
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["reference_delta_rule", "reference_packed"]


def reference_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[Tensor, Tensor]:
    """One sequence. q, k ``[L, H_k, Dk]``; v ``[L, H, Dv]``; g ``[L, H]`` or ``[L, H, Dk]``; beta ``[L, H]``;
    initial_state ``[H, Dk, Dv]``. Returns float64 ``(o [L, H, Dv], final_state [H, Dk, Dv])``."""
    q, k, v, g, beta = (x.detach().double() for x in (q, k, v, g, beta))
    length, hk, dk = q.shape
    h, dv = v.shape[1:]
    if use_qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    rep = h // hk
    scale = dk**-0.5 if scale is None else scale
    if initial_state is None:
        s = torch.zeros(h, dk, dv, dtype=torch.float64)
    else:
        s = initial_state.detach().double().clone()
    o = torch.zeros(length, h, dv, dtype=torch.float64)
    for t in range(length):
        for head in range(h):
            qt, kt = q[t, head // rep] * scale, k[t, head // rep]  # [Dk]
            if g.dim() == 3:
                s[head] = s[head] * torch.exp(g[t, head])[:, None]  # per key channel
            else:
                s[head] = s[head] * torch.exp(g[t, head])
            delta = beta[t, head] * (v[t, head] - s[head].T @ kt)  # [Dv]
            s[head] = s[head] + torch.outer(kt, delta)
            o[t, head] = s[head].T @ qt
    return o, s


def reference_packed(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    seq_idx: Tensor | None = None,
    token_mask: Tensor | None = None,
    initial_state: Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Packed ``[B, T, ...]`` rows, each sequence run alone on its real tokens only.

    Returns float64 ``(o [B, T, H, Dv] (zeros at masked tokens), final [B, H, Dk, Dv], varlen [S, H, Dk, Dv])``.
    The initial state of row b starts the row's first sequence only.
    """
    bsz, t = q.shape[:2]
    h, dk, dv = v.shape[2], q.shape[3], v.shape[3]
    o = torch.zeros(bsz, t, h, dv, dtype=torch.float64)
    finals, varlen = [], []
    for b in range(bsz):
        seq = [0] * t if seq_idx is None else seq_idx[b].tolist()
        bounds = [0] + [i for i in range(1, t) if seq[i] != seq[i - 1]] + [t]
        s = None
        for n, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            real = [i for i in range(lo, hi) if token_mask is None or bool(token_mask[b, i])]
            idx = torch.tensor(real, dtype=torch.long)
            init = initial_state[b] if (n == 0 and initial_state is not None) else None
            ob, s = reference_delta_rule(
                q[b, idx], k[b, idx], v[b, idx], g[b, idx], beta[b, idx],
                scale=scale, initial_state=init, use_qk_l2norm=use_qk_l2norm,
            )
            if real:
                o[b, idx] = ob
            varlen.append(s)
        finals.append(s)
    return o, torch.stack(finals), torch.stack(varlen)

"""Float64 token-by-token RG-LRU reference (tests only): ONE sequence, no batch, no packing, no padding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ref_rg_lru"]


def ref_rg_lru(x: Tensor, wi: Tensor, bi: Tensor, wr: Tensor, br: Tensor, lam: Tensor, h0: Tensor | None,
               c: float = 8.0) -> tuple[Tensor, Tensor]:
    """x ``[T, W]``; wi / wr ``[H, P, P]``; bi / br ``[H, P]``; lam ``[W]``; h0 ``[W]`` or None (a fresh sequence:
    its first token is a reset). Returns ``(y [T, W], h_T [W])`` in float64."""
    x, wi, bi, wr, br, lam = (t.double() for t in (x, wi, bi, wr, br, lam))
    T, W = x.shape
    H, P = wi.shape[0], wi.shape[1]
    h = torch.zeros(W, dtype=torch.float64) if h0 is None else h0.double().clone()
    ys = []
    for t in range(T):
        xt = x[t]
        ig = torch.empty(W, dtype=torch.float64)
        rg = torch.empty(W, dtype=torch.float64)
        for k in range(H):
            blk = xt[k * P : (k + 1) * P]
            ig[k * P : (k + 1) * P] = torch.sigmoid(blk @ wi[k] + bi[k])
            rg[k * P : (k + 1) * P] = torch.sigmoid(blk @ wr[k] + br[k])
        a = torch.exp(-c * rg * F.softplus(lam))
        if t == 0 and h0 is None:
            h = ig * xt
        else:
            h = a * h + torch.sqrt(1 - a * a) * (ig * xt)
        ys.append(h.clone())
    return torch.stack(ys), h

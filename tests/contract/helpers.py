"""Inputs and row-alone references shared by the contract tier (tiny prompts, short generations)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

N_NEW = 3  # new tokens per generation
PAD = 0


def prompts(lengths=(6, 4), seed: int = 0) -> list[Tensor]:
    """Random prompts ``[L_i]`` of the given lengths (ids 3..199: no pad / bos / eos)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 200, (n,), generator=g) for n in lengths]


def pad(rows: list[Tensor], side: str) -> tuple[Tensor, Tensor]:
    """``rows`` padded on ``side`` -> (ids ``[B, L]``, mask ``[B, L]``)."""
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), PAD, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(L - len(r), L) if side == "left" else slice(0, len(r))
        ids[i, sl], mask[i, sl] = r, 1
    return ids, mask


def banned(model) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    return [eos] if isinstance(eos, int) else list(eos or [])


#: row-alone references, per reference model (built once per session) and row: many properties share prompts
_ALONE: dict[tuple[int, tuple[int, ...]], Tensor] = {}


@torch.no_grad()
def logits_alone(ref, row: Tensor) -> Tensor:
    """``[L]`` ids alone through the stock model, full forward without cache -> ``[L, V]`` float logits
    (memoised per reference model and row; do not modify the result)."""
    key = (id(ref), tuple(row.tolist()))
    if key not in _ALONE:
        _ALONE[key] = ref(input_ids=row[None], use_cache=False).logits[0].float()
    return _ALONE[key]


@torch.no_grad()
def greedy_alone(ref, row: Tensor, n: int = N_NEW) -> tuple[Tensor, Tensor]:
    """Greedy continuation of ``row`` alone by full forwards (no cache), eos banned as ``min_new_tokens`` does.

    Returns (new tokens ``[n]``, the raw next-token logits ``[n, V]``).
    """
    seq, steps = row, []
    for _ in range(n):
        last = logits_alone(ref, seq)[-1]
        steps.append(last)
        masked = last.clone()
        masked[banned(ref)] = -math.inf
        seq = torch.cat([seq, masked.argmax().view(1)])
    return seq[len(row) :], torch.stack(steps)


def gen_kwargs(n: int = N_NEW, **kw):
    return dict(max_new_tokens=n, min_new_tokens=n, pad_token_id=PAD, **kw)


def close(a: Tensor, b: Tensor, atol: float = 1e-4, what: str = "") -> None:
    """``|a - b| <= atol * max(1, max |b|)``; equal infinities (tokens a logits processor banned) match."""
    a, b = a.float(), b.float()
    assert a.shape == b.shape, f"{what} shapes {tuple(a.shape)} != {tuple(b.shape)}"
    same = a == b  # also equal infinities
    assert torch.equal(torch.isfinite(a), torch.isfinite(b)) or same[~torch.isfinite(b)].all(), f"{what} inf differ"
    diff = torch.where(same, 0.0, a - b).abs()
    err = diff.max().item() if diff.numel() else 0.0
    scale = b[torch.isfinite(b)].abs().max().item() if torch.isfinite(b).any() else 1.0
    assert err <= atol * max(1.0, scale), f"{what} max |diff| {err:.3g} > {atol}"

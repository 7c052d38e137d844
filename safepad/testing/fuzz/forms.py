"""The input forms a user hands a model, as transformers accepts them: attention-mask forms and ``position_ids``
conventions (derived from transformers' ``masking_utils``: a 2-D mask of any dtype is read as ``mask.bool()``; a
4-D mask ``[B, 1, T, L]`` is used as it is, bool True = attend or additive float 0 = attend; ``position_ids``
without a mask and without a cache are read as packing by ``find_packed_sequence_indices``, a new sequence
wherever a position is not the previous one plus 1)."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor

__all__ = ["MASK_FORMS", "POSITION_FORMS", "as_positional", "mask_in_form", "positions_in_form", "stacked"]

#: every attention-mask form transformers accepts: 2-D int / bool / float (0 / 1), 4-D bool, 4-D additive float
#: with ``-inf`` or ``finfo.min`` at masked keys
MASK_FORMS: tuple[str, ...] = ("int", "bool", "float", "4d_bool", "4d_inf", "4d_min")

#: ``position_ids`` conventions: none; generate's ``cumsum(mask) - 1`` (``arange`` on unpadded rows); the same
#: from a non-zero start (an offset, e.g. a continued document); from -1 (``[-1, 0, 1, ...]``, which transformers'
#: packing detection reads as one sequence and safepad's restart-at-0 reading as two: safepad must raise); the
#: generate-style ones stacked ``[3, B, T]`` / ``[4, B, T]`` (multimodal RoPE rows; text row first for 4), which
#: stock's Qwen3.5 / Qwen4-Exp / GLM-5 Next text models take (:func:`stacked`)
POSITION_FORMS: tuple[str, ...] = ("none", "arange", "offset", "negative", "mrope3", "mrope4")


def mask_in_form(mask: Tensor, form: str, queries: int, dtype: torch.dtype) -> Tensor:
    """``mask`` ``[B, L]`` (0 / 1 over past + current columns) in ``form``: 2-D ``[B, L]``, or 4-D ``[B, 1, T, L]``
    (``T = queries``, the last ``T`` columns) with the causal triangle and the masked columns hidden (a key a
    query cannot see: False, or ``-inf`` / ``finfo(dtype).min`` added)."""
    if form == "int":
        return mask.long()
    if form == "bool":
        return mask.bool()
    if form == "float":
        return mask.to(dtype)
    B, L = mask.shape
    q = torch.arange(queries)[:, None] + (L - queries)
    keep = (torch.arange(L)[None, :] <= q)[None, None] & mask.bool()[:, None, None, :]  # [B, 1, T, L]
    if form == "4d_bool":
        return keep
    fill = -torch.inf if form == "4d_inf" else torch.finfo(dtype).min
    return torch.zeros(B, 1, queries, L, dtype=dtype).masked_fill(~keep, fill)


def positions_in_form(mask: Tensor, form: str, start: Tensor | None = None, offset: int = 0) -> Tensor | None:
    """``[B, W]`` position ids of a call's columns ``mask`` ``[B, W]`` in ``form`` (None for ``"none"``): each real
    token's index among its row's real tokens, from ``start`` ``[B]`` (the row's cached real tokens) plus ``offset``
    (``"offset"``) or minus 1 (``"negative"``); pads hold 1."""
    if form == "none":
        return None
    if form.startswith("mrope"):
        form = "arange"
    pos = mask.long().cumsum(-1) - 1
    if start is not None:
        pos = pos + start[:, None]
    if form == "offset":
        pos = pos + offset
    elif form == "negative":
        pos = pos - 1
    return pos.masked_fill(mask == 0, 1)


def stacked(positions: Tensor, form: str) -> Tensor:
    """``positions`` ``[B, W]`` as the ``[K, B, W]`` layout of ``form`` (``"mrope3"``: K = 3, ``"mrope4"``: 4, every row
    the same, as ``get_rope_index`` gives text tokens); other forms: unchanged."""
    if not form.startswith("mrope"):
        return positions
    return positions[None].expand(int(form[-1]), *positions.shape).clone()


def as_positional(forward: Any, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """``kwargs`` of a call of ``forward`` as a user may write it positionally, ``model(ids, mask, positions, cache)``:
    the longest run of the forward's leading parameters that are given or default to None (those passed as None),
    up to the last given one, as positional arguments; the rest stay keywords. ``(args, kwargs)``."""
    run: list[str] = []
    for p in inspect.signature(forward).parameters.values():
        if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD or not (p.name in kwargs or p.default is None):
            break
        run.append(p.name)
    while run and run[-1] not in kwargs:
        run.pop()
    return tuple(kwargs.get(n) for n in run), {k: v for k, v in kwargs.items() if k not in run}

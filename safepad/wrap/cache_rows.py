"""A cached call must come with as many rows as the cache holds.

Stock transformers code meets a cache of another batch size at its first ``torch.cat`` (Qwen4-Exp's indexer
position ids: ``Sizes of tensors must match``) or an op's shape check deep inside a mixer. The wrapped model's
pre-hook asks :func:`check_cache_rows` first and raises naming the cache's rows, the call's rows and the fix.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["cache_rows", "check_cache_rows"]


def _rows_of(value: Any) -> int | None:
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() >= 2 and value.numel() > 0 else None
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for v in value:
            rows = _rows_of(v)
            if rows is not None:
                return rows
    return None


def cache_rows(cache: Any) -> int | None:
    """The batch size of the states a ``DynamicCache``-style cache holds (keys ``[B, ...]``, conv / recurrent
    states ``[B, ...]``), or None when it holds none yet or is not such a cache (static caches are skipped:
    their rows are allocated, not written)."""
    for layer in getattr(cache, "layers", None) or ():
        if "Static" in type(layer).__name__:
            return None
        for name in ("keys", "conv_states", "recurrent_states"):
            rows = _rows_of(getattr(layer, name, None))
            if rows is not None:
                return rows
    return None


def check_cache_rows(cache: Any, batch: int) -> None:
    """Raise ``ValueError`` when ``cache`` holds states of a batch size other than ``batch``."""
    rows = cache_rows(cache)
    if rows is not None and rows != batch:
        raise ValueError(
            f"the cache holds states for {rows} rows but this call has {batch} rows: a cache belongs to the batch "
            "it was built with. Pass the same rows (in the same order) as the call that filled the cache, or start "
            "a new cache for a different batch."
        )

"""A cached call must come with as many rows as the cache holds.

Stock transformers code meets a cache of another batch size at its first ``torch.cat`` (Qwen4-Exp's indexer
position ids: ``Sizes of tensors must match``) or an op's shape check deep inside a mixer. The wrapped model's
pre-hook asks :func:`check_cache_rows` first (eager and traced) and raises naming the cache's rows, the call's rows
and the fix; an empty cache (after ``reset()``) takes the new rows. :func:`cover_row_ops` makes the cache's row
operations (``batch_select_indices``, ``batch_repeat_interleave``, ``reorder_cache``) move every state of every
layer and safepad's per-row facts kept on the cache, and its ``reset()`` forget those facts.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["cache_rows", "check_cache_rows", "cover_row_ops"]


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


def _holds_nothing(cache: Any) -> bool:
    """Whether ``cache`` holds no token (fresh, or after ``cache.reset()``), whatever tensors it keeps allocated:
    no layer has a previous conv / recurrent state, and no layer holds keys."""
    for layer in getattr(cache, "layers", None) or ():
        if any(getattr(layer, "has_previous_state", {}).values()):
            return False
        keys = getattr(layer, "keys", None)
        if isinstance(keys, torch.Tensor) and keys.numel() > 0:
            return False
    return True


def _forget_stale_states(cache: Any, batch: int) -> None:
    """Drop the conv / recurrent state tensors ``[B', ...]`` that an empty ``cache`` keeps allocated for another
    batch size (``reset()`` zeroes them in place): the call's first write allocates them for its ``batch`` rows,
    as it does in a fresh cache."""
    for layer in getattr(cache, "layers", None) or ():
        for name, flag in (("conv_states", "is_conv_states_initialized"),
                           ("recurrent_states", "is_recurrent_states_initialized")):
            held, initialized = getattr(layer, name, None), getattr(layer, flag, None)
            if not (isinstance(held, dict) and isinstance(initialized, dict)):
                continue
            for i, t in list(held.items()):
                if isinstance(t, torch.Tensor) and t.shape[0] != batch:
                    held[i] = None
                    initialized[i] = False


def check_cache_rows(cache: Any, batch: int) -> None:
    """Raise ``ValueError`` when ``cache`` holds states of a batch size other than ``batch``. An empty cache (after
    ``cache.reset()``) that keeps state tensors of another batch size takes the new batch, as a fresh cache does.
    The same for eager and traced calls (shapes are static, or guarded, at trace time)."""
    rows = cache_rows(cache)
    if rows is not None and rows != batch and _holds_nothing(cache):
        _forget_stale_states(cache, batch)
        return
    if rows is not None and rows != batch:
        raise ValueError(
            f"the cache holds states for {rows} rows but this call has {batch} rows: a cache belongs to the batch "
            "it was built with. Pass the same rows (in the same order) as the call that filled the cache, or start "
            "a new cache for a different batch."
        )


#: the batch operations of a transformers ``Cache`` that move rows: name -> how a ``[B, ...]`` tensor follows
_ROW_OPS = ("batch_select_indices", "batch_repeat_interleave", "reorder_cache")


def _rows_taken(op: str, arg: Any, batch: int) -> torch.Tensor:
    """The old row each new row comes from, ``[B']`` long, for ``op`` with ``arg`` on a cache of ``batch`` rows."""
    if op == "batch_repeat_interleave":
        return torch.arange(batch).repeat_interleave(int(arg))  # host: row indices, moved to each tensor by _take
    idx = torch.as_tensor(arg).to("cpu")  # host: moved to each tensor by _take
    if idx.dtype == torch.bool:
        idx = idx.nonzero().flatten()
    return idx.long().reshape(-1)


def _take(t: Any, rows: torch.Tensor, dim: int = 0) -> Any:
    """``t`` with its rows ``rows`` along ``dim``; anything else, or a tensor without that dim, unchanged."""
    if not isinstance(t, torch.Tensor) or t.dim() <= dim or t.numel() == 0:
        return t
    return t.index_select(dim, rows.to(t.device))


def _static(layer: Any) -> bool:
    try:
        from transformers.cache_utils import StaticLayer
    except ImportError:  # pragma: no cover - older transformers
        return False
    return isinstance(layer, StaticLayer)


def _move_layer(layer: Any, op: str, arg: Any, rows: torch.Tensor) -> None:
    """One layer's part of ``cache.<op>(arg)``: its own method for what it covers (keys and values of attention
    layers; ``reorder_cache`` every state), and for ``batch_select_indices`` / ``batch_repeat_interleave`` its conv
    and recurrent states as well, which transformers' ``DynamicLayer`` methods leave behind on hybrid layers."""
    states = hasattr(layer, "conv_states") or hasattr(layer, "recurrent_states")
    own = getattr(type(layer), op, None)
    if op == "reorder_cache" or not states:
        getattr(layer, op)(arg)  # stock's: moves everything it holds (or raises as stock does)
        _move_started(layer, rows)
        return
    if _static(layer):
        raise ValueError(
            f"cache.{op} on a {type(layer).__name__}: a static cache keeps a fixed batch size, so its rows cannot be "
            "selected or repeated. Use a DynamicCache (the default cache) for calls that change the batch, or "
            "build a new static cache for the new rows."
        )
    if own is not None:
        own(layer, arg)  # keys and values (DynamicLayer's); the states follow below
    for name in ("conv_states", "recurrent_states"):
        held = getattr(layer, name, None)
        if isinstance(held, dict):
            for i, t in list(held.items()):
                held[i] = _take(t, rows)
    _move_started(layer, rows)


def _move_started(layer: Any, rows: torch.Tensor) -> None:
    """The RG-LRU's per-row "has read a real token" flags ``[B]`` on ``layer`` follow its rows."""
    from ..mixers.rg_lru import STARTED_ATTR

    started = getattr(layer, STARTED_ATTR, None)
    if isinstance(started, torch.Tensor):
        setattr(layer, STARTED_ATTR, started.index_select(0, rows.to(started.device)))  # [B'] bool


def _bookkeeping_names() -> tuple[str, ...]:
    """The attributes of safepad's per-row facts kept on a cache (each written where its call happens)."""
    from ..cache import _RECORD_ATTR
    from .generate import _ROPE_DELTAS_ATTR
    from .mask_history import MASK_ATTR
    from .slot_record import _PADDED_FLAG, _PADS_ATTR, _RELAID_FLAG, _SHIFT_ATTR

    return (_PADS_ATTR, _SHIFT_ATTR, _ROPE_DELTAS_ATTR, _RECORD_ATTR, _PADDED_FLAG, _RELAID_FLAG, MASK_ATTR)


def _move_bookkeeping(cache: Any, rows: torch.Tensor, batch: int) -> None:
    """safepad's per-row facts kept on ``cache`` follow its rows: the pad slots of a decode step ``[B]``, the
    position shift of a generate call ``[K, B, 1]``, the rope deltas of a generate ``[B, 1]`` (or one per prompt),
    the ids a generate read ``[B, n]``, and the mask columns the cache has read ``[B, L]``."""
    from ..cache import _RECORD_ATTR, _state_versions
    from .generate import _ROPE_DELTAS_ATTR
    from .mask_history import MASK_ATTR
    from .slot_record import _PADS_ATTR, _SHIFT_ATTR, _GenerateShift

    d = cache.__dict__
    for name in (_PADS_ATTR, MASK_ATTR):
        if isinstance(d.get(name), torch.Tensor):
            d[name] = _take(d[name], rows)
    shift = d.get(_SHIFT_ATTR)
    if isinstance(shift, _GenerateShift):
        d[_SHIFT_ATTR] = _GenerateShift(shift.frame, _take(shift.shift, rows, dim=1))
    deltas = d.get(_ROPE_DELTAS_ATTR)
    if isinstance(deltas, torch.Tensor) and deltas.dim() >= 1:
        if deltas.shape[0] != batch and deltas.shape[0] > 0 and batch % deltas.shape[0] == 0:
            deltas = deltas.repeat_interleave(batch // deltas.shape[0], dim=0)  # one per prompt -> one per row
        d[_ROPE_DELTAS_ATTR] = _take(deltas, rows) if deltas.shape[0] == batch else None
    record = d.get(_RECORD_ATTR)
    if record is not None:
        n, ids, _ = record
        if isinstance(ids, torch.Tensor) and ids.shape[0] != batch:
            d.pop(_RECORD_ATTR)  # rows it cannot tell apart: it no longer says what each row read
        else:
            d[_RECORD_ATTR] = (n, _take(ids, rows), _state_versions(cache))


class _RowOp:
    """``cache.batch_select_indices`` / ``batch_repeat_interleave`` / ``reorder_cache`` of a cache a wrapped model
    met, kept on the cache instance (:func:`cover_row_ops`): every state of every layer moves with its row, and so
    does safepad's per-row bookkeeping beside the cache. A module-level class holding the cache, so that
    ``copy.deepcopy`` and pickling carry it (bound to the copy)."""

    __slots__ = ("cache", "op")

    def __init__(self, cache: Any, op: str) -> None:
        self.cache, self.op = cache, op

    def __call__(self, arg: Any) -> None:
        cache, op = self.cache, self.op
        batch = cache_rows(cache)
        if batch is None:  # nothing held yet (or a static cache): stock's method
            return getattr(type(cache), op)(cache, arg)
        rows = _rows_taken(op, arg, batch)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= batch):
            raise IndexError(
                f"cache.{op}: row indices {rows.tolist()} out of range for a cache of {batch} rows; pass indices "
                f"in [0, {batch})"
            )
        for layer in cache.layers:
            _move_layer(layer, op, arg, rows)
        _move_bookkeeping(cache, rows, batch)

    def __getstate__(self) -> tuple:
        return (self.cache, self.op)

    def __setstate__(self, state: tuple) -> None:
        self.cache, self.op = state


class _Reset:
    """``cache.reset()`` of a cache a wrapped model met (:func:`cover_row_ops`): stock's reset, then safepad's
    per-row facts beside the cache are forgotten, so that the emptied cache is a fresh one to the next call (the
    pad slots of an earlier decode, for instance, belong to rows the cache no longer holds: make fuzz, stop 35,
    recurrent_gemma, a ``batch_select_indices`` after a prefill of 3 rows into a reset cache that had decoded 1 row
    raised an ``IndexError`` inside safepad). A module-level class, as :class:`_RowOp`."""

    __slots__ = ("cache",)

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = type(self.cache).reset(self.cache, *args, **kwargs)
        for name in _bookkeeping_names():
            self.cache.__dict__.pop(name, None)
        return out

    def __getstate__(self) -> tuple:
        return (self.cache,)

    def __setstate__(self, state: tuple) -> None:
        (self.cache,) = state


def cover_row_ops(cache: Any) -> None:
    """Make ``cache``'s row operations (:data:`_ROW_OPS`) move every state of every layer and safepad's per-row
    bookkeeping, and its ``reset()`` forget that bookkeeping (:class:`_Reset`) (in place, once; a cache without
    ``layers`` is left alone). transformers' hybrid layers (e.g.
    ``LinearAttentionAndFullAttentionLayer``) inherit ``batch_select_indices`` / ``batch_repeat_interleave`` from
    ``DynamicLayer``, which moves only keys and values; layers with states only have none."""
    if cache is None or getattr(cache, "layers", None) is None or isinstance(getattr(cache, _ROW_OPS[0], None), _RowOp):
        return
    for op in _ROW_OPS:
        if callable(getattr(type(cache), op, None)):
            setattr(cache, op, _RowOp(cache, op))
    if callable(getattr(type(cache), "reset", None)):
        cache.reset = _Reset(cache)  # the emptied cache forgets safepad's per-row facts too

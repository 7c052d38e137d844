"""Tensors derived from parameters only, kept for the length of one ``generate`` call.

A decode step that rebuilds a function of its parameters (stacked gate weights, a cast of a half-precision
weight, ``softplus(Λ)``) pays those ops (CUDA launches) on every layer and every step. Inside :func:`keep_prepared`
(which a wrapped ``generate`` enters) :func:`prepared` builds such a value once and hands it back while every
parameter it came from is the same object at the same ``_version`` and data pointer. Outside a scope, and once the
scope ends, nothing is kept: a parameter written between two calls is always read afresh, even through ``.data``
(which moves no version counter). Nothing is kept for a call that needs a gradient of the parameters, while
tracing, or for tensor subclasses (a ``DTensor``).

Example::

    with keep_prepared():
        for _ in range(steps):
            w = prepared(("my_op", id(weight)), (weight,), (torch.float32,), lambda: weight.float().t())
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch import Tensor

from .._tracing import tracing

__all__ = ["keep_prepared", "prepared"]

T = TypeVar("T")

#: inside :func:`keep_prepared`: key -> (the parameters, their versions and data pointers, the value)
_SCOPE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("safepad_prepared", default=None)
_PLAIN = (Tensor, torch.nn.Parameter)


@contextmanager
def keep_prepared() -> Iterator[None]:
    """Keep :func:`prepared` values until the block ends (a nested block shares the outer one's)."""
    token = _SCOPE.set({}) if _SCOPE.get() is None else None
    try:
        yield
    finally:
        if token is not None:
            _SCOPE.reset(token)


def prepared(key: Hashable, params: tuple[Tensor, ...], extra: Hashable, build: Callable[[], T]) -> T:
    """``build()``, a function of ``params`` (and of ``extra``: dtypes, constants) only; inside
    :func:`keep_prepared` the value built for ``key`` is handed back while ``params`` are the same objects at the
    same ``_version`` and data pointer and ``extra`` and the inference mode are the same."""
    if tracing():  # (first: dynamo cannot trace a ContextVar's get)
        return build()
    store = _SCOPE.get()
    if store is None:
        return build()
    if torch.is_grad_enabled() and any(p.requires_grad for p in params):
        return build()  # the value must be in this call's graph
    if any(type(p) not in _PLAIN for p in params):
        return build()
    try:
        state = (extra, torch.is_inference_mode_enabled(), tuple((p._version, p.data_ptr()) for p in params))
    except RuntimeError:  # an inference tensor has no version counter
        return build()
    held = store.get(key)
    if held is not None and held[1] == state and all(a is b for a, b in zip(held[0], params)):
        return held[2]
    value = build()
    store[key] = (params, state, value)
    return value

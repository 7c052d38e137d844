"""Gradient checkpointing under wrap: a checkpointed layer's recompute runs under its forward's call context."""

from __future__ import annotations

import contextvars

from torch import nn

from .._tracing import copy_context, tracing
from ..context import current_context, no_call_context, set_context

__all__ = ["hook_checkpoint_functions"]


class _CheckpointWithContext:
    """A layer's checkpoint function whose recompute runs under the context of the original forward.

    transformers' ``GradientCheckpointingLayer`` calls ``self._gradient_checkpointing_func(fn, *args)``
    during the forward; torch re-runs ``fn`` in backward (reentrant: ``CheckpointFunction.backward``;
    non-reentrant: on unpacking a saved tensor), when the context variables hold whatever call is current
    then (another forward's, or none). The context variables (safepad's call context, and any other, such as
    the sequence-parallel one) are snapshot here, at the forward, and the recompute runs inside the snapshot.
    """

    __slots__ = ("inner",)

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, function, *args, **kwargs):
        if tracing():  # dynamo traces the checkpoint into the graph: the recompute is part of the compiled backward
            return self.inner(function, *args, **kwargs)
        return self.inner(_InContext(function, copy_context()), *args, **kwargs)


class _InContext:
    """``function`` bound to the context snapshot of its forward (see :class:`_CheckpointWithContext`): the first
    call is the forward itself (already in that context), every later one a recompute run inside the snapshot."""

    __slots__ = ("calls", "context", "function")

    def __init__(self, function, context: contextvars.Context):
        self.function = function
        self.context = context
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 1:
            return self.function(*args, **kwargs)
        return self.context.run(_recompute, self.function, args, kwargs)


def _recompute(function, args: tuple, kwargs: dict):
    """Inside a forward's context snapshot: a forward that was no safepad model call recomputes as one (no
    boundaries, and no 'recompute without context' error)."""
    if current_context() is None:
        set_context(no_call_context())  # changes only the snapshot
    return function(*args, **kwargs)


def hook_checkpoint_functions(modules: list[nn.Module]) -> None:
    """Wrap each module's ``_gradient_checkpointing_func`` (if any, and not already wrapped).

    Not while dynamo traces: the traced checkpoint needs no context (see :class:`_CheckpointWithContext`), and
    swapping the attribute inside the trace fails the graph's guard on it at the next call (one recompile).
    """
    if tracing():
        return
    for m in modules:
        fn = m.__dict__.get("_gradient_checkpointing_func")
        if fn is not None and type(fn) is not _CheckpointWithContext:
            m._gradient_checkpointing_func = _CheckpointWithContext(fn)

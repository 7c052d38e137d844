"""What changes while ``torch.compile`` (dynamo) traces safepad code.

Eager calls decide their layout on the host (is the row packed? is the mask right-padded? does
``seq_idx`` decrease?) and raise ``ValueError`` on bad input. A traced call cannot read tensor values
without a graph break, so while tracing every such decision is made from what is known statically
(which arguments are tensors, their shapes) and the math covers every value the data may take (a row
holding one sequence through the varlen path, a right-padded row through compaction); every value
check runs on the device as ``torch._assert_async`` with the eager message, so an invalid input still
raises (a ``RuntimeError`` carrying that message) instead of silently giving a wrong result.
"""

from __future__ import annotations

import contextvars
import threading
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor

__all__ = ["CallScope", "device_check", "in_backward", "is_device_check_error", "kwarg", "require", "tracing"]

#: what starts the message of a failed :func:`device_check` (a compiled call raises it from inside torch, where no
#: safepad raise site shows; :func:`is_device_check_error` reads it). A constant: recording the messages at trace
#: time would be a side effect in traced code (a graph break)
DEVICE_CHECK_MARK = "safepad check failed: "

T = TypeVar("T")


def tracing() -> bool:
    """True while dynamo traces the calling code (``torch.compile``)."""
    return torch.compiler.is_compiling()


def kwarg(kwargs: dict, name: str, default: Any = None) -> Any:
    """``kwargs.get(name, default)`` that a traced hook guards on ``name`` alone.

    dynamo guards on the whole key set of ``kwargs`` (``len(kwargs) == 7`` and every key) when a key it reads
    from a variable (a module tuple such as ``CACHE_NAMES``) is missing: the hook then recompiles for every other
    set of keyword arguments (``output_hidden_states``, ``return_dict``, ...) and falls back to eager at dynamo's
    recompile limit. ``str(name)`` makes the key a constant of the traced code, for which a missing key is guarded
    on by itself. (Writing to ``kwargs`` guards on the key set too: a hook writes only what the call needs.)
    """
    return kwargs.get(str(name), default)


def device_check(ok: Tensor, message: str) -> None:
    """Raise ``RuntimeError`` (``DEVICE_CHECK_MARK + message``) when the one-element bool tensor ``ok`` is False,
    without a host sync."""
    torch._assert_async(ok, DEVICE_CHECK_MARK + message)


def is_device_check_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed :func:`device_check` of safepad's: compiled code raises it as a ``RuntimeError``
    from inside torch (its raise site is not in safepad), carrying the check's message."""
    return isinstance(exc, RuntimeError) and DEVICE_CHECK_MARK in str(exc)


def require(ok: Tensor | bool, message: str) -> None:
    """One check for eager and traced code: ``ok`` (a Python bool, or a one-element bool tensor) must hold.

    A Python bool (a static fact: a shape, a dtype) raises ``ValueError(message)`` at once. A tensor is read on
    the host in eager mode (one sync; ``ValueError``) and checked on the device while tracing (no graph break:
    ``RuntimeError`` with the same message when the compiled code runs).
    """
    if not isinstance(ok, Tensor):
        if not ok:
            raise ValueError(message)
    elif tracing():
        device_check(ok, message)
    elif not bool(ok):
        raise ValueError(message)


def in_backward() -> bool:
    """True while autograd runs a backward pass in this thread (a gradient-checkpoint recompute runs there)."""
    try:
        return torch._C._current_graph_task_id() != -1
    except AttributeError:  # pragma: no cover - very old torch
        return False


#: the token :meth:`CallScope.push` returns while tracing (no ContextVar is touched then)
_TRACED_TOKEN = "traced"


class CallScope(Generic[T]):
    """A stack of per-call values (innermost last), per thread, readable by eager and traced code alike.

    Eager code reads a :class:`contextvars.ContextVar` (so a ``contextvars.copy_context`` snapshot, as the
    checkpoint wrapper takes, carries the value). Dynamo cannot trace a ContextVar, so every push also goes onto a
    plain list, one per thread (``threading.local``), which traced code reads: compiled code reads it at run time
    in the calling thread, whether the push ran traced (``torch.compile(model)``: the hooks are traced) or eagerly
    around a compiled ``forward``, so concurrent calls in other threads never see each other's values.

    A traced push sets no ContextVar (dynamo cannot), yet code inside that compiled call may run eagerly: a frame
    dynamo falls back on (its recompile limit, a skipped or ``torch._dynamo.disable``-d function, a graph break).
    Each entry therefore records whether a traced push made it, and eager code reads the innermost entry when a
    traced push made it (the ContextVar, which that push did not set, would hold an earlier call's value or none).
    """

    def __init__(self, name: str, default: T | None = None):
        self.name = name
        self.default = default
        self._var: contextvars.ContextVar[T | None] = contextvars.ContextVar(name, default=default)
        self._local = threading.local()
        # created now for the importing thread: compiled code guards on whether the attribute exists, and
        # creating it in the first compiled call would make the second call recompile
        self._local.stack = []
        self._local.traced = []  # per stack entry: pushed by traced code (no ContextVar set)

    def stack(self) -> list[T | None]:
        """This thread's stack of pushed values (innermost last); what traced code reads."""
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _traced_marks(self) -> list[bool]:
        marks = getattr(self._local, "traced", None)
        if marks is None:
            marks = self._local.traced = []
        return marks

    def push(self, value: T | None) -> Any:
        """A call begins: ``value`` is current until :meth:`pop` of the returned token."""
        self.stack().append(value)
        traced = tracing()
        self._traced_marks().append(traced)
        if traced:
            return _TRACED_TOKEN
        return self._var.set(value)

    def pop(self, token: Any) -> None:
        """The call of :meth:`push`'s ``token`` ends."""
        stack = self.stack()
        if stack:
            stack.pop()
        marks = self._traced_marks()
        if marks:
            marks.pop()
        if token is not _TRACED_TOKEN:
            self._var.reset(token)

    def current(self) -> T | None:
        """The innermost value pushed in this thread (eager: in this context, unless traced code pushed the
        innermost one: code run eagerly inside a compiled call), or ``default``."""
        if tracing():
            stack = self.stack()
            return stack[-1] if stack else self.default
        marks = getattr(self._local, "traced", None)
        if marks and marks[-1]:
            stack = self.stack()
            if stack:
                return stack[-1]
        return self._var.get()

    def set_eager(self, value: T | None) -> contextvars.Token:
        """Set the eager value only (inside a ``contextvars`` snapshot: changes that snapshot alone)."""
        return self._var.set(value)

    def reset_eager(self, token: contextvars.Token) -> None:
        self._var.reset(token)

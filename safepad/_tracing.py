"""What changes while ``torch.compile`` (dynamo) traces safepad code.

Eager calls decide their layout on the host (is the row packed? is the mask right-padded? does
``seq_idx`` decrease?) and raise ``ValueError`` on bad input. A traced call cannot read tensor values
without a graph break, so while tracing every such decision is made from what is known statically
(which arguments are tensors, their shapes) and the math covers every value the data may take (a row
holding one sequence through the varlen path, a right-padded row through compaction); every value
check runs on the device as ``torch._assert_async`` (:func:`device_check`), so an invalid input still raises
instead of silently giving a wrong result: on CPU a ``RuntimeError`` carrying the check's message; on CUDA a
device-side assert (``CUDA error: device-side assert triggered``, without the message, and the process's CUDA
context is lost: it must restart; docs/limits.md, "Device checks"). A device check's message is short (CUDA's
``_assert_async`` refuses one of 255 bytes or more, even when the check holds): the input and the rule, the fix,
and the code of its entry in docs/limits.md.
"""

from __future__ import annotations

import contextvars
import threading
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor

__all__ = [
    "DEVICE_CHECK_MARK", "MAX_DEVICE_MESSAGE", "CallScope", "copy_context", "device_check", "in_backward",
    "is_device_check_error", "kwarg", "require", "size_in", "tracing",
]

#: what starts the message of a failed :func:`device_check` (a compiled call raises it from inside torch, where no
#: safepad raise site shows; :func:`is_device_check_error` reads it). A constant: recording the messages at trace
#: time would be a side effect in traced code (a graph break)
DEVICE_CHECK_MARK = "safepad check failed: "
#: CUDA's ``torch._assert_async(t, msg)`` refuses a message of this many bytes or more (``RuntimeError: Message length
#: must be smaller than 255``), whether or not the check holds: a :func:`device_check`'s message, the mark included,
#: must be shorter (ASCII, so characters are bytes)
MAX_DEVICE_MESSAGE = 255

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


def size_in(n: Any, options: tuple) -> bool:
    """``n in options`` for a size ``n`` that may be symbolic: compared with ``==`` one option at a time.

    Under ``torch.compile``, ``s0 in (1, s0)`` for a dynamic size ``s0`` (a batch size dynamo made dynamic after a
    call of another batch size) evaluated to False in the traced pre-hook, so the inputs of a re-laid call were not
    reordered while its outputs were put back: a right-padded compiled prefill after a compiled packed call of one
    row returned a padded row's outputs permuted (recurrent_gemma, 1.0 off the row alone; make fuzz).
    """
    for option in options:
        if n == option:
            return True
    return False


def device_check(ok: Tensor, message: str) -> None:
    """Fail when the one-element bool tensor ``ok`` is False, without a host sync.

    On CPU: ``RuntimeError`` carrying ``DEVICE_CHECK_MARK + message``. On CUDA: a device-side assert, whose Python
    exception lacks the message and after which the process's CUDA context is lost (docs/limits.md, "Device checks"):
    a user's input that can be checked on the host is checked there instead. ``message`` (ASCII) must keep the
    whole under :data:`MAX_DEVICE_MESSAGE` characters, or CUDA refuses it even when ``ok`` holds; a longer one raises
    ``ValueError`` here, on every device, so that a test reaching the call fails on CPU too.
    """
    full = DEVICE_CHECK_MARK + message
    if len(full) >= MAX_DEVICE_MESSAGE or not full.isascii():
        raise ValueError(
            f"safepad: a device check's message must be ASCII and shorter than {MAX_DEVICE_MESSAGE} characters with "
            f"its mark (CUDA's torch._assert_async refuses it), got {len(full)}: {message[:80]!r}..."
        )
    torch._assert_async(ok, full)


def is_device_check_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed :func:`device_check` of safepad's: compiled code raises it as a ``RuntimeError``
    from inside torch (its raise site is not in safepad), carrying the check's message."""
    return isinstance(exc, RuntimeError) and DEVICE_CHECK_MARK in str(exc)


def require(ok: Tensor | bool, message: str, device_message: str | None = None) -> None:
    """One check for eager and traced code: ``ok`` (a Python bool, or a one-element bool tensor) must hold.

    A Python bool (a static fact: a shape, a dtype) raises ``ValueError(message)`` at once. A tensor is read on
    the host in eager mode (one sync; ``ValueError``) and checked on the device while tracing (no graph break:
    :func:`device_check` with ``device_message``, by default ``message``, which must then be short).
    """
    if not isinstance(ok, Tensor):
        if not ok:
            raise ValueError(message)
    elif tracing():
        device_check(ok, message if device_message is None else device_message)
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
#: every :class:`CallScope` made (module-level ones: the call context, the cache's call flag, the SP context)
_SCOPES: list[CallScope] = []


class CallScope(Generic[T]):
    """A stack of per-call values (innermost last), per thread, readable by eager and traced code alike.

    Eager code reads a :class:`contextvars.ContextVar` (so a ``contextvars.copy_context`` snapshot, as the
    checkpoint wrapper takes, carries the value). Dynamo cannot trace a ContextVar, so every push also goes onto a
    plain list, one per thread (``threading.local``), which traced code reads: compiled code reads it at run time
    in the calling thread, whether the push ran traced (``torch.compile(model)``: the hooks are traced) or eagerly
    around a compiled ``forward``, so concurrent calls in other threads never see each other's values.

    A push made while tracing reaches the list only (the compiled code replays the append), never the ContextVar.
    Code that runs eagerly inside such a call (a frame dynamo runs uncompiled: past its recompile limit, or one it
    skips) must still see that value: each list entry records whether its push was traced, and an eager read whose
    innermost entry was pushed traced returns that entry (the ContextVar holds an outer call's value, or none).
    """

    def __init__(self, name: str, default: T | None = None):
        self.name = name
        self.default = default
        self._var: contextvars.ContextVar[T | None] = contextvars.ContextVar(name, default=default)
        self._local = threading.local()
        _SCOPES.append(self)
        # created now for the importing thread: compiled code guards on whether the attribute exists, and
        # creating it in the first compiled call would make the second call recompile
        self._local.stack = []

    def _entries(self) -> list[tuple[T | None, bool]]:
        """This thread's stack of ``(value, pushed while tracing)`` (innermost last)."""
        entries = getattr(self._local, "stack", None)
        if entries is None:
            entries = self._local.stack = []
        return entries

    def stack(self) -> list[T | None]:
        """This thread's pushed values (innermost last); what traced code reads."""
        return [value for value, _ in self._entries()]

    def push(self, value: T | None) -> Any:
        """A call begins: ``value`` is current until :meth:`pop` of the returned token."""
        traced = tracing()
        self._entries().append((value, traced))
        if traced:
            return _TRACED_TOKEN
        return self._var.set(value)

    def pop(self, token: Any) -> None:
        """The call of :meth:`push`'s ``token`` ends."""
        entries = self._entries()
        if entries:
            entries.pop()
        # (a traced push's token may come back to an eager pop as an equal string, not the same object)
        if not (isinstance(token, str) and token == _TRACED_TOKEN):
            self._var.reset(token)

    def current(self) -> T | None:
        """The innermost value pushed in this thread (eager: in this context, unless that push was traced), or
        ``default``."""
        entries = self._entries()
        if tracing():
            return entries[-1][0] if entries else self.default
        if entries and entries[-1][1]:
            return entries[-1][0]  # pushed by traced code, which never set the ContextVar
        return self._var.get()

    def set_eager(self, value: T | None) -> contextvars.Token:
        """Set the eager value only (inside a ``contextvars`` snapshot: changes that snapshot alone)."""
        return self._var.set(value)

    def reset_eager(self, token: contextvars.Token) -> None:
        self._var.reset(token)


def copy_context() -> contextvars.Context:
    """``contextvars.copy_context()`` in which every :class:`CallScope` reads what its ``current()`` reads now.

    A value pushed by traced code never reached its ContextVar (:class:`CallScope`); it is set in the copy, so a
    snapshot taken eagerly inside such a call (a checkpointed layer's, for its recompute in backward, when the
    stack no longer holds it) carries it.
    """
    snapshot = contextvars.copy_context()
    for scope in _SCOPES:
        entries = scope._entries()
        if entries and entries[-1][1]:
            snapshot.run(scope._var.set, entries[-1][0])
    return snapshot

"""CUDA's rules for ``torch._assert_async`` (a device check), emulated on CPU, for tests only.

On CUDA, ``torch._assert_async(t, msg)`` differs from the CPU kernel in two ways that no CPU run shows:

1. **The message must be shorter than 255 bytes**, whether or not the check holds: the CUDA kernel copies it into a
   fixed 256-byte buffer and refuses a longer one before launching (``RuntimeError: Message length must be smaller
   than 255``, aten's ``_assert_async_msg_cuda``). The CPU kernel takes any length.
2. **A failing check is a device-side assert**: the kernel traps, the Python exception reads ``CUDA error:
   device-side assert triggered`` without the check's message (that is only printed to stderr by the device), it
   surfaces at some later call rather than at the check, and the process's CUDA context is lost: every later CUDA
   call fails the same way until the process restarts. The CPU kernel raises ``RuntimeError(msg)`` at once.

:func:`install` (done session-wide by ``tests/conftest.py``) emulates rule 1 for every call on CPU:

* eager calls and compiled graphs that call the aten op at run time (``backend="eager"``, ``"aot_eager"``, ...): the
  CPU kernels of ``aten::_assert_async.msg`` and ``aten::_functional_assert_async.msg`` are replaced (a
  ``torch.library`` override, removed by :func:`uninstall`) by ones that check the length first;
* graphs compiled by inductor, which lowers the op into the generated code (C++ ``throw`` on CPU, Triton
  ``tl.device_assert`` on CUDA) and never calls the aten op at run time: ``torch._assert_async`` itself is
  replaced by a function that checks the length before calling the original, which dynamo puts in the graph (or
  inlines) and runs on fake tensors while it traces, so a long message fails the compile.

:func:`opaque_device_asserts` emulates rule 2 for a block: a failing check raises :data:`CUDA_ASSERT_MESSAGE` without
the check's message, and every later check in the block raises it too (the lost context). Tests use it to show that
a user's bad input that can be checked on the host raises a clear ``ValueError`` instead of relying on a device
check. (Graphs compiled by inductor throw their own C++ error on CPU: the block covers eager calls and graphs that
call the aten op.)
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "CUDA_ASSERT_MESSAGE",
    "MAX_MESSAGE_BYTES",
    "OpaqueAsserts",
    "install",
    "installed",
    "message_too_long",
    "opaque_device_asserts",
    "uninstall",
]

#: CUDA's ``_assert_async`` takes messages shorter than this many bytes (UTF-8), checked whether or not the assert
#: holds (aten ``_assert_async_msg_cuda``: ``Msg::MAX_MSG_LENGTH - 1``)
MAX_MESSAGE_BYTES = 255
#: what CUDA raises for a longer message
TOO_LONG_MESSAGE = f"Message length must be smaller than {MAX_MESSAGE_BYTES}"
#: what the Python exception of a failed device-side assert reads on CUDA (the check's message is not in it)
CUDA_ASSERT_MESSAGE = (
    "CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously reported at some other API "
    "call, so the stacktrace below might be incorrect."
)

_LOCK = threading.Lock()
_STATE: dict[str, Any] = {}


def message_too_long(message: str) -> bool:
    """Whether CUDA's ``_assert_async`` refuses ``message`` (255 bytes or more, UTF-8)."""
    return len(message.encode("utf-8")) >= MAX_MESSAGE_BYTES


class OpaqueAsserts:
    """The state of an :func:`opaque_device_asserts` block: ``failed`` once a check failed in it (the emulated CUDA
    context is then lost: every later check raises too), ``messages`` the messages of the failed checks (what the
    device would print to stderr)."""

    def __init__(self) -> None:
        self.failed = False
        self.messages: list[str] = []


_OPAQUE: list[OpaqueAsserts] = []  # innermost last
#: torch's own ``torch._assert_async`` (a compiled graph may keep calling the replacement after :func:`uninstall`)
_ORIGINAL = torch._assert_async


def _check_length(message: str) -> None:
    if message_too_long(message):
        raise RuntimeError(TOO_LONG_MESSAGE)


def _assert_msg_cpu(value: Tensor, message: str) -> None:
    """aten ``_assert_async.msg`` on CPU, with CUDA's rules."""
    _check_length(message)
    opaque = _OPAQUE[-1] if _OPAQUE else None
    if opaque is not None and opaque.failed:
        raise RuntimeError(CUDA_ASSERT_MESSAGE)  # the context is lost: every later CUDA call fails
    n = value.numel()
    if n == 0:
        raise RuntimeError("Boolean value of Tensor with no values is ambiguous")
    if n > 1:
        raise RuntimeError("Boolean value of Tensor with more than one value is ambiguous")
    if bool(value):
        return
    if opaque is not None:
        opaque.failed = True
        opaque.messages.append(message)
        raise RuntimeError(CUDA_ASSERT_MESSAGE)
    raise RuntimeError(message or "Assertion is failed")


def _functional_assert_msg_cpu(value: Tensor, message: str, dep_token: Tensor) -> Tensor:
    """aten ``_functional_assert_async.msg`` on CPU, with CUDA's rules."""
    _assert_msg_cpu(value, message)
    return dep_token.clone()


def _python_assert_async(*args: Any, **kwargs: Any) -> None:
    """``torch._assert_async`` with CUDA's message length rule checked first (also while dynamo traces it)."""
    message = args[1] if len(args) > 1 else kwargs.get("assert_msg")
    if isinstance(message, str):
        _check_length(message)
    return _ORIGINAL(*args, **kwargs)


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return "library" in _STATE


def install() -> None:
    """Emulate CUDA's message length rule for every ``_assert_async`` on CPU (see the module docstring).

    Idempotent; :func:`uninstall` restores torch's kernels and ``torch._assert_async``."""
    with _LOCK:
        if "library" in _STATE:
            return
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": the point
            lib.impl("_assert_async.msg", _assert_msg_cpu, "CPU")
            lib.impl("_functional_assert_async.msg", _functional_assert_msg_cpu, "CPU")
        _STATE["library"] = lib
        torch._assert_async = _python_assert_async


def uninstall() -> None:
    """Undo :func:`install` (nothing when it is not in effect)."""
    with _LOCK:
        lib = _STATE.pop("library", None)
        if lib is None:
            return
        lib._destroy()
        torch._assert_async = _ORIGINAL


@contextlib.contextmanager
def opaque_device_asserts() -> Iterator[OpaqueAsserts]:
    """A block in which a failing ``_assert_async`` behaves as on CUDA: ``RuntimeError`` reading
    :data:`CUDA_ASSERT_MESSAGE`, without the check's message, and every later check in the block raises it too.

    Installs :func:`install` for the block if it is not in effect. Yields an :class:`OpaqueAsserts` (``failed``,
    ``messages``)::

        with opaque_device_asserts() as asserts:
            with pytest.raises(ValueError, match="attention_mask"):   # a host check: a clear error, no lost context
                model(input_ids=ids, attention_mask=bad_mask)
        assert not asserts.failed
    """
    was = installed()
    if not was:
        install()
    state = OpaqueAsserts()
    _OPAQUE.append(state)
    try:
        yield state
    finally:
        _OPAQUE.remove(state)
        if not was:
            uninstall()

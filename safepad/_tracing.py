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

import torch
from torch import Tensor

__all__ = ["device_check", "require", "tracing"]


def tracing() -> bool:
    """True while dynamo traces the calling code (``torch.compile``)."""
    return torch.compiler.is_compiling()


def device_check(ok: Tensor, message: str) -> None:
    """Raise ``RuntimeError(message)`` when the one-element bool tensor ``ok`` is False, without a host sync."""
    torch._assert_async(ok, message)


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

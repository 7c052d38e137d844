"""Facts established once about a tensor's values, so that later checks need no host read.

On an accelerator every value check (``bool((seq_idx < 0).any())``, ``bool((A > 0).any())``) is a host sync,
and a model call that repeats it in every mixer layer pays one per layer. Instead the model-level hook
(``safepad.wrap``) validates the call's boundaries once and *records* what it established on the tensor it
hands to the mixers (the call context's ``seq_idx``); the ops read the record instead of re-checking.

A record holds for the tensor's current ``_version``: any in-place write to it (or to a view of it) bumps the
version and voids the record, and a derived tensor (a slice, a gather, a cast that copies) carries none, so
it is checked again. A tensor no hook has seen (an op called directly) is checked by the op, which records
the result the same way. Nothing is recorded or read while tracing (``torch.compile`` checks on the device).

Facts that follow from how a tensor was built need no check at all: the Mamba1 mixers build
``A = -exp(A_log)`` and record it as non-positive, so ``selective_scan`` skips its sign check (a host read per
layer) without caching anything per parameter version, which an optimizer step would void every step.
A write through ``.data`` bypasses the version counter (as it bypasses autograd): do not write a recorded
tensor's values through ``.data``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from .._tracing import tracing

__all__ = ["fact", "record"]

_ATTR = "_safepad_facts"


def record(t: Tensor, **facts: Any) -> Tensor:
    """Record ``facts`` (name -> value) about ``t``'s current values; returns ``t``. A no-op while tracing."""
    if tracing() or not isinstance(t, Tensor):
        return t
    prev = t.__dict__.get(_ATTR)
    merged = dict(prev[1]) if prev is not None and prev[0] == t._version else {}
    merged.update(facts)
    setattr(t, _ATTR, (t._version, merged))
    return t


def fact(t: object, name: str, default: Any = None) -> Any:
    """The fact ``name`` recorded about ``t`` at its current version, else ``default`` (always while tracing)."""
    if not isinstance(t, Tensor) or tracing():
        return default
    rec = t.__dict__.get(_ATTR)
    if rec is None or rec[0] != t._version:
        return default
    return rec[1].get(name, default)

"""A wrapped mixer's call inside a continuous-batching step: packed ``[1, T]`` in, rows of the step through the
mixer's padded cached path, packed ``[1, T]`` out (:mod:`safepad.serving.step`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import Tensor

from ..context import BOUNDARY_KWARGS, current_context
from .step import RowGroup, ServingStep, SlotRowsCache

__all__ = ["SERVED_KINDS", "serving_mixer_call", "serving_step"]

#: mixer kinds (``MixerSpec.kind``) whose generic forward takes ``(hidden_states, <cache>, attention_mask)`` and
#: keeps its whole state through ``safepad.cache.read_states`` / ``write_states``: these run in a served step
SERVED_KINDS = ("mamba2", "mamba1", "gated_delta", "short_conv")

#: per-token keyword arguments of the packed call that mean nothing to a row of the step
_PACKED_ONLY = (*BOUNDARY_KWARGS, "position_ids", "cache_position", "seq_idx")

_SIGNATURES: dict[Callable[..., Any], inspect.Signature] = {}


def serving_step() -> ServingStep | None:
    """The continuous-batching step of the model call in progress, or None (any other call)."""
    ctx = current_context()
    return None if ctx is None else ctx.serving


def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    sig = _SIGNATURES.get(fn)
    if sig is None:
        sig = _SIGNATURES[fn] = inspect.signature(fn)
    return sig


def serving_mixer_call(module: Any, generic: Callable[..., Any], step: ServingStep, args: tuple, kwargs: dict) -> Any:
    """``generic(module, *args, **kwargs)`` run once per row group of ``step`` (its decode steps, its prefill
    chunks), each on its rows ``[n, L, D]`` and its slots; the outputs packed back to ``[1, T, D]``."""
    sig = _signature(generic)
    bound = sig.bind(module, *args, **kwargs)
    names = list(sig.parameters)
    hidden = bound.arguments[names[1]]
    if not isinstance(hidden, Tensor) or hidden.dim() != 3 or tuple(hidden.shape[:2]) != (1, step.T):
        raise ValueError(
            f"{type(module).__name__}: a continuous-batching step of {step.T} packed tokens reached this mixer with "
            f"hidden states of shape {tuple(getattr(hidden, 'shape', ()))}; expected [1, {step.T}, D]"
        )
    outs = [_group_call(generic, sig, names, bound, group, hidden) for group in step.groups]
    if isinstance(outs[0], tuple):
        return (step.pack([o[0] for o in outs]), *outs[0][1:])
    return step.pack(outs)


def _group_call(generic, sig: inspect.Signature, names: list[str], bound, group: RowGroup, hidden: Tensor) -> Any:
    """The mixer on one row group: its rows, its mask, a cache view of its slots."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    arguments = dict(bound.arguments)
    arguments[names[1]] = group.unpack(hidden)  # [n, L, D]
    rows_cache = SlotRowsCache(group)
    var_kw = next((n for n, p in sig.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    extra = dict(arguments.get(var_kw, {})) if var_kw is not None else {}
    if var_kw is not None:
        arguments[var_kw] = extra
    for space in (arguments, extra):
        for name, value in list(space.items()):
            if isinstance(value, PagedAttentionCache):
                space[name] = rows_cache
    for name in _PACKED_ONLY:
        extra.pop(name, None)
    if "attention_mask" in sig.parameters:
        arguments["attention_mask"] = group.mask  # [n, L] right-padded rows, None when every chunk has L tokens
    else:
        extra["attention_mask"] = group.mask
    if not any(v is rows_cache for v in (*arguments.values(), *extra.values())):
        arguments[names[2]] = rows_cache  # the mixer was called without its cache: give it the step's
    call = inspect.BoundArguments(sig, arguments)
    return generic(*call.args, **call.kwargs)

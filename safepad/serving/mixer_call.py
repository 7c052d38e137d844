"""A wrapped mixer's call inside a continuous-batching step: packed ``[1, T]`` in, rows of the step through the
mixer's padded cached path, packed ``[1, T]`` out (:mod:`safepad.serving.step`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import Tensor

from ..context import BOUNDARY_KWARGS, current_context
from .step import ServingStep, SlotRowsCache

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
    """``generic(module, *args, **kwargs)`` run on the rows of ``step``; its ``[N, L, D]`` output packed back."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    sig = _signature(generic)
    bound = sig.bind(module, *args, **kwargs)
    arguments = bound.arguments
    names = list(sig.parameters)
    hidden_name = names[1]
    hidden = arguments[hidden_name]
    if not isinstance(hidden, Tensor) or hidden.dim() != 3 or tuple(hidden.shape[:2]) != (1, step.T):
        raise ValueError(
            f"{type(module).__name__}: a continuous-batching step of {step.T} packed tokens reached this mixer with "
            f"hidden states of shape {tuple(getattr(hidden, 'shape', ()))}; expected [1, {step.T}, D]"
        )
    arguments[hidden_name] = step.unpack(hidden)  # [N, L, D]
    rows_cache = SlotRowsCache(step)
    var_kw = next((n for n, p in sig.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    extra = arguments.get(var_kw, {}) if var_kw is not None else {}
    for space in (arguments, extra):
        for name, value in list(space.items()):
            if isinstance(value, PagedAttentionCache):
                space[name] = rows_cache
    for name in _PACKED_ONLY:
        extra.pop(name, None)
    if "attention_mask" in sig.parameters:
        arguments["attention_mask"] = step.mask  # [N, L] right-padded rows, None when every chunk has L tokens
    else:
        extra["attention_mask"] = step.mask
    if not any(v is rows_cache for v in (*arguments.values(), *extra.values())):
        cache_param = names[2]
        arguments[cache_param] = rows_cache  # the mixer was called without its cache: give it the step's
    out = generic(*bound.args, **bound.kwargs)
    if isinstance(out, tuple):
        return (step.pack(out[0]), *out[1:])
    return step.pack(out)

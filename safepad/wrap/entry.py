"""The model pre-hook's entry: name the call's arguments, validate them once, and hand back the facts.

A wrapped model's pre-hook (:mod:`safepad.wrap.hooks`) starts every top-level call here. :func:`name_arguments`
binds the positional arguments to the forward's parameter names, so that every later read of the call (the
hook, :mod:`safepad.wrap.slot_calls`, the packed-call policy) sees ``model(ids, mask)`` as
``model(input_ids=ids, attention_mask=mask)``: a positional ``attention_mask`` used to reach the model unchecked
(a 4-D one hiding pads answered 0.4-0.6 off the row alone, silently). :func:`read_call` then runs every check
of the call's arguments, once and in one place, and returns them as :class:`CallFacts`, which the rest of the
call reads instead of the arguments:

* (first, before any other step) a call of sequence length 0: :func:`refuse_empty_call`;
* the cache's batch size (:func:`safepad.wrap.cache_rows.check_cache_rows`), eager and traced alike;
* the 2-D mask's values (0 / 1; on the host, or on the device for a one-token step) and a 4-D mask's
  structure (:mod:`safepad.layout.masks`, :mod:`safepad.layout.masks_4d`), except inside the model's wrapped
  ``generate``, which checked the caller's mask on the host when it started;
* eager cached calls: the columns the cache has read (:mod:`safepad.wrap.mask_history`), with the cache's
  length read once per call (a host read on some caches), which :func:`safepad.wrap.slot_calls.slot_justify` and the
  token counts reuse.

Which check runs where (host or device) and what a failed device check does on CUDA: docs/limits.md,
"Device checks".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._tracing import tracing
from ..cache import cache_from_kwargs, forget_read
from ..layout.masks import check_mask_values
from ..layout.masks_4d import check_four_d_mask
from .cache_rows import check_cache_rows, cover_row_ops
from .generate import generated_step, mask_checked_by_generate
from .mask_history import check_mask_history, forget_mask_history
from .slot_record import _past_length

__all__ = ["CallFacts", "name_arguments", "read_call", "refuse_empty_call", "two_d_mask"]


def name_arguments(positional: tuple[str, ...], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with the positional arguments moved into ``kwargs`` under their parameter names
    (``positional``: the forward's :func:`~safepad.wrap.plan.positional_names`). A call with more positional
    arguments than names (a forward taking ``*args``) or naming an argument twice is handed on unchanged (named, the
    extra ones would bind to the first parameters; the forward raises Python's own ``TypeError`` for the other)."""
    if not args or len(args) > len(positional):
        return args, kwargs
    named = dict(zip(positional, args))
    if any(k in kwargs for k in named):
        return args, kwargs
    return (), {**named, **kwargs}


def two_d_mask(mask: Any) -> torch.Tensor | None:
    """The 2-D ``[B, M]`` padding mask of a call's ``attention_mask``: generate() with a compileable cache (e.g. one
    without attention layers) hands in per-layer-type masks, whose recurrent layers' entry is the 2-D one."""
    if isinstance(mask, dict):
        return next((m for m in mask.values() if isinstance(m, torch.Tensor) and m.dim() == 2), None)
    return mask


def refuse_empty_call(module: nn.Module, ids: torch.Tensor | None) -> None:
    """A call of sequence length 0 (``input_ids`` ``[B, 0]`` or ``inputs_embeds`` ``[B, 0, D]``) raises, naming the
    shape and the fix. The stock model fails on such a call of every family too (an ``IndexError`` or a reshape
    error from deep inside it), and so did the wrapped one, from whichever op met the empty sequence first. A
    static fact: no host read, and a compiled call (whose size-0 dimensions dynamo specialises) raises the same."""
    if ids is None or ids.dim() < 2 or ids.shape[1] != 0:
        return
    name = "inputs_embeds" if ids.is_floating_point() else "input_ids"
    raise ValueError(
        f"{type(module).__name__}: {name} of shape {list(ids.shape)} holds no token (sequence length 0), and a forward "
        "needs at least one token per row (the stock model fails on such a call too). Skip the call when there is "
        "nothing to run (an empty chunk, a batch of empty sequences); to keep a row without tokens in a batch, pad it "
        "to the batch's length with attention_mask 0 on its pads; a cached sequence continues with its next token."
    )


@dataclass(frozen=True, eq=False)
class CallFacts:
    """What :func:`read_call` established about a top-level call of a wrapped model, before any re-lay.

    ``ids`` is the call's ``input_ids`` ``[B, T]`` or ``inputs_embeds`` ``[B, T, D]``; ``mask`` its 2-D padding mask
    ``[B, M]`` (``M >= T``; None: none, or a 4-D one); ``cache`` the cache handed in (None: none).
    """

    ids: torch.Tensor
    #: ``(B, T)``
    shape: tuple[int, int]
    #: the call is being traced by dynamo (``torch.compile``): host reads are not allowed
    traced: bool
    cache: Any
    mask: torch.Tensor | None
    #: eager calls inside the model's wrapped ``generate``: the mask values were checked when it started
    checked_by_generate: bool
    #: eager only: a one-token step bringing the token the wrapped ``generate`` appended (every row's token is real)
    generated: bool
    #: eager calls with a cache: the tokens it holds (one read per call); None: no cache, traced, or it cannot tell
    past: int | None
    #: ``mask`` as bool ``[B, M]`` (``mask`` itself when bool), made once by the value check
    #: (:func:`~safepad.layout.masks.check_mask_values`) for the rest of the call; None where no check made it
    #: (inside the model's wrapped ``generate``, no 2-D mask)
    real: torch.Tensor | None = None


def read_call(module: nn.Module, kwargs: dict, ids: torch.Tensor) -> CallFacts:
    """Validate a top-level call of ``module`` (its arguments by name, :func:`name_arguments`) once, and return
    its :class:`CallFacts`. Raises ``ValueError`` naming the problem and the fix (traced, or for a one-token step:
    checked on the device instead, docs/limits.md "Device checks")."""
    traced = tracing()
    cache = cache_from_kwargs(kwargs)[1]
    cover_row_ops(cache)  # its row operations move every state (cache_rows)
    B, T = ids.shape[0], ids.shape[1]  # (no int(): a symbolic size under torch.compile(dynamic=True) stays one)
    check_cache_rows(cache, B)  # a cache of another batch size: name it (eager and traced alike)
    attention_mask = kwargs.get("attention_mask")
    mask = two_d_mask(attention_mask)
    checked = not traced and mask_checked_by_generate(module)
    real = None
    if not checked:
        # eager: on the host (a clear ValueError), but on the device for a one-token step (no host sync per decode
        # step; on CUDA a failure loses the context). Inside the model's wrapped generate, which checked the
        # caller's mask on the host, nothing: every mask it hands in is that one, sliced or extended with ones.
        # (the check's bool copy of the mask serves the rest of the call)
        real = check_mask_values(mask, on_device=T == 1)
        # a 4-D mask hiding pads / boundaries reaches attention only: refused (one host read; traced: on the device)
        check_four_d_mask(attention_mask, type(module).__name__)
    past = None
    if not traced and cache is not None:
        forget_read(cache)  # a forward outside generate: generate's record of it is stale
        try:
            past = _past_length(cache)  # read once per call (a host read on some caches); slot_justify reuses it
        except ValueError:  # a cache that cannot tell its length: the model's forward (or slot_justify) raises it
            past = None
        if kwargs.get("use_cache") is not False:
            _follow_mask_history(module, cache, mask, T, past, checked, real)
    return CallFacts(
        ids=ids,
        shape=(B, T),
        traced=traced,
        cache=cache,
        mask=mask,
        checked_by_generate=checked,
        generated=not traced and generated_step(module, T, mask),
        past=past,
        real=real,
    )


def _follow_mask_history(
    module: nn.Module, cache: Any, mask: Any, T: int, past: int | None, checked: bool, real: Any = None
) -> None:
    """An eager cached call's 2-D mask must keep the columns its cache (holding ``past`` tokens; None: it cannot
    tell) has read (:mod:`safepad.wrap.mask_history`): checked on the host for a chunk, on the device for a one-token
    step outside ``generate``; inside the model's wrapped ``generate`` (whose masks never edit history) the record is
    dropped instead."""
    if checked:
        forget_mask_history(cache)
    elif past is not None:
        check_mask_history(type(module).__name__, cache, mask, T, past, step=T == 1, real=real)

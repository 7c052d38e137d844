"""A cached call's ``attention_mask`` may not edit the columns the cache has read.

A cached call's 2-D mask ``[B, L + T]`` covers the ``L`` tokens the cache holds and the call's ``T`` new ones. The
cache's recurrent states (and its attention keys) were computed from the columns an earlier call marked real or
pad: a column that was 1 then and is 0 now (or the reverse) asks the state to unsee (or to have seen) a token,
which no recurrent state can do, and stock silently answers it as if the edit had not happened for the recurrent
layers while its attention reads the edited mask (a result that matches neither reading).

Each wrapped eager cached call keeps the columns its cache has read on the cache (``[B, L]`` bool, the caller's
column order; :data:`MASK_ATTR`, moved by the cache's row operations and forgotten by ``reset()``:
:mod:`safepad.wrap.cache_rows`), and the next call's mask is compared with it:

* a call of several tokens (a prefill chunk): on the host, a ``ValueError`` naming the row, the column and the fix;
* a one-token step (a hand-written decode loop): on the device (:func:`safepad._tracing.device_check`, no host
  sync per step; on CPU the failure is turned into the same ``ValueError``; on CUDA it is a device-side assert,
  docs/limits.md "Device checks", check D9);
* inside the model's wrapped ``generate``: nothing (generate extends its mask with ones and never edits history);
  the record is dropped, so the first call after it only records;
* traced calls (``torch.compile``) neither check nor record: the record no longer matches the cache's length
  afterwards, and the next eager call only records.

A record whose length is not the cache's (a ``crop``, a call that raised, a compiled call) is not compared: the
call records afresh from its own mask when that covers the whole cache.
"""

from __future__ import annotations

from typing import Any

import torch

from .._tracing import device_check, is_device_check_error

__all__ = ["MASK_ATTR", "check_mask_history", "forget_mask_history"]

#: ``[B, L]`` bool tensor on a cache (its ``__dict__``): the attention-mask columns of the ``L`` tokens it has read
MASK_ATTR = "_safepad_read_mask"

_DEVICE_MESSAGE = (
    "attention_mask edits columns the cache has read (a cached 1 now 0, or 0 now 1): pass the earlier calls' "
    "columns unchanged (docs/limits.md, check D9)"
)


def forget_mask_history(cache: Any) -> None:
    """Drop the record of ``cache`` (a call whose mask safepad does not follow, e.g. inside ``generate``)."""
    if cache is not None and hasattr(cache, "__dict__"):
        cache.__dict__.pop(MASK_ATTR, None)


def _edit_error(model: str, now: torch.Tensor, before: torch.Tensor, offset: int) -> ValueError:
    """The ``ValueError`` naming the first edited ``(row, column)``: ``now`` / ``before`` ``[B, K]`` bool, the
    mask's first ``K`` columns and what the cache read there; ``offset`` the mask column of their first column."""
    row, col = (now != before).nonzero()[0].tolist()
    was, is_ = int(before[row, col]), int(now[row, col])
    return ValueError(
        f"{model}: attention_mask[{row}, {col + offset}] is {is_}, but the cache read that column as {was} at an "
        "earlier call: a cached call's mask covers the tokens the cache holds, and their recurrent states (and "
        "cached keys) cannot unsee a token or see one they skipped. Pass the earlier calls' mask columns unchanged "
        "(extend the mask with the new tokens' columns only); to drop or add a token in the past, run that row's "
        "sequence again from a fresh cache (or cache.reset())."
    )


def check_mask_history(
    model: str, cache: Any, mask: Any, T: int, past: int, *, step: bool, real: torch.Tensor | None = None
) -> None:
    """Compare a cached call's 2-D ``mask`` ``[B, M]`` (``M - T`` columns of cached tokens, then the call's ``T``)
    with what ``cache`` (holding ``past`` tokens) has read, then record the ``past + T`` columns it will hold.

    ``step``: a one-token step outside ``generate`` (checked on the device: no host sync); otherwise on the host.
    ``real``: ``mask`` as bool when the caller has it already (the value check's copy, ``[B, M]``).
    Raises ``ValueError`` naming the first edited row and column (on CUDA a failed step check is a device-side
    assert instead). A cache without a ``__dict__`` (or no 2-D mask) is left alone.
    """
    if cache is None or not hasattr(cache, "__dict__"):
        return
    if not (isinstance(mask, torch.Tensor) and mask.dim() == 2) or mask.shape[1] < T:
        forget_mask_history(cache)
        return
    B, M = mask.shape
    K = M - T  # cached columns the mask covers
    m = real if real is not None and real.shape == mask.shape and real.dtype == torch.bool else mask.to(torch.bool)
    if m is mask:
        m = mask.clone()  # the caller may write into its mask buffer in place later
    rec = cache.__dict__.get(MASK_ATTR)
    if isinstance(rec, torch.Tensor) and tuple(rec.shape) == (B, past) and 0 <= K <= past:
        before = rec[:, past - K :].to(m.device)  # [B, K]
        now = m[:, :K]
        if K == 0:
            pass
        elif step:
            try:
                device_check((now == before).all(), _DEVICE_MESSAGE)
            except RuntimeError as exc:  # CPU: the check failed at once; name the row and column
                if not is_device_check_error(exc):
                    raise
                raise _edit_error(model, now, before, 0) from None
        elif not bool((now == before).all()):
            raise _edit_error(model, now, before, 0)
        new = m if K == past else torch.cat([rec[:, : past - K].to(m.device), m], 1)  # [B, past + T]
    elif K == past:
        new = m  # the mask covers the whole cache: record it
    else:
        new = None
    if new is None:
        forget_mask_history(cache)
    else:
        cache.__dict__[MASK_ATTR] = new

"""Slot-justified cached calls while dynamo traces them: the re-lay decided on the device.

The traced half of :func:`safepad.wrap.slot_calls.slot_justify`. A traced call cannot read the mask on the host, so
a cached call on a cache that an eager call re-laid (a Python mark on the cache, read at trace time), and a first
cached prefill of a model whose attention counts slots, are re-laid with every decision a device tensor
(:class:`~safepad.layout.slots.SlotJustifiedCall` with ``on_device=True``): the chunk is always reordered pads
first and the cached slots always re-laid (each the identity where nothing moves), and the post-hook puts the
outputs back (:func:`safepad.wrap.slot_record.slot_restore`). A traced call that cannot keep a re-laid cache's
layout raises (:func:`check_traced_cache`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .._tracing import kwarg, size_in
from ..cache import cache_from_kwargs, cache_length, recurrent_only
from ..layout.slots import SlotJustifiedCall, _plain_dynamic
from .slot_record import (
    _PACKED_NAMES, _PADDED_FLAG, _RELAID_FLAG, SlotRecord, _ask_for_model_output, _attentions_wanted, _cache_wanted,
    _mrope, _defer_logits_to_keep, _install, _no_loss_function, _reorder_inputs, _take_labels,
)

if TYPE_CHECKING:
    from .plan import ModelPlan

__all__ = ["check_traced_cache", "traced_slot_step"]


def check_traced_cache(module: nn.Module, kwargs: dict) -> None:
    """While dynamo traces a cached call that :func:`traced_slot_step` cannot re-lay on the device: refuse a cache
    whose rows an eager call re-laid.

    The device re-lay needs the full-length 2-D ``attention_mask`` (the cached tokens plus the new ones: which of
    the cached slots are real) and a cache whose layers concatenate onto their keys (a ``DynamicCache``'s, re-laid
    in place). Without either, the call's mask and positions would address the caller's layout while the cache holds
    the justified one, silently wrong. A re-laid cache carries a Python attribute (set by
    :func:`~safepad.wrap.slot_record.slot_restore`), read here at trace time. (Also for a cache only decode steps
    re-laid, where no row's token may have been a pad: unknown on the host.)
    """
    cache = cache_from_kwargs(kwargs)[1]
    if cache is not None and getattr(cache, _RELAID_FLAG, False):
        raise ValueError(
            f"{type(module).__name__}: this cache holds rows that safepad re-laid in an eager call (a prompt with "
            "padding after real tokens, e.g. right padding), and this compiled call cannot keep that layout, so its "
            "result would be wrong: a compiled call on it needs the full-length 2-D attention_mask (the cached tokens "
            "plus the new ones, as generate() passes) and a DynamicCache (the default). Pass them, or make this call "
            "eagerly (torch.compiler.set_stance('force_eager')), or pad prompts on the left "
            "(tokenizer.padding_side = 'left')."
        )


def traced_slot_step(module: nn.Module, plan: ModelPlan, kwargs: dict, B: int, T: int) -> torch.Tensor | None:
    """While dynamo traces a cached call: keep the slot-justified layout of a cache a call has re-laid.

    A cache that an eager call re-laid (a chunk with padding after real tokens, or a decode step, which re-lays on
    the device whether or not its token is a pad; a Python mark read at trace time) holds every row
    ``[pads | real tokens]``, unlike the caller's mask. A call of ``T`` tokens with a 2-D ``attention_mask``
    ``[B, L + T]`` over a ``DynamicCache`` holding ``L`` slots is re-laid on the device as eager calls are
    (:class:`SlotJustifiedCall`, every decision a device tensor, :func:`_traced_relay`): a one-token step, and a
    chunk of several tokens (a chunked prefill, an assisted-decoding verify call), which is always reordered pads
    first and put back in the caller's order by the post-hook. ``kwargs`` is updated in place. Any other call on
    such a cache raises (:func:`check_traced_cache`).

    A cache no call re-laid is in the caller's layout and is served as it is. Returns the call's token mask
    ``[B, T]`` bool (in the justified order) when the call was re-laid, else None.
    """
    cache = cache_from_kwargs(kwargs)[1]
    if cache is None or not getattr(cache, _RELAID_FLAG, False):
        return _traced_first_prefill(module, plan, kwargs, cache, B, T)
    if recurrent_only(cache):
        return None
    mask = _rows_mask(kwargs, B)
    if mask is not None and _plain_dynamic_cache(cache):
        past_len = cache_length(cache)  # an int (a symbolic size under dynamic shapes): no host read
        if past_len > 0 and mask.shape[1] == past_len + T:
            return _traced_relay(module, plan, kwargs, cache, mask, B, T, past_len)
    check_traced_cache(module, kwargs)
    return None


def _traced_first_prefill(module: nn.Module, plan: ModelPlan, kwargs: dict, cache, B: int, T: int):
    """:func:`traced_slot_step` on a cache no call re-laid (or none handed in)."""
    if not plan.slot_sensitive or T < 2:
        return None
    mask = _rows_mask(kwargs, B)
    # a first cached prefill (no cache handed in, or an empty DynamicCache) of a model whose attention counts
    # slots (a sliding window, slot distances): re-laid on the device as eager re-lays it, so that its steps
    # count real tokens only (served in the caller's [real | pads] layout, a window counted the pads: LFM3
    # 0.27 from the row alone); a re-lay of rows without pads is the identity, and the post-hook marks the cache
    # re-laid. Other models, and caches holding tokens no call re-laid, are served in the caller's layout
    first = cache is None or (not recurrent_only(cache) and _plain_dynamic_cache(cache, empty=True))
    # a cache someone reads (not the config default's in a training step, which is built but not read)
    read = _cache_wanted(module, cache, kwargs.get("use_cache"))[2]
    if first and read and mask is not None and mask.shape[1] == T:
        return _traced_relay(module, plan, kwargs, cache, mask, B, T, 0)
    return None


def _rows_mask(kwargs: dict, B: int) -> torch.Tensor | None:
    """The call's 2-D ``attention_mask`` ``[B, L + T]`` when its rows are not packed (no ``seq_idx`` /
    ``cu_seq_lens_*`` tensor), else None: the calls a device re-lay can serve."""
    mask = kwargs.get("attention_mask")
    shaped = isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == B
    packed = any(isinstance(kwarg(kwargs, n), torch.Tensor) for n in _PACKED_NAMES)
    return mask if shaped and not packed else None


def _plain_dynamic_cache(cache, *, empty: bool = False) -> bool:
    """Do the attention layers of ``cache`` concatenate onto their keys (a ``DynamicCache``'s, re-laid in place)?

    ``empty=False``: every layer holding keys does, and at least one holds some (a cache to continue).
    ``empty=True``: a fresh cache: every layer with keys does, and none holds a token yet (at least one such layer).
    """
    layers = getattr(cache, "layers", None)
    if not layers or not hasattr(type(cache), "update"):
        return False
    kv = [lay for lay in layers if hasattr(lay, "keys")]  # the attention layers
    initialised = [lay for lay in kv if getattr(lay, "is_initialized", False)]
    if empty:
        return bool(kv) and not initialised and all(_plain_dynamic(lay) for lay in kv)
    held = [lay for lay in initialised if lay.keys is not None]
    return bool(held) and all(_plain_dynamic(lay) for lay in held)


def _traced_relay(
    module: nn.Module, plan: ModelPlan, kwargs: dict, cache, mask: torch.Tensor, B: int, T: int, past_len
) -> torch.Tensor:
    """The eager re-lay of :func:`slot_justify` while traced (every decision a device tensor), for ``T`` tokens.

    ``mask`` ``[B, L + T]``. A one-token step needs no reorder. A chunk is reordered pads first (``[B, T, ...]``
    inputs, ``position_ids`` ``[B, T]`` / ``[K, B, T]``), its outputs put back in the caller's order by the
    post-hook (:func:`~safepad.wrap.slot_record.slot_restore`), with ``logits_to_keep`` and a loss over ``labels``
    applied there, as eager. (The stack cannot be read while traced: a call inside generate() is served as one
    outside it, whose given positions are kept, generate's own counting each row's real tokens, and whose outputs
    are put back in the caller's order; a one-token step's other outputs need no restoring.)
    """
    m = mask.to(torch.bool)
    call = SlotJustifiedCall(m, past_len, on_device=True)  # justified mask, pad counts, order, re-lay: on the device
    for check in plan.slot_checks:
        check(module, call.mask)
    record = SlotRecord(None, (B, T), None, bool(getattr(cache, _PADDED_FLAG, False)))
    record.pads = call.pads()  # [B]: pad slots per row (unknown on the host; read by a later call without a mask)
    record.cache = cache
    module._safepad.slot_calls[-1] = record
    position_ids = kwargs.get("position_ids")
    if plan.accepts_position_ids and position_ids is None and not _mrope(module):
        kwargs["position_ids"] = call.position_ids().to(mask.device)  # [B, T]: cached real tokens + cumsum - 1
    elif T > 1 and isinstance(position_ids, torch.Tensor):
        if position_ids.dim() == 3 and position_ids.shape[2] == T and size_in(position_ids.shape[1], (1, B)):
            kwargs["position_ids"] = call.reorder(position_ids.permute(1, 2, 0)).permute(2, 0, 1)  # [K, B, T]
        elif position_ids.dim() == 2 and position_ids.shape[1] == T and size_in(position_ids.shape[0], (1, B)):
            kwargs["position_ids"] = call.reorder(position_ids)  # [B, T]
    if T > 1:
        labels = kwargs.get("labels")
        if labels is not None:
            if not callable(getattr(module, "loss_function", None)):
                raise _no_loss_function(module)
            _take_labels(module, kwargs, record, T)
        _reorder_inputs(call, kwargs, B, T, ("attention_mask", "position_ids"))
        _defer_logits_to_keep(kwargs, record)  # every position, put back in order, then the kept ones (post-hook)
    kwargs["attention_mask"] = call.mask.to(mask.dtype)  # [B, L + T]
    if T > 1 or _attentions_wanted(module, kwargs):
        _ask_for_model_output(module, plan, kwargs, record)
    _install(call, cache, kwargs, record)
    return call.token_mask

"""Slot-justified cached calls, for every family: cached rows stay ``[pads | real tokens]`` (eager calls).

The generic half of :mod:`safepad.layout.slots` inside the model hook: a cached call on rows with padding after
real tokens is re-laid so every cached row stays ``[pads | real tokens]`` (the left-padded layout stock produces;
:class:`~safepad.layout.slots.SlotJustifiedCall`): sliding windows, slot-relative positions and selected key
slots then see real tokens only, and a row's last real token is its last column. The post-hook puts the outputs
back in the caller's order (:mod:`safepad.wrap.slot_record`), except inside ``generate()``, which reads each row's
next token from the last column. A traced call is re-laid on the device instead (:mod:`safepad.wrap.traced_slot_calls`).
Cached calls also get each token's real position when the caller gives none (the cached real tokens plus
``cumsum(mask) - 1``; ``cache length + arange`` without padding), and inside ``generate()`` the mask decides the
2-D positions. A spec may add a ``slot_check(module, layout)`` option that refuses layouts its attention cannot
serve (Inkling's log scaling: ``safepad.specs.inkling_family``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .._tracing import size_in
from ..cache import CACHE_NAMES, recurrent_only
from ..layout.masks import has_holes, pads_after_real, pads_before_real
from ..layout.slots import SlotJustifiedCall
from .frames import generate_frame
from .generate import generated_step
from .hidden_routes import HiddenStateRoute, route_wanted
from .slot_record import (
    _PACKED_NAMES, _PADDED_FLAG, _PADS_ATTR, _RELAID_FLAG, _SHIFT_ATTR, SlotRecord, _ask_for_model_output,
    _arange_positions, _attentions_wanted, _cache_wanted, _defer_logits_to_keep, _install, _mask_positions, _mrope,
    _no_loss_function, _past_length, _reorder_inputs, _take_labels,
)

if TYPE_CHECKING:
    from .plan import ModelPlan

__all__ = ["slot_justify"]


def _arg(args: tuple, kwargs: dict, params: tuple[str, ...], name: str):
    if name in kwargs:
        return kwargs[name]
    i = params.index(name) if name in params else -1
    return args[i] if 0 <= i < len(args) else None


def _decode_step(
    module: nn.Module, plan: ModelPlan, args: tuple, kwargs: dict, B: int, mask: torch.Tensor, past_len: int
):
    """A one-token step on a cache safepad never re-laid, whose attention counts no slots: no host read.

    The cache rows are in stock's layout (left pads at most, no pad after a real token), so the step needs no
    re-lay; a pad step token is masked by the mixers (``decode_mask``) and by full attention. Missing positions
    come from the mask on the device: ``mask.sum(1) - 1`` (the row's real tokens before this one).
    """
    params = plan.params
    if not plan.accepts_position_ids or _mrope(module) or _arg(args, kwargs, params, "position_ids") is not None:
        return args, kwargs
    named = dict(zip(params, args))
    named.update(kwargs)
    named["position_ids"] = _mask_positions(mask, 1, past_len)  # [B, 1]: the mask covers the cache and the step
    return (), named


def slot_justify(
    module: nn.Module,
    plan: ModelPlan,
    args: tuple,
    kwargs: dict,
    B: int,
    T: int,
    past_len: int | None = None,
    real: torch.Tensor | None = None,
):
    """Keep the slot-justified cache layout (``safepad.layout.slots``) for this call; returns ``(args, kwargs)``.

    ``past_len``: the tokens the call's cache holds when the caller read it already (else read here). ``real``:
    the call's ``attention_mask`` as bool, when the caller made that already (the value check's,
    :class:`~safepad.wrap.entry.CallFacts`); read only where the mask is still of its shape."""
    params = plan.params
    if any(isinstance(_arg(args, kwargs, params, n), torch.Tensor) for n in _PACKED_NAMES):
        return args, kwargs  # packed rows: the packed policy applies (no cache)
    cache = next((c for n in CACHE_NAMES if (c := _arg(args, kwargs, params, n)) is not None), None)
    explicit, wanted, read = _cache_wanted(module, cache, _arg(args, kwargs, params, "use_cache"))
    mask = _arg(args, kwargs, params, "attention_mask")
    if past_len is None:
        past_len = _past_length(cache)
    if past_len == 0 and isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] > T and _uncounted(cache):
        # a recurrent-only cache nobody counts (Mamba, Mamba2, FalconMamba keep the stock cache class): its states
        # do not depend on where the cached tokens sat, so the full-length mask is read on its last T columns
        mask = mask[:, -T:]
        (args, kwargs) = (), {**dict(zip(params, args)), **kwargs, "attention_mask": mask}
    flagged = bool(getattr(cache, _PADDED_FLAG, False))
    if not (isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == B):
        if past_len > 0 and mask is None and (flagged or _holds_step_pads(cache)):
            raise ValueError(
                f"{type(module).__name__}: this cache holds padded rows, but the call came without an attention_mask. "
                "Pass the full-length attention_mask (the cached tokens plus the new ones, as generate() does) so "
                "that the pads stay masked."
            )
        if mask is None and wanted:
            return _with_cache_positions(module, plan, args, kwargs, B, T, past_len)
        return args, kwargs
    generating = generate_frame()
    if generating is not None and wanted and past_len > 0 and mask.shape[1] == T > past_len:
        # generate() continuing from a cache without attention layers hands in the whole sequence (transformers
        # slices off the cached tokens only for attention caches): run the new ones only
        (args, kwargs), T = _drop_cached_prefix(plan, args, kwargs, B, T, past_len), T - past_len
    if (
        T == 1 and wanted and past_len > 0 and mask.shape[1] == past_len + 1 and not plan.slot_sensitive
        and not getattr(cache, _RELAID_FLAG, False)
    ):
        return _decode_step(module, plan, args, kwargs, B, mask, past_len)
    # a one-token step on a re-laid cache or with slot-counting attention: decided on the device (SlotJustifiedCall)
    step = T == 1 and wanted and past_len > 0 and mask.shape[1] == past_len + 1
    if real is not None and real.shape == mask.shape:
        m = real  # [B, M] bool, the value check's
    elif step and read and not mask.is_floating_point():
        m = mask  # [B, L + 1] bool or 0 / 1 integers (checked): SlotJustifiedCall sums it as it is, no bool copy
    else:
        m = mask.to(torch.bool)
    if not read:
        # no cache, or only the config default's in a training step (nobody reads it): the caller's layout, unless
        # a hybrid's row has a pad between real tokens (a hole). Its attention would count the hole in its rotary
        # positions (when none are given), its sliding window and slot distances, while the row alone has no such
        # token: the call is re-laid like a first cached call (each row [pads | real], positions from the mask
        # unless given), its outputs put back in order, and a loss taken over them (post-hook)
        holes = (
            (plan.hybrid or plan.slot_distances) and past_len == 0 and mask.shape[1] == T and T > 1
            and bool(has_holes(m).any())
        )
        # generate(use_cache=False) re-feeds the whole sequence and reads each row's next token from its LAST
        # column: rows with pads after real tokens (a right-padded prompt, then new tokens after the pads) are
        # re-laid pads first, and the outputs stay in that order within generate (the mixers' compaction and
        # positions from the mask make each row its tokens alone)
        refed = (
            generating is not None and past_len == 0 and mask.shape[1] == T and bool(pads_after_real(m).any())
            and not module.training and _arg(args, kwargs, params, "labels") is None
        )
        if not (holes or refed):
            for check in plan.slot_checks:
                check(module, m[:, -T:])
            return _with_real_positions(module, plan, args, kwargs, m, T, past_len)
        uncached_holes = True
    else:
        uncached_holes = False
    if mask.shape[1] != past_len + T:
        if cache is None and mask.shape[1] > T:
            raise ValueError(
                f"{type(module).__name__}: attention_mask has {mask.shape[1]} columns but the call brings {T} tokens "
                "and no cache: a mask longer than the call's tokens continues the tokens a cache has read. Pass the "
                "cache the earlier calls filled (the output's cache; a model whose output carries none, such as "
                "RecurrentGemma, needs cache = DynamicCache(config=model.config) handed to its prefill and every later "
                f"call); to start a new sequence instead, pass a mask of the call's {T} columns."
            )
        if flagged or not bool(m.all()):
            raise ValueError(
                f"{type(module).__name__}: attention_mask has {mask.shape[1]} columns but the cache holds {past_len} "
                f"tokens and the call brings {T}: with padding, pass the full-length mask (cached tokens plus new "
                f"ones, {past_len + T} columns), as generate() does"
            )
        return _with_cache_positions(module, plan, args, kwargs, B, T, past_len)
    if not step and bool(m.all()):  # no padding anywhere: nothing to re-lay (one host read for the common case)
        return _with_cache_positions(module, plan, args, kwargs, B, T, past_len)
    # a cache no call re-laid holds its rows as the caller's mask lays them out (a one-token step with a pad leaves
    # [reals | pad], _decode_step): its slots are re-laid from that layout; a re-laid one is justified, and so is
    # every cache of slot-counting attention (each of its cached calls, decode steps included, comes here; a
    # one-token step re-lays on the device without marking the cache) (a cache without attention layers has no
    # slots to re-lay)
    justified = (
        step or plan.slot_sensitive or bool(getattr(cache, _RELAID_FLAG, False)) or cache is None
        or recurrent_only(cache)
    )
    # generate's own next token is real in every row (a host-side fact): the step moves no cached slot
    real_step = step and generated_step(module, T, mask)
    call = SlotJustifiedCall(m, past_len, past_slots=None if justified else m[:, :past_len], real_step=real_step)
    for check in plan.slot_checks:
        check(module, call.mask)
    record = SlotRecord(None, (B, T), None, flagged if step else not bool(call.mask.all()), restore=generating is None)
    if step and not real_step:  # (generate's own step adds no pad slot: the cache keeps what it had)
        record.pads = call.mask  # [B, L + 1] bool, the cache's slots after the step (False: a pad): no count made
    record.cache = cache
    module._safepad.slot_calls[-1] = record
    position_ids = _arg(args, kwargs, params, "position_ids")
    # generate() extends position_ids from each row's LAST column, a pad after a right-padded prompt: inside
    # generate the mask decides the positions (they equal generate's own wherever those are right)
    # (a multimodal-rotary model computes missing positions from its own inputs: only 2-D text ones are replaced)
    replace_positions = plan.accepts_position_ids and (
        (position_ids is None and not _mrope(module))
        or (generating is not None and isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2)
    )
    # [K, B, T] positions (multimodal rotary, e.g. text + 3 M-RoPE axes): generate() extends them from the last
    # column too; the shift of each row's last real token from its last column is kept with the cache
    # (only within the generate() call that extends them: a later one computes them from the mask again)
    stacked = (
        generating is not None and isinstance(position_ids, torch.Tensor) and position_ids.dim() == 3
        and size_in(position_ids.shape[1], (1, B)) and position_ids.shape[2] == T
    )
    kept = getattr(cache, _SHIFT_ATTR, None) if stacked and past_len > 0 else None
    shift = kept.shift if kept is not None and kept.frame is generating else None
    if stacked and shift is None and T > 1 and bool((~m[:, -1]).any()):  # (one token: its shift is 0)
        record.shift = (generating, _last_real_shift(position_ids, m[:, -T:]))
    # (a left-padded prefill too: stock counts its pads as positions, while the steps that continue it count
    # each row's real tokens only, so a rotary distance across the cached and new tokens would be off by the pads)
    if call.noop and shift is None and not replace_positions:
        return args, kwargs
    named = dict(zip(params, args))  # every argument by name from here on
    named.update(kwargs)
    if replace_positions:
        named["position_ids"] = call.position_ids().to(mask.device)  # [B, T]: cached real tokens + cumsum - 1
    elif shift is not None:
        named["position_ids"] = position_ids + shift.to(position_ids.device)
    elif stacked and uncached_holes:
        # generate(use_cache=False) re-feeds every column with the [K, B, T] positions it extended from each
        # row's last prompt column, a pad after a right-padded prompt: the new tokens continue the last real one
        named["position_ids"] = _refed_stacked_positions(position_ids, m)
    if call.noop:
        return (), named
    if uncached_holes and ("use_cache" in params or plan.var_kwargs):
        named["use_cache"] = False  # (a training step's config default): nobody reads that cache
    scored = explicit or uncached_holes
    if named.get("labels") is not None and scored and callable(getattr(module, "loss_function", None)):
        # the cache is wanted (or the row has holes): re-lay the row, score the caller's row (post-hook, slot_restore)
        _take_labels(module, named, record, T)
        record.restore = True
    elif named.get("labels") is not None:
        if explicit:
            raise _no_loss_function(module)
        if "use_cache" in params or plan.var_kwargs:
            named["use_cache"] = False  # the cache only the config default would build is of no use to a loss call
        if position_ids is None:
            named.pop("position_ids", None)
        record.padded = False
        return (), named
    # (replaced position_ids are in the justified order already)
    _reorder_inputs(call, named, B, T, ("attention_mask", "labels") + (("position_ids",) if replace_positions else ()))
    named["attention_mask"] = call.mask if step else call.mask.to(mask.dtype)  # [B, L + T] (a step: bool, as the
    # model reads a 2-D mask: no cast here, none in its mask construction)
    if call.order is not None:
        _defer_logits_to_keep(named, record)  # every position, put back in order, then the kept ones (post-hook)
    # (attention weights address cache slots even when the chunk keeps its order; a step's other outputs need no
    # restoring: one token keeps its order)
    if record.restore and not (step and not _attentions_wanted(module, named)):
        _ask_for_model_output(module, plan, named, record)
    _install(call, cache, named, record)
    if record.restore and call.order is not None and route_wanted(module, named):
        record.route = HiddenStateRoute(call, module, (B, T))  # returned hidden states on the loss path
    return (), named


def _holds_step_pads(cache) -> bool:
    """Does ``cache`` hold pad slots that a decode step put there (one host read; a call without a mask)? The
    record (:data:`~safepad.wrap.slot_record._PADS_ATTR`) is an eager step's justified mask ``[B, N]`` bool, or a
    traced call's pad count per row ``[B]`` long."""
    pads = getattr(cache, _PADS_ATTR, None)
    if not isinstance(pads, torch.Tensor):
        return False
    if bool((~pads).any() if pads.dtype == torch.bool else pads.any()):
        return True
    cache.__dict__.pop(_PADS_ATTR, None)  # none: a call without a mask adds none either, read no more
    return False


def _uncounted(cache) -> bool:
    """A recurrent-only cache that holds states but cannot tell how many tokens it has read."""
    if cache is None or not recurrent_only(cache):
        return False
    try:
        cache.get_seq_length()
    except ValueError:
        return any(any(getattr(layer, "has_previous_state", {}).values()) for layer in cache.layers)
    return False


def _drop_cached_prefix(plan: ModelPlan, args: tuple, kwargs: dict, B: int, T: int, past_len: int):
    """Every ``[B, T, ...]`` input but the mask cut to its last ``T - past_len`` tokens (``[K, B, T]`` ones too)."""
    named = dict(zip(plan.params, args))
    named.update(kwargs)
    for name, value in list(named.items()):
        if name == "attention_mask" or not isinstance(value, torch.Tensor) or value.dim() < 2:
            continue
        if value.shape[1] == T and size_in(value.shape[0], (1, B)):
            named[name] = value[:, past_len:]
        elif name == "position_ids" and value.dim() == 3 and value.shape[2] == T:
            named[name] = value[..., past_len:]
    return (), named


def _last_real_shift(position_ids: torch.Tensor, cur: torch.Tensor) -> torch.Tensor:
    """``[K, B, 1]``: per row, the positions of its last real token minus those of its last column.

    ``position_ids`` ``[K, B, T]`` (or ``[K, 1, T]``), ``cur`` ``[B, T]`` bool (True = real). Rows without a real
    token get 0.
    """
    B, T = cur.shape
    pos = position_ids.expand(position_ids.shape[0], B, T)
    last = (cur.long() * torch.arange(1, T + 1, device=cur.device)).argmax(1)  # [B]: index of the last real token
    idx = last.to(pos.device)[None, :, None].expand(pos.shape[0], B, 1)
    shift = pos.gather(2, idx) - pos[..., -1:]
    return shift * cur.any(1).to(shift.dtype)[None, :, None].to(shift.device)


def _refed_stacked_positions(position_ids: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The ``[K, B, T]`` positions of a call that ``generate(use_cache=False)`` re-feeds whole, with the tokens it
    generated after a prompt that ends in pads continuing from the prompt's last real token.

    generate() extends positions from each row's last column: where the prompt of a row ends in a pad (column
    ``c``, the row's last pad, with a real token before it), the columns after ``c`` got ``P[c] + 1 + j``; they
    should get ``P[r] + 1 + j`` (``r`` the last real column before ``c``), so they are shifted by ``P[r] - P[c]``
    (per rotary row, as :func:`_last_real_shift` does for a cache). A row whose columns after its last pad are
    prompt tokens (a hole in the prompt: their positions count its real tokens already, ``P[c + 1] = P[r] + 1``)
    is left as it is; where both readings hold the shift is 0. ``m`` ``[B, T]`` bool (True = real).
    """
    K = position_ids.shape[0]
    B, T = m.shape
    pos = position_ids.expand(K, B, T)
    out = pos.clone()
    cols = torch.arange(T, device=m.device)
    for b in range(B):
        pads = (~m[b]).nonzero().flatten()
        if pads.numel() == 0 or int(pads[-1]) == T - 1:
            continue
        c = int(pads[-1])
        reals = (m[b, :c]).nonzero().flatten()
        if reals.numel() == 0:
            continue
        r = int(reals[-1])
        p = pos[:, b]  # [K, T]
        if not bool((p[:, c + 1] == p[:, c] + 1).all()):
            continue  # the columns after the last pad are the prompt's own (a hole)
        out[:, b] = torch.where(cols.to(p.device) > c, p + (p[:, r : r + 1] - p[:, c : c + 1]), p)
    return out


def _with_cache_positions(module: nn.Module, plan: ModelPlan, args: tuple, kwargs: dict, B: int, T: int, past_len: int):
    """A cached call without padding and without ``position_ids``: positions ``past_len + arange(T)``.

    Some families (Bamba in transformers 5.24) restart their rotary positions at 0 on every call when
    ``position_ids`` are not given, so a chunked prefill or a decode step would see the wrong distances.
    """
    params = plan.params
    if past_len == 0 or not plan.accepts_position_ids or _mrope(module):
        return args, kwargs
    if _arg(args, kwargs, params, "position_ids") is not None:
        return args, kwargs
    ids = next((v for n in ("input_ids", "inputs_embeds") if isinstance(v := _arg(args, kwargs, params, n), torch.Tensor)), None)
    named = dict(zip(params, args))
    named.update(kwargs)
    named["position_ids"] = _arange_positions(past_len, B, T, ids.device)  # [B, T]
    return (), named


def _with_real_positions(module: nn.Module, plan: ModelPlan, args: tuple, kwargs: dict, m: torch.Tensor, T: int,
                         past_len: int):
    """An uncached call of a hybrid with left-padded rows and without ``position_ids``: positions ``cumsum(m) - 1``.

    ``m`` ``[B, T]`` bool (True = real). Each real token gets its position in its sequence alone (pads 0), the
    positions the cached prefill and decode steps of ``generate`` give it (:func:`_decode_step`), instead of its
    slot (``arange(T)``). Rotary attention depends only on the distance, but in bf16 / fp16 the rotated queries
    and keys round differently at shifted positions: an RL training forward over ``[pads | prompt | completion]``
    then differs from the rollout's cached steps by ~1e-3 in log-prob. Right-padded rows already have these
    positions on their real tokens; nothing changes when no row has a pad before a real token.
    """
    params = plan.params
    if not plan.hybrid or past_len != 0 or T < 2 or m.shape[1] != T:
        return args, kwargs
    if not plan.accepts_position_ids or _mrope(module) or _arg(args, kwargs, params, "position_ids") is not None:
        return args, kwargs
    if not bool(pads_before_real(m).any()):  # no row has a pad before a real token (one host read)
        return args, kwargs
    named = dict(zip(params, args))
    named.update(kwargs)
    named["position_ids"] = _mask_positions(m, T)  # [B, T]
    return (), named

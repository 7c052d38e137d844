"""What a slot-justified call leaves for the post-hook, and the post-hook's half: outputs back in the caller's order.

The pre-hook halves (eager :func:`safepad.wrap.slot_calls.slot_justify`, traced
:func:`safepad.wrap.traced_slot_calls.traced_slot_step`) re-lay a cached call so every cached row stays
``[pads | real tokens]`` (:class:`~safepad.layout.slots.SlotJustifiedCall`) and leave a :class:`SlotRecord` on the
module; :func:`slot_restore` reads it back after the forward: every per-token output back in the caller's order
(except inside ``generate()``), ``logits_to_keep`` and a loss over the caller's labels applied there, and the marks
a later call reads (padded, re-laid, pad slots per row, a position shift) set on the cache. Also the small pieces
both pre-hook halves share (return a ModelOutput, attention weights wanted, multimodal rotary positions), and the
ones the eager and the traced hook share (is a cache wanted, the cache's length, positions from a mask).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._config import text_config_value
from .._tracing import size_in
from ..cache import CACHE_NAMES, cache_length, recurrent_only
from ..layout.slots import SlotJustifiedCall

if TYPE_CHECKING:
    from .plan import ModelPlan

__all__ = ["SlotRecord", "slot_restore"]

_PACKED_NAMES = ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k")
#: the keyword arguments a causal-LM forward hands to its ``loss_function`` beside ``labels`` (``ForCausalLMLoss``)
_LOSS_KWARGS = ("num_items_in_batch", "shift_labels", "ignore_index")
#: marks a cache whose rows hold pads (in the justified layout): a later call must pass the full attention mask
_PADDED_FLAG = "_safepad_padded_slots"
#: marks a cache whose rows an eager call re-laid (pads moved, or a decode step's device re-lay): its later calls
#: are re-laid too, traced ones on the device (traced_slot_step)
_RELAID_FLAG = "_safepad_relaid_slots"
#: device tensor on a cache: its pad slots after a decode step re-laid on the device (the host never read whether
#: the step token was a pad), an eager step's justified mask ``[B, N]`` bool (False: a pad; no count made per step)
#: or a traced call's pad count per row ``[B]`` long; a later call without an attention_mask checks it
_PADS_ATTR = "_safepad_slot_pads"
#: ``[K, B, 1]`` added to the ``[K, B, T]`` position_ids generate() extends from a right-padded prompt's last column
_SHIFT_ATTR = "_safepad_position_shift"


class _GenerateShift:
    """The position shift ``[K, B, 1]`` of stacked positions kept on a cache for the rest of one ``generate`` call
    (``frame``: that call's frame). A copied or pickled cache drops it: a copy continues in another call, where the
    shift does not apply (and a frame can be neither copied nor pickled)."""

    __slots__ = ("frame", "shift")

    def __init__(self, frame: Any, shift: torch.Tensor) -> None:
        self.frame, self.shift = frame, shift

    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __reduce__(self):
        return (type(None), ())


class SlotRecord:
    """What the post-hook needs to undo a slot-justified call (``call`` None: nothing to undo)."""

    __slots__ = (
        "as_tuple", "cache", "call", "keep", "labels", "loss_kwargs", "padded", "pads", "restore", "route", "shape",
        "shift",
    )

    def __init__(self, call: SlotJustifiedCall | None, shape: tuple[int, int], keep, padded: bool,
                 restore: bool = True):
        self.call, self.shape, self.keep, self.padded = call, shape, keep, padded
        # False inside generate(): it reads each row's next token from the LAST column, which the justified
        # layout makes the row's last real token
        self.restore = restore
        self.shift = None  # [K, B, 1] position shift to keep with the cache (stacked positions in generate)
        # labels of a loss call with an explicit cache on re-laid rows: the loss is taken by the post-hook, over the
        # logits put back in the caller's order (the model itself would score the re-laid row)
        self.labels = None
        self.loss_kwargs: dict = {}
        # the caller asked for a tuple (return_dict=False, or a config that returns tuples): the forward returns a
        # ModelOutput, whose fields are named (slot_restore puts each back by its name), and to_tuple() is returned
        self.as_tuple = False
        # the cache's pad slots after a decode step (device; kept with the cache by slot_restore): _PADS_ATTR
        self.pads = None
        # the cache handed in: marked re-laid / padded when the output carries none (RecurrentGemma)
        self.cache = None
        # hidden states asked for with gradients on a re-laid call: the forward continues from their caller-order
        # views, which the post-hook returns (safepad.wrap.hidden_routes)
        self.route = None


def _attentions_wanted(module: nn.Module, named: dict) -> bool:
    """Does the call return attention weights (``output_attentions``, else the model config's)?"""
    wanted = named.get("output_attentions")
    return bool(getattr(getattr(module, "config", None), "output_attentions", False) if wanted is None else wanted)


def _ask_for_model_output(module: nn.Module, plan: ModelPlan, named: dict, record: SlotRecord) -> None:
    """A caller asking for a tuple gets the ModelOutput's ``to_tuple()`` (the post-hook restores the fields by name).

    A tuple holds no field names, so the post-hook could not tell hidden states from attention weights or router
    logits; stock returns exactly ``ModelOutput.to_tuple()`` for ``return_dict=False``.
    """
    wanted = named.get("return_dict")
    if wanted is None:
        wanted = text_config_value(module, "return_dict", True) is not False
    if wanted or not ("return_dict" in plan.params or plan.var_kwargs):
        return
    named["return_dict"] = True
    record.as_tuple = True


def _take_labels(module: nn.Module, named: dict, record: SlotRecord, T: int) -> None:
    """Move the caller's ``labels`` (and ``num_items_in_batch``) from the call's arguments to ``record``: the
    post-hook takes the loss over the logits put back in the caller's order (:func:`_with_loss`).

    ``logits_to_keep`` that keeps fewer (or more) positions than the ``[B, T]`` labels hold raises here, before the
    forward: the loss needs a logit for every labelled position (stock fails on it too, on a shape mismatch inside
    its loss).
    """
    labels, keep = named["labels"], named.get("logits_to_keep")
    kept = _kept_positions(keep, T)
    if kept is not None and isinstance(labels, torch.Tensor) and labels.dim() >= 1 and kept != labels.shape[-1]:
        asked = f"logits_to_keep={keep}" if isinstance(keep, int) else f"logits_to_keep (a tensor of {kept} indices)"
        raise ValueError(
            f"{type(module).__name__}: labels together with {asked}, which keeps the logits of {kept} of the call's "
            f"{T} positions, while the labels hold {labels.shape[-1]} per row: the loss needs a logit for every "
            "labelled position. Pass logits_to_keep=0 (every position, the default) with labels, or leave out the "
            "labels and compute the loss from the kept logits."
        )
    record.labels = named.pop("labels")
    # the loss's own arguments go with the labels (the post-hook scores the caller's order): shift_labels ([B, T],
    # the pre-shifted targets context-parallel training passes, which the loss reads instead of shifting labels)
    # would otherwise be re-laid with the inputs and reach a forward that computes no loss
    record.loss_kwargs = {k: named.pop(k) for k in _LOSS_KWARGS if named.get(k) is not None}


def _reorder_inputs(call: SlotJustifiedCall, named: dict, B: int, T: int, skip: tuple[str, ...]) -> None:
    """Every ``[B, T, ...]`` (or ``[1, T, ...]``) current-token input in ``named``, and ``[K, B, T]``
    ``position_ids``, put in the call's justified order, in place; the inputs named in ``skip`` are left as they
    are."""
    for name, value in list(named.items()):
        if name in skip or not isinstance(value, torch.Tensor) or value.dim() < 2:
            continue
        if name == "position_ids" and value.dim() == 3 and value.shape[2] == T and size_in(value.shape[1], (1, B)):
            named[name] = call.reorder(value.permute(1, 2, 0)).permute(2, 0, 1)  # [K, B, T]
            continue
        if value.shape[1] == T and size_in(value.shape[0], (1, B)):  # [B, T, ...] current-token inputs
            named[name] = call.reorder(value)


def _defer_logits_to_keep(named: dict, record: SlotRecord) -> None:
    """A reordered call computes every position's logits (``logits_to_keep=0``): the post-hook puts them back in
    the caller's order, then keeps the ones asked for (``record.keep``, :func:`_restored`)."""
    keep = named.get("logits_to_keep")
    if "logits_to_keep" in named and not (isinstance(keep, int) and keep == 0):
        named["logits_to_keep"] = 0
        record.keep = keep


def _install(call: SlotJustifiedCall, cache, named: dict, record: SlotRecord) -> None:
    """Route the cache's updates through the call's re-lay, give the chunk's ``position_ids`` the stored positions
    of the cached slots the re-lay moves into it (:meth:`~safepad.layout.slots.SlotJustifiedCall.with_moved_positions`),
    and hand the call to ``record`` (the post-hook uninstalls it)."""
    call.install(cache)
    if isinstance(named.get("position_ids"), torch.Tensor):
        named["position_ids"] = call.with_moved_positions(named["position_ids"])  # a cached position history
    record.call = call


def _kept_positions(keep, T: int) -> int | None:
    """How many of a call's ``T`` positions ``logits_to_keep`` keeps, as the stock forward slices them
    (``hidden_states[:, -keep:]`` for an int, ``hidden_states[:, keep]`` for a 1-D index tensor); None when it
    keeps every position (``0`` or absent) or is of another kind (left to the model)."""
    if isinstance(keep, int):
        return None if keep == 0 else (min(keep, T) if keep > 0 else max(T + keep, 0))
    if isinstance(keep, torch.Tensor) and keep.dim() == 1 and keep.dtype != torch.bool:
        return keep.shape[0]
    return None


def _no_loss_function(module: nn.Module) -> ValueError:
    """The error for labels on a re-laid cached call of a model without a ``loss_function`` to score them with."""
    return ValueError(
        f"{type(module).__name__}: labels together with a cache on rows with padding after real tokens, and no "
        "loss_function to score the caller's row with: compute the loss without a cache (use_cache=False), or pad "
        "on the left."
    )


def _mrope(module: nn.Module) -> bool:
    """Multimodal rotary positions (``[3, B, T]``, computed by the model from its inputs): never synthesised here."""
    rope = text_config_value(module, "rope_parameters", None) or text_config_value(module, "rope_scaling", None)
    return isinstance(rope, dict) and any(k.startswith("mrope") for k in rope)


def _cache_wanted(module: nn.Module, cache, use_cache) -> tuple[bool, bool, bool]:
    """Is a cache wanted for this call: ``(explicit, wanted, read)``, the one rule of the eager and traced hooks.

    ``cache`` is the cache handed in (or None), ``use_cache`` the call's own argument (or None). ``explicit``: the
    caller asked for one (a cache passed, or ``use_cache=True``). ``wanted``: the call builds or continues one
    (explicit, or ``use_cache`` not given and the config's ``use_cache`` on). ``read``: someone reads it, i.e.
    ``wanted`` except the config default's in a training step (nobody reads that one: such a call is served as an
    uncached one). ``module.training`` is read only where it decides (``wanted`` and not ``explicit``).
    """
    explicit = cache is not None or use_cache is True
    wanted = explicit or (use_cache is None and bool(text_config_value(module, "use_cache", False)))
    # the training difference: the config default's cache in a training step is wanted (built) but not read
    read = explicit or (wanted and not module.training)
    return explicit, wanted, read


def _past_length(cache, *, traced: bool = False):
    """Tokens the cache holds; 0 without a cache, and for a recurrent-only cache safepad has not counted yet
    (``CachePreHook``, which runs after this hook, starts counting it or raises when it cannot).

    ``traced=False`` (the eager hook): an ``int`` (a host read), and a ``ValueError`` from a cache with attention
    layers propagates. ``traced=True`` (the traced hook, which reads it for positions only): the size as the cache
    answers it, an int or a symbolic size under dynamic shapes (``int()`` would specialise it), and any
    ``ValueError`` reads as 0 (as before; the model's own forward asks the cache for its length too, and raises
    there). transformers raises that error only for caches without attention layers.
    """
    if cache is None or not hasattr(cache, "get_seq_length"):
        return 0
    try:
        return cache_length(cache) if traced else int(cache_length(cache))  # (5.25: not layer 0's count tensor)
    except ValueError:
        if traced or recurrent_only(cache):
            return 0
        raise


def _arange_positions(past, B: int, T: int, device) -> torch.Tensor:
    """``[B, T]`` positions ``past + arange(T)`` of a call without padding (``past``: the cached tokens, an int or
    a symbolic size)."""
    return (past + torch.arange(T, device=device))[None].expand(B, T)


def _mask_positions(mask: torch.Tensor, T: int, past=0) -> torch.Tensor:
    """``[B, T]`` long: each of the call's ``T`` tokens' position among its row's real tokens, on the mask's device.

    ``mask`` ``[B, M]`` (True / 1 = real) covers the call's tokens in its last ``T`` columns, and ``M - T`` cached
    ones before them: ``cumsum(mask) - 1`` over its last ``T`` columns (a pad takes the previous real token's, 0
    before any), plus the cached tokens the mask does not cover (``past + T - M``; ``past`` an int or a symbolic
    size). Device-tensor math, no host read. A one-token call takes the row's sum (no ``[B, M]`` cumsum).
    """
    real = mask.long()
    pos = real.sum(1, keepdim=True) if T == 1 else real.cumsum(1)[:, -T:]
    pos = (pos - 1).clamp(min=0)
    offset = past + T - mask.shape[1]
    return pos if isinstance(offset, int) and offset == 0 else pos + offset


def _with_loss(record: SlotRecord, call: SlotJustifiedCall | None, output, module: nn.Module):
    """The output of a loss call whose labels the pre-hook took (a re-laid row with an explicit cache): logits back
    in the caller's order, and the model's own ``loss_function`` over them and the caller's labels (plus the
    router loss of MoE models that return one), as the stock forward computes it."""
    if not hasattr(output, "keys"):
        raise ValueError(
            f"{type(module).__name__}: labels together with a cache on rows with padding after real tokens need a "
            "ModelOutput to put the loss in (return_dict=True), or compute the loss without a cache (use_cache=False)"
        )
    if call is not None and call.order is not None:
        output = _restored(record, call, output)
    logits = output["logits"]
    vocab = text_config_value(module, "vocab_size", logits.shape[-1])
    loss = module.loss_function(logits=logits, labels=record.labels, vocab_size=vocab, **record.loss_kwargs)
    aux = output.get("aux_loss") if hasattr(output, "get") else None
    if aux is not None and text_config_value(module, "output_router_logits", False):
        loss = loss + text_config_value(module, "router_aux_loss_coef", 0.0) * aux.to(loss.device)
    return type(output)(**{"loss": loss, **{k: v for k, v in output.items() if k != "loss"}})


def slot_restore(record: SlotRecord, output, module: nn.Module):
    """Post-hook half of :func:`~safepad.wrap.slot_calls.slot_justify`: outputs back in the caller's order, the
    cache marked padded."""
    call = record.call
    if call is not None:
        call.uninstall()
    if record.route is not None:
        record.route.remove()
    if output is None:  # the forward raised
        return None
    cache = next((c for n in CACHE_NAMES if (c := getattr(output, n, None)) is not None), record.cache)
    if record.shift is not None and cache is not None:
        setattr(cache, _SHIFT_ATTR, _GenerateShift(*record.shift))
    slots = cache is not None and not recurrent_only(cache)  # slots only in attention layers
    if record.padded and slots:
        setattr(cache, _PADDED_FLAG, True)
    if record.pads is not None and slots:
        setattr(cache, _PADS_ATTR, record.pads)
    # (a decode step re-lays on the device without the host knowing whether some row's token was a pad: its
    # cache is marked too, so that a traced call serves it re-laid (a step) or refuses it (traced_slot_step))
    relaid = call is not None and (call.order is not None or call.relay)
    if relaid and slots:
        setattr(cache, _RELAID_FLAG, True)  # a Python fact a traced call reads (check_traced_cache)
    if record.labels is not None:
        output = _with_loss(record, call, output, module)
    elif call is None:
        return None
    else:
        output = _restored(record, call, output)
    return output.to_tuple() if record.as_tuple and hasattr(output, "to_tuple") else output


def _restored(record: SlotRecord, call: SlotJustifiedCall, output):
    """``output`` with every per-token tensor back in the caller's order (outside ``generate()``).

    ``[B, T, ...]`` tensors (logits, hidden states, nested or not), per-layer attention weights ``[B, H, T, K]``
    (:meth:`~safepad.layout.slots.SlotJustifiedCall.restore_attention`: keys as the caller's full-mask columns)
    and flattened per-token router logits ``[B * T, E]``. A tuple output (``return_dict=False``) was computed as a
    ModelOutput (:func:`~safepad.wrap.slot_calls.slot_justify`) and is returned as its ``to_tuple()``, so both
    hold the same tensors.
    """
    B, T = record.shape

    def fix(v, name=""):
        if name in CACHE_NAMES:
            return v  # (a legacy tuple cache holds [B, H, S, D] slots, not tokens)
        if isinstance(v, (tuple, list)):
            return type(v)(fix(x, name) for x in v)
        if not isinstance(v, torch.Tensor):
            return v
        if record.restore and "attentions" in name and v.dim() == 4 and v.shape[0] == B and v.shape[2] == T:
            return call.restore_attention(v)
        if record.restore and "router_logits" in name and v.dim() == 2 and v.shape[0] == B * T:
            return call.restore(v.view(B, T, -1)).reshape(v.shape)
        if v.dim() >= 2 and tuple(v.shape[:2]) == (B, T):
            if record.restore:
                v = call.restore(v) if record.route is None else record.route.caller_view(v)
            if name == "logits" and record.keep is not None:
                v = v[:, -record.keep :] if isinstance(record.keep, int) else v[:, record.keep]
        return v

    if hasattr(output, "keys") and hasattr(output, "__setitem__"):
        for k in list(output.keys()):
            output[k] = fix(output[k], k)
        return output
    if isinstance(output, tuple):
        return tuple(fix(v, "hidden_states" if isinstance(v, tuple) else "") for v in output)
    return fix(output)

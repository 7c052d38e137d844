"""One adapter between safepad and transformers' caches: names, recurrent states, token counts.

* **Names.** transformers has called the cache argument of a forward (and the cache field of its output)
  ``cache_params`` and ``past_key_values`` (5.23) and ``cache`` (5.24). :data:`CACHE_NAMES` lists them;
  :func:`cache_argument` reads the name a forward declares and :func:`output_cache` the field an output
  class declares, so no caller decides by family or by version.
* **States.** transformers 5.x keeps a recurrent layer's states in ``cache.layers[layer_idx]``
  (``LinearAttentionLayer``): ``conv_states[i]`` ``[B, D, K]`` (the last K conv inputs, oldest first) and
  ``recurrent_states[i]`` (the SSM / delta-rule state). The stock cache layer never sees the padding mask,
  so safepad computes the final states itself and writes them whole through :func:`write_states`.
* **Token counts.** A cache with no attention layer (a Nemotron-H, Bamba, ... whose layers are all Mamba)
  cannot answer ``get_seq_length`` / ``get_mask_sizes`` in transformers 5.23 / 5.24: they raise
  ``ValueError: get_seq_length can only be called on Attention layers``, which the model's own forward
  (when ``position_ids`` are not given), its mask construction and ``generate`` all call. The model hooks of
  :func:`safepad.wrap` hand such models a cache that counts the tokens it has seen
  (:func:`track_seq_length`) and answers from that count; attention-bearing caches are left alone.
  From transformers 5.25 on, the linear layers count their tokens themselves (``cumulative_length_linear``, which
  safepad's mixers advance as stock's do: :func:`write_states`), so a cache that an unwrapped model (or a plain
  forward) filled still says how many tokens it has read (:func:`layer_token_count`): safepad serves that count
  instead of refusing the cache as one of unknown history.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import sys
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import torch
from torch import Tensor

from transformers import cache_utils as _cache_utils  # at import: a traced call cannot import (lazy module)

from ._tracing import CallScope, kwarg, tracing

logger = logging.getLogger(__name__)

__all__ = [
    "CACHE_NAMES",
    "CachePreHook",
    "CachedStates",
    "cache_post_hook",
    "cache_argument",
    "cache_from_kwargs",
    "cache_length",
    "expect_count",
    "forget_read",
    "is_recording",
    "layer_token_count",
    "fresh_cache_is_recurrent_only",
    "needs_token_count",
    "settle_count",
    "new_tracked_cache",
    "output_cache",
    "read_states",
    "recurrent_only",
    "track_seq_length",
    "write_states",
]

#: Every name transformers has given the cache argument of a forward and the cache field of its output
#: (5.23: ``cache_params`` for mamba / mamba2 / falcon_mamba and their mixers, ``past_key_values`` elsewhere;
#: 5.24: ``cache`` everywhere). A new name must be added here: ``tests/test_cache_names.py`` fails until it is.
CACHE_NAMES: tuple[str, ...] = ("cache", "cache_params", "past_key_values")


def cache_argument(forward: Any) -> str | None:
    """The cache argument that ``forward`` (a function or a module) declares, one of :data:`CACHE_NAMES`.

    ``None`` when it declares none (a ``**kwargs``-only forward, or a model without a cache). A mixer patched
    by :func:`safepad.wrap` answers for its original class (its own forward takes every name).
    """
    if not inspect.isroutine(forward) and hasattr(forward, "forward"):
        original = getattr(type(forward), "_safepad_original_class", None)
        fn = original.forward if original is not None else forward.forward
    else:
        fn = forward
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    return next((n for n in CACHE_NAMES if n in params), None)


def output_cache(output: Any) -> Any:
    """The cache a model output carries, under whichever of :data:`CACHE_NAMES` its class declares (or None).

    Reads the declared dataclass field, so transformers' deprecated aliases (``out.past_key_values`` on 5.24)
    are never touched; plain dicts and objects are read by attribute / key.
    """
    if output is None:
        return None
    if is_dataclass(output):
        declared = {f.name for f in fields(output)}
        name = next((n for n in CACHE_NAMES if n in declared), None)
        return None if name is None else getattr(output, name, None)
    if isinstance(output, dict):
        return next((output[n] for n in CACHE_NAMES if output.get(n) is not None), None)
    return next((getattr(output, n) for n in CACHE_NAMES if getattr(output, n, None) is not None), None)


def cache_from_kwargs(kwargs: dict) -> tuple[str | None, Any]:
    """``(name, cache)`` of the first cache passed in ``kwargs`` under any of :data:`CACHE_NAMES`."""
    for name in CACHE_NAMES:
        if kwarg(kwargs, name) is not None:  # read by traced hooks: no guard on the other keys
            return name, kwargs[name]
    return None, None


@dataclass
class CachedStates:
    """States of one layer before this call: ``None`` when the cache holds nothing yet (first prefill)."""

    conv: Tensor | None
    recurrent: Tensor | None

    @property
    def has_previous(self) -> bool:
        return self.conv is not None or self.recurrent is not None


def _check_cache(cache, layer_idx: int) -> None:
    if not hasattr(cache, "get_conv_state"):
        raise ValueError(
            f"safepad expected a transformers Cache with recurrent layers (DynamicCache(config=...)), got "
            f"{type(cache).__name__}"
        )


def read_states(cache, layer_idx: int, state_idx: int = 0, *, conv: bool = True, recurrent: bool = True) -> CachedStates:
    """The layer's cached conv / recurrent states, or ``None`` for each one that holds no previous state."""
    if cache is None:
        return CachedStates(None, None)
    _check_cache(cache, layer_idx)
    c = cache.get_conv_state(layer_idx, state_idx=state_idx) if conv else None
    r = cache.get_recurrent_state(layer_idx, state_idx=state_idx) if recurrent else None
    layer = cache.layers[layer_idx]
    if c is not None and is_recording(cache, layer_idx):  # the conv history (write_states): its last K columns
        c = _last_columns(c, layer.conv_kernel_size[state_idx])
    has_prev = bool(getattr(layer, "has_previous_state", {}).get(state_idx, c is not None))
    if not has_prev:
        return CachedStates(None, None)
    return CachedStates(c, r)


def is_recording(cache, layer_idx: int) -> bool:
    """Whether the cache layer keeps its past states for ``crop`` (assisted / speculative generation)."""
    return bool(hasattr(cache, "is_recording_past") and cache.is_recording_past(layer_idx))



def _last_columns(conv: Tensor, k: int) -> Tensor:
    """``conv`` ``[B, D, W]`` -> its last ``k`` columns ``[B, D, k]`` (zeros on the left where ``W < k``)."""
    if conv.shape[-1] >= k:
        return conv[..., conv.shape[-1] - k :]
    return torch.nn.functional.pad(conv, (k - conv.shape[-1], 0))


def _right_justified(x: Tensor, keep: Tensor) -> Tensor:
    """``x`` ``[B, D, W]`` with each row's kept columns (``keep`` ``[B, W]`` bool) moved right in order, zeros left."""
    order = torch.sort(keep.to(torch.int8), dim=1, stable=True).indices  # [B, W]: dropped first, kept in order
    kept = torch.gather(keep, 1, order)  # [B, W]
    out = torch.gather(x, 2, order[:, None, :].expand(x.shape[0], x.shape[1], -1).to(x.device))
    return out * kept[:, None, :].to(device=x.device, dtype=x.dtype)


def _record_conv_history(cache, layer_idx: int, state_idx: int, conv: Tensor, inputs: Tensor, token_mask) -> None:
    """A cache layer that records its past (``activate_past_recording``, set by assisted generation) keeps every conv
    input since its last ``crop``, so that ``crop(-n)`` (its columns ``[-n-K : -n]``) is the state before the last
    ``n`` tokens. Each row's real inputs are kept right-justified (pads dropped): ``crop`` removes real tokens (the
    rejected candidates), and the last K columns are the row's state whatever the pads. ``inputs`` ``[B, T, D]``."""
    layer = cache.layers[layer_idx]
    k = int(conv.shape[-1])
    B, T, D = inputs.shape
    new = inputs.transpose(1, 2).to(conv.dtype)  # [B, D, T]
    if not layer.has_previous_state[state_idx] or layer.conv_states[state_idx] is None:
        layer.lazy_initialization(conv_states=conv, state_idx=state_idx, conv_kernel_size=k)
        prev = new.new_zeros(B, D, k)  # no left context: the causal conv's zeros
    else:
        prev = layer.conv_states[state_idx].to(new.dtype)
    full = torch.cat([prev, new], dim=-1)  # [B, D, W + T]
    if token_mask is not None:
        keep = torch.cat([torch.ones(B, prev.shape[-1], dtype=torch.bool, device=token_mask.device),
                          token_mask.to(torch.bool)], dim=1)  # fmt: skip
        full = _right_justified(full, keep)
    layer.conv_kernel_size[state_idx] = k
    layer.conv_states[state_idx] = full
    layer.has_previous_state[state_idx] = True


def write_states(
    cache,
    layer_idx: int,
    *,
    tokens: int,
    conv: Tensor | None = None,
    recurrent: Tensor | None = None,
    state_idx: int = 0,
    inputs: Tensor | None = None,
    token_mask: Tensor | None = None,
) -> None:
    """Store the layer's new states, replacing the old ones, after a call of ``tokens`` token columns.

    ``conv`` ``[B, D, K]`` must hold exactly the cache's K columns (the last K real inputs, oldest first);
    transformers' ``update_conv_state`` then stores it as is on prefill and, on a continuation, keeps the last
    K columns of ``[old ‖ conv]``, which is ``conv`` itself. A layer that records its past for ``crop`` (assisted
    generation) keeps the chunk's conv ``inputs`` ``[B, T, D]`` instead (``token_mask`` ``[B, T]``: the real ones);
    a mixer that does not hand them raises there.

    ``tokens`` is the call's column count T, pads included (as an attention layer counts them): from transformers
    5.25 on, a linear-attention cache layer counts the tokens it has seen (``cumulative_length_linear``, read by
    ``get_seq_length`` and moved back by ``crop``), and its ``update_conv_state`` adds the width of the conv states it
    is handed, which is K here, not T. The layer's count grows by ``tokens`` instead (:func:`_count_tokens`).
    """
    if cache is None:
        return
    counted = 0  # what transformers' own update_conv_state added to the layer's count
    before = None if state_idx != 0 or tracing() else _count_before(cache, layer_idx)
    if conv is not None and is_recording(cache, layer_idx):
        if inputs is None:
            raise ValueError(
                "the cache records past states for rollback (assisted / speculative generation), and this "
                "safepad-wrapped mixer cannot roll its states back: generate without an assistant model or "
                "prompt_lookup_num_tokens"
            )
        _record_conv_history(cache, layer_idx, state_idx, conv, inputs, token_mask)
        conv = None
    if conv is not None and not _copy_conv_state(cache, layer_idx, state_idx, conv):
        cache.update_conv_state(conv, layer_idx, state_idx=state_idx, conv_kernel_size=conv.shape[-1])
        counted = conv.shape[-1]
    if recurrent is not None:
        cache.update_recurrent_state(recurrent, layer_idx, state_idx=state_idx)
    _count_tokens(cache, layer_idx, state_idx, tokens, counted)
    if before is not None and isinstance(tokens, int):
        _remember_count(cache.layers[layer_idx], before + tokens)


#: transformers' own ``update_conv_state`` of a cache and of a linear-attention layer (None before 5.x's layers)
_CACHE_CONV_UPDATE = getattr(getattr(_cache_utils, "Cache", None), "update_conv_state", None)
_LAYER_CONV_UPDATE = getattr(getattr(_cache_utils, "LinearAttentionLayer", None), "update_conv_state", None)


def _copy_conv_state(cache, layer_idx: int, state_idx: int, conv: Tensor) -> bool:
    """Store a continuation's conv state ``conv`` ``[B, D, K]`` by one copy into the layer's own buffer; True when
    done. transformers' ``update_conv_state`` leaves there the last K columns of ``[old ‖ conv]``, which are
    ``conv`` itself, through a concatenation, a slice and a copy (and adds K to the layer's count, which
    :func:`_count_tokens` then corrects to the call's tokens): the copy is the same write, the count grows by the
    tokens at once. Only where both ``update_conv_state`` methods are transformers' own, on a layer that holds a
    state of this shape from an earlier call and keeps no past record (assisted generation); False otherwise (the
    caller goes through ``update_conv_state``: a first write, a subclass, older transformers)."""
    if _LAYER_CONV_UPDATE is None or getattr(type(cache), "update_conv_state", None) is not _CACHE_CONV_UPDATE:
        return False
    layers = getattr(cache, "layers", None)
    layer = layers[layer_idx] if layers is not None and layer_idx < len(layers) else None
    if layer is None or getattr(type(layer), "update_conv_state", None) is not _LAYER_CONV_UPDATE:
        return False
    try:
        held = layer.has_previous_state[state_idx] and not layer.record_past
        state, width = layer.conv_states[state_idx], layer.conv_kernel_size[state_idx]
    except (AttributeError, IndexError, KeyError, TypeError):  # a layer of another layout
        return False
    if not held or not isinstance(state, Tensor) or state.shape != conv.shape or width != conv.shape[-1]:
        return False
    state.copy_(conv)
    return True


def _count_before(cache, layer_idx: int) -> int | None:
    """The layer's count before this write, when the host knows it: remembered, or 0 for a layer that holds no
    state yet (new, or ``reset()``: transformers zeroes the count with the states)."""
    layers = getattr(cache, "layers", None)
    layer = layers[layer_idx] if layers is not None and layer_idx < len(layers) else None
    if not isinstance(getattr(layer, "cumulative_length_linear", None), Tensor):
        return None
    known = _known_count(layer)
    if known is None and not any(getattr(layer, "has_previous_state", {}).values()):
        known = 0
    return known


def _count_tokens(cache, layer_idx: int, state_idx: int, tokens: int, counted: int) -> None:
    """Make the layer's own token count (transformers >= 5.25: ``cumulative_length_linear``, a 0-d tensor) grow by
    ``tokens`` for this call, as the stock layer's does: stock counts at ``state_idx`` 0 only, by the width of the
    conv inputs it caches on a multi-token call (T) and by one on a decode step (``increase_count``). ``counted``:
    what ``update_conv_state`` already added. One in-place add on the device, no host read."""
    if state_idx != 0:
        return
    layers = getattr(cache, "layers", None)
    layer = layers[layer_idx] if layers is not None and layer_idx < len(layers) else None
    count = getattr(layer, "cumulative_length_linear", None)
    if isinstance(count, Tensor) and tokens != counted:
        count.add_(tokens - counted)


def layer_token_count(cache: Any) -> int | None:
    """The tokens a cache's linear layers say they have read (transformers >= 5.25: ``cumulative_length_linear`` of the
    first layer that keeps one, what ``get_seq_length`` of a recurrent-only cache returns), or None where no layer
    keeps a count (transformers 5.23 / 5.24). Every linear layer's count grows by each call's columns, pads included,
    as an attention layer's does. Eager code only (``generate``'s input preparation, hooks): the count the wrapped
    writes left on the tensor (:func:`cache_length`), else one host read."""
    for layer in getattr(cache, "layers", None) or ():
        count = getattr(layer, "cumulative_length_linear", None)
        if isinstance(count, Tensor):
            known = _known_count(layer)  # what the wrapped writes left: no host read
            if known is None:
                known = int(count)
                _remember_count(layer, known)
            return known
    return None


# ----------------------------------------------------------------------------------------------------------
# caches without an attention layer: the token count transformers cannot give
# ----------------------------------------------------------------------------------------------------------


def _attention_mixin():
    return getattr(_cache_utils, "CacheLayerMixin", None)


def recurrent_only(cache: Any) -> bool:
    """True for a transformers cache whose layers hold recurrent states and no attention (key/value) layer."""
    layers = getattr(cache, "layers", None)
    mixin = _attention_mixin()
    if not layers or mixin is None:
        return False
    if any(isinstance(layer, mixin) for layer in layers):
        return False
    return any(hasattr(layer, "recurrent_states") or hasattr(layer, "conv_states") for layer in layers)


def _config_of(model: Any) -> Any:
    return getattr(model, "config", None)


def cache_length(cache: Any) -> Any:
    """Tokens ``cache`` holds (pads included), without a host read where the host knows it: the first attention
    layer's count (a Python int, or a symbolic size under dynamic shapes), safepad's own count of a recurrent-only
    cache it tracks, and otherwise ``get_seq_length()`` (transformers < 5.25 raise ``ValueError`` for a cache without
    attention layers).

    From 5.25 on, ``get_seq_length()`` asks layer 0, which on a hybrid whose first layer is recurrent (and on every
    recurrent-only cache) is a 0-d count tensor: ``int()`` of it is a host sync on every call (a stall per decode step
    on CUDA), and a traced call that branches on it cannot compile. Every layer counts the same tokens; without an
    attention layer, eager, the count every wrapped write leaves on the tensor (:data:`_KNOWN_ATTR`) is used, and the
    device is read once only after someone else moved it (an unwrapped model, ``crop``, ``reset``).
    """
    if isinstance(cache, _TracksSeqLength) or not getattr(cache, "layers", None):
        return cache.get_seq_length()
    mixin = _attention_mixin()
    idx = next((i for i, layer in enumerate(cache.layers) if mixin is not None and isinstance(layer, mixin)), None)
    if idx is not None:
        length = cache.get_seq_length(idx)
        if not isinstance(length, Tensor) or tracing():
            return length
        # a static attention layer: its count is a 0-d tensor too; the count the host knows, or one host read
        known = _known_count(cache.layers[idx], _STATIC_COUNT)
        if known is None:
            known = int(length)
            _remember_count(cache.layers[idx], known, _STATIC_COUNT)
        return known
    length = cache.get_seq_length()
    if not isinstance(length, Tensor) or tracing():
        return length
    known = _known_count(cache.layers[0])  # 5.25, no attention layer: the count the host knows, or one host read
    if known is None:
        known = int(length)
        _remember_count(cache.layers[0], known)
    return known


#: a linear-attention layer's count as the host last knew it, kept on the 0-d count tensor itself (so a copy of the
#: cache carries it): ``(id of the tensor, its version counter, the value)``. Valid while the tensor is the same object
#: at the same version (nobody added, cropped or reset since), or is an untouched copy of it (``copy.deepcopy``:
#: another object, at version 1). Reading the tensor instead is a host sync (on CUDA, a stall per decode step).
_KNOWN_ATTR = "_safepad_known"


#: a static attention layer's 0-d count tensor (transformers' ``StaticLayer.cumulative_length``), which its
#: ``update`` advances in place by the call's key length, once per call
_STATIC_COUNT = "cumulative_length"
_LINEAR_COUNT = "cumulative_length_linear"


def _known_count(layer, attr: str = _LINEAR_COUNT) -> int | None:
    count = getattr(layer, attr, None)
    seen = getattr(count, _KNOWN_ATTR, None) if isinstance(count, Tensor) else None
    if seen is None:
        return None
    same = seen[0] == id(count) and seen[1] == count._version
    copied = seen[0] != id(count) and count._version == 1  # copy.deepcopy leaves a copy at version 1
    return seen[2] if same or copied else None


def _remember_count(layer, value: int, attr: str = _LINEAR_COUNT) -> None:
    count = getattr(layer, attr, None)
    if isinstance(count, Tensor):
        setattr(count, _KNOWN_ATTR, (id(count), count._version, int(value)))


def expect_count(cache: Any, past: int, tokens: int) -> tuple | None:
    """What an eager call of ``tokens`` columns that found ``past`` tokens in ``cache`` leaves in the count of its
    first attention layer, when that count is a 0-d tensor (a static layer): ``(layer, count tensor, its version now,
    past + tokens)`` for :func:`settle_count` after the call, else None. Without it, every eager step with a static
    cache reads that count on the host (one sync per decode step, where stock reads none)."""
    layers = getattr(cache, "layers", None)
    mixin = _attention_mixin()
    if not layers or mixin is None or isinstance(cache, _TracksSeqLength):
        return None
    layer = next((layer for layer in layers if isinstance(layer, mixin)), None)
    count = getattr(layer, _STATIC_COUNT, None)
    if not isinstance(count, Tensor) or count.dim() != 0 or not isinstance(past, int):
        return None
    return layer, count, count._version, past + int(tokens)


def settle_count(expected: tuple | None) -> None:
    """After a call that completed: remember :func:`expect_count`'s value when the count tensor is the same object and
    was advanced exactly once since (the call's own update; anything else, e.g. a ``reset`` or a call that raised
    before reaching the layer, leaves it unknown and the next call reads it)."""
    if expected is None:
        return
    layer, count, version, value = expected
    if getattr(layer, _STATIC_COUNT, None) is count and count._version == version + 1:
        _remember_count(layer, value, _STATIC_COUNT)


def fresh_cache_is_recurrent_only(config: Any) -> bool:
    """Whether ``DynamicCache(config=config)`` (the cache the model and ``generate`` build) has no attention layer."""
    if config is None:
        return False
    try:
        from transformers import DynamicCache

        return recurrent_only(DynamicCache(config=config))
    except Exception:  # noqa: BLE001 - a config transformers cannot build a cache from: nothing to track
        return False


def needs_token_count(model: Any) -> bool:
    """Whether ``model`` (a wrapped model's top-level module) needs safepad's token count (:func:`track_seq_length`).

    Only a model whose fresh cache has no attention layer *and* whose forward takes ``position_ids`` asks
    such a cache for its length: its forward derives positions (and builds masks) from it, and ``generate``
    derives ``position_ids`` from it. A forward without ``position_ids`` (Mamba, Mamba2, FalconMamba) never
    asks, and neither does ``generate`` for it before transformers 5.25 (it skipped the length of an all-linear cache;
    5.25 reads the layers' own count, which needs no class of safepad's), so such a model
    keeps the caller's and stock's cache classes (``DynamicCache``, ``StaticCache``) untouched, with no
    Python-int count that a compiled forward would guard on.
    """
    if not fresh_cache_is_recurrent_only(_config_of(model)):
        return False
    forward = getattr(model, "forward", None)
    try:
        return "position_ids" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return True


class _TracksSeqLength:
    """Mixin of a cache without attention layers: the sequence length comes from safepad's token count.

    ``get_seq_length`` / ``get_mask_sizes`` (and ``get_query_offset``, which calls the former) answer from
    ``_safepad_seen_tokens``, the number of token positions (pads included, as an attention cache counts
    them) that the wrapped model has run through this cache. A cache that held states before safepad first
    saw it starts from its layers' own count (transformers >= 5.25, :func:`layer_token_count`); before 5.25 it has
    no known count and raises a ``ValueError`` that says so.
    """

    def _safepad_length(self) -> int:
        seen = self.__dict__.get("_safepad_seen_tokens")
        if seen is None:
            raise ValueError(
                "this cache holds recurrent states that were written before safepad saw it (by an unwrapped model), "
                "and it has no attention layer, so nobody knows how many tokens it holds. Build the cache with the "
                "wrapped model: pass no cache (or an empty DynamicCache(config=model.config)) to its first call."
            )
        return int(seen)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if not recurrent_only(self):
            return super().get_seq_length(layer_idx)  # type: ignore[misc]
        return self._safepad_length()

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        if not recurrent_only(self):
            return super().get_mask_sizes(query_length, layer_idx)  # type: ignore[misc]
        return self._safepad_length() + int(query_length), 0

    def reset(self) -> None:
        super().reset()  # type: ignore[misc]
        self.__dict__["_safepad_seen_tokens"] = 0

    def crop(self, max_length: int) -> None:
        """transformers' ``crop``; the count follows: ``crop(-n)`` (the only one a linear-attention layer takes, from
        transformers 5.25 on) forgets the last ``n`` tokens, ``crop(m)`` keeps at most ``m``."""
        super().crop(max_length)  # type: ignore[misc]
        seen = self.__dict__.get("_safepad_seen_tokens")
        if seen is not None:
            self.__dict__["_safepad_seen_tokens"] = max(seen + max_length, 0) if max_length < 0 else min(seen, max_length)

    # generate() marks a cache it was handed as the user's (it then outlives generate and turns off the
    # deferred stop check on CUDA); a cache that safepad built for that generate call stays generate's own.
    @property
    def _is_user_defined(self) -> bool:
        return bool(self.__dict__.get("_safepad_user_defined", False))

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        if not self.__dict__.get("_safepad_owned", False):
            self.__dict__["_safepad_user_defined"] = bool(value)


_TRACKING: dict[type, type] = {}


def _tracking_class(base: type) -> type:
    if issubclass(base, _TracksSeqLength):
        return base
    cls = _TRACKING.get(base)
    if cls is None:
        name = f"SafepadLength{base.__name__}"
        cls = type(name, (_TracksSeqLength, base), {"__module__": __name__, "__qualname__": name})
        _TRACKING[base] = cls
        setattr(sys.modules[__name__], name, cls)  # so pickle / deepcopy find the class
    return cls


def __getattr__(name: str):
    """``SafepadLength<Cache>`` classes are generated on first use; in a fresh process (``pickle.load`` of a
    tracked cache or of a model output holding one) they are rebuilt from ``transformers.cache_utils``."""
    if name.startswith("SafepadLength"):
        from transformers import cache_utils

        base = getattr(cache_utils, name[len("SafepadLength") :], None)
        if isinstance(base, type):
            return _tracking_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _holds_states(cache: Any) -> bool:
    for layer in getattr(cache, "layers", ()):
        if any(getattr(layer, "has_previous_state", {}).values()):
            return True
    return False


def track_seq_length(cache: Any) -> Any:
    """Make a recurrent-only ``cache`` answer ``get_seq_length`` from a token count (in place; returns it).

    No-op for caches with an attention layer and for caches already tracked. An empty cache starts at 0; one that
    already holds states starts from its layers' own count (transformers >= 5.25: :func:`layer_token_count`), and
    before 5.25 has an unknown count (its length queries raise a clear ``ValueError``).
    """
    if cache is None or isinstance(cache, _TracksSeqLength) or not recurrent_only(cache):
        return cache
    cache.__class__ = _tracking_class(type(cache))
    cache.__dict__["_safepad_seen_tokens"] = layer_token_count(cache) if _holds_states(cache) else 0
    return cache


def new_tracked_cache(config: Any, *, owned: bool = False) -> Any:
    """An empty ``DynamicCache(config=config)`` that counts its tokens (``owned``: built by safepad for generate)."""
    from transformers import DynamicCache

    # built as the tracking class and counted by attribute: no ``__class__`` swap and no ``__dict__`` write,
    # which dynamo cannot trace (or which make it break on later mapping-proxy reads) in a compiled forward
    cache = _tracking_class(DynamicCache)(config=config)
    cache._safepad_seen_tokens = 0
    if owned:
        cache.__dict__["_safepad_owned"] = True
    return cache


def _advance(cache: Any, n_tokens: int) -> None:
    if isinstance(cache, _TracksSeqLength) and cache.__dict__.get("_safepad_seen_tokens") is not None:
        cache.__dict__["_safepad_seen_tokens"] += int(n_tokens)


# one model call at a time owns the count: a nested wrapped model (CausalLM -> Model) must not count again
_CALL: CallScope[bool] = CallScope("safepad_cache_call", default=False)


def _in_call() -> bool:
    return bool(_CALL.current())


def _enter_call() -> contextvars.Token | str:
    return _CALL.push(True)


def _exit_call(token: contextvars.Token | str) -> None:
    _CALL.pop(token)


class CachePreHook:
    """Forward pre-hook of a wrapped model whose cache has no attention layer (see the module docstring).

    * a recurrent-only cache passed in (under any of :data:`CACHE_NAMES`) is made to track its length;
    * when the model would build its own cache (``use_cache`` resolves to True and no cache is passed), an
      empty tracked cache is passed in under the name the forward declares instead;
    * after the call (:class:`CachePostHook`), the cache's count grows by the call's sequence length.

    Nested calls (a wrapped ``...Model`` inside a wrapped ``...ForCausalLM``) are left to the outer one.
    """

    def __init__(self, cache_arg: str | None, recurrent: bool):
        self.cache_arg = cache_arg
        self.recurrent = recurrent

    def __call__(self, module: Any, args: tuple, kwargs: dict):
        stack = module._safepad.cache_calls  # a list made by wrap (no dict mutation while traced)
        if not self.recurrent or _in_call():
            stack.append(None)
            return None
        _, cache = cache_from_kwargs(kwargs)  # transformers and generate() pass caches by keyword
        if cache is None and self.cache_arg is not None and self._builds_cache(module, kwargs):
            cache = new_tracked_cache(_config_of(module))
            kwargs = {**kwargs, self.cache_arg: cache}  # a new dict: no dict mutation inside a compiled forward
        else:
            track_seq_length(cache)
        ids = kwargs.get("input_ids")
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is None and args:
            ids = args[0]
        length = int(ids.shape[1]) if isinstance(ids, Tensor) and ids.dim() >= 2 else 0
        stack.append((_enter_call(), cache, length))
        return args, kwargs

    @staticmethod
    def _builds_cache(module: Any, kwargs: dict) -> bool:
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = bool(getattr(_config_of(module), "use_cache", False))
        if not use_cache:
            return False
        # transformers turns the cache off under activation checkpointing in training (5.24 renamed the flag)
        if not getattr(module, "training", False):
            return True
        names = ("is_activation_checkpointing", "is_gradient_checkpointing")
        flag = next((n for n in names if hasattr(type(module), n)), None)
        return not (flag is not None and getattr(module, flag))


def cache_post_hook(module: Any, args: tuple, output: Any) -> None:
    """Forward hook paired with :class:`CachePreHook` (``always_call``: a raising call counts no tokens)."""
    state = module.__dict__.get("_safepad")
    stack = state.cache_calls if state is not None else None
    entry = stack.pop() if stack else None
    if entry is None:
        return None
    token, cache, length = entry
    _exit_call(token)
    if output is None:
        return None
    if cache is None:  # built inside the forward (no declared cache argument): it has seen this call only
        cache = output_cache(output)
        if not isinstance(cache, _TracksSeqLength) and recurrent_only(cache):
            cache.__class__ = _tracking_class(type(cache))
            cache.__dict__["_safepad_seen_tokens"] = 0
    _advance(cache, length)
    return None


#: what a cache has read, kept on the cache itself (so ``copy.deepcopy``, pickling and ``reset`` carry it): set by a
#: wrapped ``generate`` when it returns, as ``(tokens read, the ids read [B, n] | None, versions of its states)``.
#: Outside a forward only, so a compiled forward never reads it.
_RECORD_ATTR = "_safepad_read"
#: inside a wrapped ``generate``: ``id(cache) -> [cache, tokens read so far | None (unknown / counted by the
#: cache), the last full input_ids prepare_inputs_for_generation saw | None]``
_GEN_COUNTS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("safepad_generate_counts", default=None)


def _state_versions(cache: Any) -> tuple:
    """The version counter of every state tensor of ``cache``: it grows whenever a forward writes a state in place."""
    out = []
    for layer in getattr(cache, "layers", ()):
        for attr in ("conv_states", "recurrent_states"):
            states = getattr(layer, attr, None)
            values = states.values() if isinstance(states, dict) else (states or ())
            out.extend(t._version for t in values if isinstance(t, Tensor))
    return tuple(out)


def _record(cache: Any) -> tuple[int, Tensor | None] | None:
    """``(tokens read, ids read)`` that the last wrapped ``generate`` left on ``cache``, while its states are the ones
    it left: the same version counters, or all 0 (a copy: ``copy.deepcopy``, a pickle, a reorder). ``None`` else."""
    rec = cache.__dict__.get(_RECORD_ATTR) if hasattr(cache, "__dict__") else None
    if rec is None:
        return None
    n, ids, versions = rec
    now = _state_versions(cache)
    if now != versions and any(v > 1 for v in now):  # a copy's tensors count 0 or 1 (deepcopy's set_)
        return None
    return n, ids


def forget_read(cache: Any) -> None:
    """An eager wrapped forward outside a wrapped ``generate`` is about to read ``cache``: what the last ``generate``
    left on it (``_record``) no longer says what it has read."""
    if cache is not None and _GEN_COUNTS.get() is None and _RECORD_ATTR in getattr(cache, "__dict__", {}):
        del cache.__dict__[_RECORD_ATTR]

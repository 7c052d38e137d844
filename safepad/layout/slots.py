"""Slot-justified cache layout: each row's real tokens held contiguously at the END of the cache.

Some hybrids' attention measures positions in *cache slots* rather than in ``position_ids``: Inkling's relative
position bias (``distance = q_slot - k_slot``) and every sliding-window mask and cache (the window is counted in
slots, and a sliding cache keeps the last ``W - 1`` slots, pads included). After a right-padded prefill (or a
chunk with pads inside) the pads sit between a row's earlier real tokens and the ones that follow, so every
later distance is wrong by the number of pads, and a sliding cache may hold pads instead of real keys.

The fix keeps one invariant for every row of a cache: ``[pads ... | real tokens ...]`` (a left-padded layout, as
stock produces for a left-padded prompt). Then the slot distance between two real tokens is their real distance,
the next token's slot follows the last real one, and the last ``W - 1`` slots are the last real ones. Each call
keeps it in three steps (:class:`SlotJustifiedCall`):

1. the current chunk's tokens are reordered per row, pads first (a stable partition: real tokens keep their
   order), and the outputs are put back afterwards;
2. the 2-D attention mask becomes the invariant's mask: per row ``total - n_real`` zeros, then ones;
3. at each attention layer's ``cache.update``, the cached keys / values of a row are moved left by that row's
   number of new pads (:func:`justify_kv`), so the new pads end up before all of the row's real tokens.

Shapes: ``B`` batch, ``T`` current tokens, ``L`` cached slots, ``S`` slots a layer stores (``L``, or ``W - 1`` for
a full sliding layer), ``H`` heads, ``D`` head dim.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from .._tracing import tracing

__all__ = ["SlotJustifiedCall", "justified_mask", "justify_kv", "pads_first_order", "step_relay_index"]

logger = logging.getLogger(__name__)


def pads_first_order(mask: Tensor) -> Tensor:
    """``[B, T]`` long: per row, the pads' indices first, then the real tokens' (each group in order).

    ``x.gather(1, order)`` is the row reordered; ``mask`` ``[B, T]`` bool, True = real token.
    """
    return torch.sort(mask.to(torch.int8), dim=1, stable=True).indices  # False (0) before True (1), stable


def justified_mask(n_real: Tensor, total: int) -> Tensor:
    """``[B, total]`` bool: per row ``total - n_real`` pads, then ``n_real`` real slots (``n_real`` ``[B]``, or
    ``[B, 1]``). Slot ``j`` is real when ``total - 1 - j < n_real`` (one descending ``arange``, one compare)."""
    n = n_real if n_real.dim() == 2 else n_real[:, None]  # [B, 1]
    return torch.arange(total - 1, -1, -1, device=n_real.device) < n


def step_relay_index(real: Tensor, S: int) -> Tensor:
    """``[B, S + 1]`` long: where each slot of ``[past ‖ new]`` (``S`` cached slots, then the step's one) comes
    from after a one-token step, given ``real`` ``[B, 1]`` (bool or 0 / 1: the row's step token is real).

    A real token's row stays as it is (slot ``j`` from ``j``); a pad's row moves right by one (slot ``j`` from
    ``j - 1``: its last cached real slot ends in the step's column, the pad goes first), slot 0 keeping its own
    (a pad slot of the justified layout, masked). Three ops: ``arange(-1, S) + real``, clamped at 0. The keys
    and values of every layer with ``S`` cached slots share it (:meth:`SlotJustifiedCall.relay_step`).
    """
    return (torch.arange(-1, S, device=real.device) + real).clamp_(min=0)


def justify_kv(past: Tensor, new: Tensor, past_real: Tensor | None, new_real: Tensor) -> tuple[Tensor, Tensor]:
    """Re-lay ``[past ‖ new]`` so each row's pads come before all of its real slots.

    Args:
        past: ``[B, H, S, D]`` cached keys (or values) of one layer.
        new: ``[B, H, T, D]`` this call's keys, each row ``[pads | reals]`` (step 1 above).
        past_real: ``[B]`` real slots among the ``S`` stored ones, the last ones (each stored row
            ``[pads | reals]``); or ``[B, S]`` bool, which stored slots are real (a row laid out otherwise, e.g. by
            a one-token step with a pad on a cache never re-laid: ``[reals | pad]``). Not read for one new token
            (``T == 1``): the stored rows are justified then.
        new_real: ``[B]`` real tokens among the ``T`` new ones (the last ones).

    Returns:
        ``(past', new')`` of the same shapes: the stable partition of ``[past ‖ new]`` (pads first), split at
        ``S``. ``past'`` replaces the stored slots, ``new'`` goes through the cache's own update. Pad slots hold
        zeros, except with one new token (``T == 1``): then a pad row's slots move right by one
        (:func:`step_relay_index`, one gather, no sort, no host read) and its first slot keeps what it held (a
        pad slot, masked all the same). A decode step of a ``DynamicCache`` re-lays the concatenated slots after
        the cache's own update instead (:meth:`SlotJustifiedCall.relay_step`): no concatenation of its own.
    """
    B, Hk, S, Dh = past.shape
    T = new.shape[2]
    if T == 1:  # one token (a decode step): a pad step token goes first, the row's slots move right by one
        full = torch.cat([past, new], dim=2)  # [B, H, S + 1, D]
        index = step_relay_index(new_real.view(B, 1), S)  # [B, S + 1]
        out = full.gather(2, index.view(B, 1, S + 1, 1).expand(full.shape))
        return out[:, :, :S], out[:, :, S:]
    full = torch.cat([past, new], dim=2)  # [B, H, S + T, D]
    past_valid = past_real.to(torch.bool) if past_real.dim() == 2 else justified_mask(past_real, S)  # [B, S]
    valid = torch.cat([past_valid.to(new_real.device), justified_mask(new_real, T)], dim=1)  # [B, S + T]
    order = pads_first_order(valid)  # [B, S + T]
    idx = order[:, None, :, None].expand(B, full.shape[1], S + T, full.shape[3])  # [B, H, S + T, D]
    out = full.gather(2, idx)
    keep = justified_mask(valid.sum(1), S + T)  # [B, S + T]: real slots after the partition
    out = out * keep[:, None, :, None].to(out.dtype)  # pad slots hold zeros (masked anyway)
    return out[:, :, :S], out[:, :, S:]


_PLAIN_UPDATE_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer")


def _last_slots(past_slots: Tensor, stored: int) -> Tensor:
    """``[B, stored]`` bool: which of a layer's ``stored`` slots are real, given ``past_slots`` ``[B, L]`` of the
    ``L`` cached slots (a layer stores the last ``stored`` of them; more than ``L``: the extra leading ones are not
    real)."""
    L = past_slots.shape[1]
    if stored <= L:
        return past_slots[:, L - stored :]
    return torch.cat([past_slots.new_zeros(past_slots.shape[0], stored - L), past_slots], dim=1)


def _plain_dynamic(layer) -> bool:
    """Does ``layer.update`` concatenate onto ``layer.keys`` / ``layer.values`` (DynamicLayer semantics)?"""
    for cls in type(layer).__mro__:
        if "update" in cls.__dict__:
            return cls.__name__ in _PLAIN_UPDATE_LAYERS
    return False


class _JustifyingUpdate:
    """``cache.update`` for one call: re-lay a layer's stored slots (:func:`justify_kv`) before the stock update.

    A decode step re-lays after it instead: the stock update concatenates ``[past ‖ new]`` (its own op), and one
    gather per tensor moves a pad row's slots right by one (:meth:`SlotJustifiedCall.relay_step`); the layer then
    keeps the re-laid slots (all of them, or a sliding window's last ones, as its update kept them)."""

    def __init__(self, cache, call: SlotJustifiedCall):
        self.cache = cache
        self.original = type(cache).update.__get__(cache)
        self.call = call  # call.past_slots [B, L] bool: the real ones among the cached slots (read for a chunk only)
        self.decode = call.decode  # a decode step: it re-lays only when its token is a pad (unknown on the host)

    def __call__(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        layer = self.cache.layers[layer_idx]
        keys = getattr(layer, "keys", None)
        stored = 0 if keys is None or not getattr(layer, "is_initialized", False) else keys.shape[-2]
        if stored > 0:
            if not _plain_dynamic(layer):
                if _no_pad_step(self.decode, self.call.n_new):
                    return self.original(key_states, value_states, layer_idx, *args, **kwargs)
                raise ValueError(
                    f"safepad: a cached call with padding after real tokens needs each attention layer's cached "
                    f"keys to be re-laid in place, which {type(layer).__name__} (layer {layer_idx}) does not allow. "
                    "Use a DynamicCache (the default), or pad on the left."
                )
            rows = self.call.full_mask.shape[0]
            if keys.shape[0] != rows:
                raise ValueError(f"safepad: cache layer {layer_idx} holds {keys.shape[0]} rows but the call has {rows}")
            if self.decode and not getattr(layer, "record_past", False):
                # one token: the stored rows are justified; the stock update's [past ‖ new], re-laid
                full_k, full_v = self.original(key_states, value_states, layer_idx, *args, **kwargs)  # [B, H, S + 1, D]
                full_k, full_v = self.call.relay_step(full_k, 2), self.call.relay_step(full_v, 2)
                kept = layer.keys.shape[-2]  # S + 1, or a sliding window's last W - 1 of them
                layer.keys = full_k if kept == full_k.shape[-2] else full_k[:, :, full_k.shape[-2] - kept :]
                layer.values = full_v if kept == full_v.shape[-2] else full_v[:, :, full_v.shape[-2] - kept :]
                return full_k, full_v
            if self.decode:  # a layer recording its past (assisted generation): its stored slots re-laid first
                layer.keys, key_states = justify_kv(layer.keys, key_states, None, self.call.n_new)
                layer.values, value_states = justify_kv(layer.values, value_states, None, self.call.n_new)
                return self.original(key_states, value_states, layer_idx, *args, **kwargs)
            # stored slots are the last `stored` of the `past_len` cached ones
            past_real = _last_slots(self.call.past_slots, stored)  # [B, stored]
            layer.keys, key_states = justify_kv(layer.keys, key_states, past_real, self.call.n_new)
            layer.values, value_states = justify_kv(layer.values, value_states, past_real, self.call.n_new)
        return self.original(key_states, value_states, layer_idx, *args, **kwargs)


class _JustifyingIndexerUpdate:
    """``cache.update_indexer`` for one call: a DSA indexer's per-slot state ``[B, S, F]`` re-laid like the keys.

    The indexer (GLM-5 Next, Qwen4-Exp) selects key *slots* before its layer's ``cache.update``; its state must be
    in the justified layout by then, so that the slots it selects are the ones the re-laid keys occupy.
    """

    def __init__(self, cache, call: SlotJustifiedCall):
        self.cache = cache
        self.original = type(cache).update_indexer.__get__(cache)
        self.call = call  # call.past_slots [B, L] bool: the real ones among the cached slots
        self.decode = call.decode

    def __call__(self, states: Tensor, layer_idx: int, *args, **kwargs):
        layer = self.cache.layers[layer_idx]
        stored_keys = getattr(layer, "indexer_keys", None)
        stored = 0 if stored_keys is None or not getattr(layer, "is_indexer_initialized", False) else stored_keys.shape[1]
        if stored > 0:
            if type(layer).update_indexer is not _dynamic_indexer_update():
                if _no_pad_step(self.decode, self.call.n_new):
                    return self.original(states, layer_idx, *args, **kwargs)
                raise ValueError(
                    f"safepad: a cached call with padding after real tokens needs the indexer state of layer "
                    f"{layer_idx} to be re-laid in place, which {type(layer).__name__} does not allow. Use a "
                    "DynamicCache (the default), or pad on the left."
                )
            if self.decode:  # one token: the stock update's [past ‖ new] [B, S + 1, F], re-laid (it keeps them all)
                layer.indexer_keys = self.call.relay_step(self.original(states, layer_idx, *args, **kwargs), 1)
                return layer.indexer_keys
            past_real = _last_slots(self.call.past_slots, stored)  # [B, stored]
            # [B, 1, S|T, F]
            past, new = justify_kv(stored_keys[:, None], states[:, None], past_real, self.call.n_new)
            layer.indexer_keys, states = past[:, 0], new[:, 0]
        return self.original(states, layer_idx, *args, **kwargs)


def _no_pad_step(decode: bool, new_real: Tensor) -> bool:
    """A decode step whose every token is real moves no cached slot: a cache that cannot be re-laid may serve it.
    Read on the host (one sync) only for such caches, which refuse the re-lay otherwise."""
    return decode and bool((new_real > 0).all())


def _dynamic_indexer_update():
    from transformers import cache_utils

    cls = getattr(cache_utils, "DynamicIndexedLayer", None)
    return None if cls is None else cls.update_indexer


def _justify_position_history(cache, call: SlotJustifiedCall) -> Tensor | None:
    """Re-lay a cache layer's stored per-slot positions ``[K, B, S]`` (``indexer_position_ids``, Qwen4-Exp) now.

    The model concatenates them with the chunk's positions before any layer runs, so they must be in the
    justified layout before the forward; the stored slots' re-lay depends only on which slots are real
    (``call.past_slots`` ``[B, L]`` bool, :func:`justify_kv`; read only when a layer keeps a history).
    Returns ``[K, B, T]``: the stored positions of the cached slots the re-lay moves into the chunk's columns
    (0 elsewhere), which the chunk's positions must carry there; None without a history.
    """
    moved = None
    B, T = call.full_mask.shape[0], call.T
    for layer in getattr(cache, "layers", ()):
        hist = getattr(layer, "indexer_position_ids", None)
        if not isinstance(hist, Tensor) or hist.dim() != 3 or hist.shape[-1] == 0 or hist.shape[1] != B:
            continue
        S = hist.shape[-1]
        h = hist.permute(1, 0, 2)[..., None]  # [B, K, S, 1]
        past, new = justify_kv(h, h.new_zeros(B, h.shape[1], T, 1), _last_slots(call.past_slots, S), call.n_new)
        layer.indexer_position_ids = past[..., 0].permute(1, 0, 2).contiguous()  # [K, B, S]
        moved = new[..., 0].permute(1, 0, 2) if moved is None else moved  # [K, B, T]
    return moved


class SlotJustifiedCall:
    """One model call's re-layout (see the module docstring): reorder inputs, rewrite the mask, re-lay the cache.

    Args:
        full_mask: ``[B, L + T]`` bool attention mask of the cached slots plus the current tokens (a one-token
            step's may be the caller's integer 0 / 1 mask: it is only summed and sliced).
        past_len: ``L``, the slots the cache already holds (0 without a cache).
        past_slots: ``[B, L]`` bool, which cached slots hold real tokens, where the cache rows are laid out as the
            caller's mask says (a cache no call has re-laid: after a one-token step with a pad, a row is
            ``[reals | pad]``); None: the cache rows are justified (``[pads | reals]``, ``n_past`` real ones).
        on_device: decide a chunk of several tokens without a host read (a traced call): it is always reordered
            and its cached slots always re-laid (each the identity where nothing moves); ``noop`` is False.
        real_step: a one-token call whose token the caller knows is real in every row (``generate``'s own,
            :func:`safepad.wrap.generate.generated_step`): its cached slots stay where they are (``relay`` False).

    Attributes:
        order: ``[B, T]`` long, ``x_new[:, i] = x[:, order[:, i]]``, or None when the chunk needs no reordering.
        mask: ``[B, L + T]`` bool, the mask of the justified layout (cache slots, for attention).
        token_mask: ``[B, T]`` bool, the reordered current tokens' mask (for the recurrent layers): not the
            last ``T`` columns of ``mask`` when cached slots move into the chunk's columns.
        n_past / n_new: ``[B]`` real tokens among the cached slots / the current tokens.
        decode: a one-token call (``T == 1``): every decision above is a device tensor (no host read); ``noop`` is
            False and ``relay`` is True whenever the cache holds slots (:meth:`relay_step` then moves only the
            rows whose step token is a pad). A step makes ``mask`` from one sum of the caller's mask (each row's
            real slots, cached and new); ``token_mask``, ``n_past``, ``n_new`` and ``past_slots`` are made when
            first read (a step on a ``DynamicCache`` reads none of ``n_past``, ``n_new``, ``past_slots``).
    """

    def __init__(
        self,
        full_mask: Tensor,
        past_len: int,
        past_slots: Tensor | None = None,
        on_device: bool = False,
        real_step: bool = False,
    ):
        B, total = full_mask.shape
        T = total - past_len
        self._step_src: dict = {}  # a step's step_relay_index per (S, device)
        self._step_index: dict = {}  # ... expanded per (shape, dim, device): relay_step's gather index
        self._past_slots: Tensor | None = None
        self._token_mask = self._n_past = self._n_new = None
        if T == 1:  # a decode step: every decision on the device (no host read); its cache rows are justified
            if past_slots is not None:
                raise ValueError("safepad: a one-token SlotJustifiedCall re-lays a justified cache only (past_slots=None)")
            self._init_step(full_mask, past_len, real_step)
            return
        self.past_len, self.T = past_len, T
        self.full_mask = full_mask  # [B, L + T]: the caller's layout of the cached slots and the current tokens
        cur = full_mask[:, past_len:]  # [B, T]
        self.n_past = full_mask[:, :past_len].sum(1)  # [B]
        self.n_new = cur.sum(1)  # [B]
        self._n_real = self.n_past + self.n_new  # [B]
        self.mask = justified_mask(self._n_real, total)  # [B, L + T]
        self.token_mask = justified_mask(self.n_new, T)  # [B, T]: the current tokens, reordered
        if on_device:
            self._init_on_device(cur, past_slots)
            return
        self.noop = bool(torch.equal(self.mask, full_mask))
        already = bool(torch.equal(cur, self.token_mask))
        self.order = None if already else pads_first_order(cur)  # [B, T]
        self.inverse = None if self.order is None else torch.argsort(self.order, dim=1)  # [B, T]
        justified_past = justified_mask(self.n_past, past_len)  # [B, L]
        self.past_slots = justified_past if past_slots is None else past_slots.to(torch.bool)  # [B, L]
        # the cached slots must move when some row gets new pads and holds something already, or when they are not
        # justified yet
        self.relay = past_len > 0 and (
            bool((self.n_new < T).any()) or not bool(torch.equal(self.past_slots, justified_past))
        )
        self.decode = self.real_step = False
        self._cache = None
        #: ``[K, B, T]`` stored positions of the cached slots moved into the chunk's columns (set by install)
        self.moved_positions: Tensor | None = None

    def _init_on_device(self, cur: Tensor, past_slots: Tensor | None) -> None:
        """A chunk of several tokens decided without a host read (a traced call): the chunk is always reordered
        (the identity where a row is already ``[pads | reals]``) and the cached slots always re-laid when there
        are some (:func:`justify_kv`'s gather, the identity where nothing moves); ``noop`` is False.
        ``cur`` ``[B, T]`` bool: the chunk's columns of the caller's mask."""
        self.noop = False
        self.order = pads_first_order(cur)  # [B, T]
        self.inverse = torch.argsort(self.order, dim=1)  # [B, T]
        justified_past = justified_mask(self.n_past, self.past_len)  # [B, L]
        self.past_slots = justified_past if past_slots is None else past_slots.to(torch.bool)  # [B, L]
        self.relay = self.past_len > 0
        self.decode = self.real_step = False
        self._cache = None
        self.moved_positions = None

    def _init_step(self, full_mask: Tensor, past_len: int, real_step: bool = False) -> None:
        """One token: it needs no reordering; the mask and pad counts are device tensors, and the cached slots
        are re-laid whenever there are some (:meth:`relay_step` moves only the rows whose step token is a pad),
        unless the caller knows on the host that every row's token is real (``real_step``: nothing moves).
        ``full_mask`` ``[B, L + 1]``: bool, or integer 0 / 1 (the caller's own, unconverted)."""
        self.past_len, self.T = past_len, 1
        self.full_mask = full_mask  # [B, L + 1]
        self._n_real = full_mask.sum(1, keepdim=True)  # [B, 1] long: each row's real slots, cached and new
        self.mask = justified_mask(self._n_real, past_len + 1)  # [B, L + 1]
        self.noop = False  # (unknown without a host read: the justified mask is passed on)
        self.decode = True
        self.real_step = real_step
        self.order = self.inverse = None
        self.relay = past_len > 0 and not real_step
        self._cache = None
        self.moved_positions = None

    @property
    def token_mask(self) -> Tensor:
        """``[B, T]`` bool: the reordered current tokens' mask (a step's: the caller's last column, made when
        first read; the last column, not ``past_len``, which is a symbolic size under dynamic shapes)."""
        if self._token_mask is None:
            self._token_mask = self.full_mask[:, -1:].to(torch.bool)  # [B, 1]
        return self._token_mask

    @token_mask.setter
    def token_mask(self, value: Tensor) -> None:
        self._token_mask = value

    @property
    def n_new(self) -> Tensor:
        """``[B]`` long: real tokens among the current ones (a step's made when first read)."""
        if self._n_new is None:
            self._n_new = self.token_mask[:, 0].long()
        return self._n_new

    @n_new.setter
    def n_new(self, value: Tensor) -> None:
        self._n_new = value

    @property
    def n_past(self) -> Tensor:
        """``[B]`` long: real tokens among the cached slots (a step's made when first read)."""
        if self._n_past is None:
            self._n_past = self._step_positions()[:, 0]
        return self._n_past

    @n_past.setter
    def n_past(self, value: Tensor) -> None:
        self._n_past = value

    def _step_positions(self) -> Tensor:
        """``[B, 1]`` long: a step's real tokens before its own, per row (all of its slots' real ones, less its
        own token where that is real)."""
        if self.real_step:
            return self._n_real - 1
        return torch.add(self._n_real, self.token_mask, alpha=-1)

    @property
    def past_slots(self) -> Tensor:
        """``[B, L]`` bool: which cached slots hold real tokens (for a one-token step, made when first read: a
        decode step's re-lay does not read it)."""
        if self._past_slots is None:
            self._past_slots = justified_mask(self.n_past, self.past_len)
        return self._past_slots

    @past_slots.setter
    def past_slots(self, value: Tensor) -> None:
        self._past_slots = value

    def relay_step(self, full: Tensor, dim: int) -> Tensor:
        """A decode step's re-lay of one layer's concatenated slots ``[past ‖ new]``: ``full`` with ``S + 1``
        slots along ``dim`` (keys / values ``[B, H, S + 1, D]``, ``dim`` 2; indexer keys ``[B, S + 1, F]``,
        ``dim`` 1), a pad row's slots moved right by one (:func:`step_relay_index`), one gather.

        The index is made once per call and shape (eager; traced, for each: a dict key would specialise
        symbolic sizes), shared by the keys and values of every layer of that shape."""
        shape, device = tuple(full.shape), full.device
        if tracing():
            return full.gather(dim, self._step_gather_index(shape, dim, device))
        key = (shape, dim, device)
        index = self._step_index.get(key)
        if index is None:
            index = self._step_index[key] = self._step_gather_index(shape, dim, device)
        return full.gather(dim, index)

    def _step_gather_index(self, shape: tuple, dim: int, device: torch.device) -> Tensor:
        """:func:`step_relay_index` for ``S + 1 = shape[dim]`` slots, viewed and expanded to ``shape``."""
        S = shape[dim] - 1
        src = None if tracing() else self._step_src.get((S, device))
        if src is None:
            src = step_relay_index(self.token_mask.to(device), S)  # [B, S + 1]
            if not tracing():
                self._step_src[(S, device)] = src
        view = [shape[0]] + [1] * (len(shape) - 1)
        view[dim] = S + 1
        return src.view(view).expand(shape)

    def pads(self) -> Tensor:
        """``[B]`` long: pad slots per row in the justified layout (the cache's, once the call has run)."""
        return (self.mask.shape[1] - self._n_real).view(-1)

    def reorder(self, x: Tensor) -> Tensor:
        """``[B, T, ...]`` (or ``[1, T, ...]``, expanded) current-token tensor in the justified order."""
        if self.order is None:
            return x
        if x.shape[0] == 1 and self.order.shape[0] > 1:
            x = x.expand(self.order.shape[0], *x.shape[1:])
        idx = self.order.to(x.device).view(*self.order.shape, *([1] * (x.dim() - 2))).expand_as(x)
        return x.gather(1, idx)

    def restore(self, x: Tensor) -> Tensor:
        """Inverse of :meth:`reorder` on a ``[B, T, ...]`` output."""
        if self.inverse is None:
            return x
        idx = self.inverse.to(x.device).view(*self.inverse.shape, *([1] * (x.dim() - 2))).expand_as(x)
        return x.gather(1, idx)

    def restore_attention(self, w: Tensor) -> Tensor:
        """Attention weights ``[B, H, T, K]`` of the justified layout -> the caller's layout ``[B, H, T, L + T]``.

        Queries go back in the caller's order (:meth:`restore`). Keys: the justified layout holds each row's real
        tokens (cached and current) as its last slots, in order, so the ``j``-th real slot goes to the column of
        the ``j``-th real token of the caller's full mask (``[B, L + T]``: the cached tokens as the caller laid them
        out, then the current ones). ``K`` is the layer's key slots: the last ``K`` of the ``L + T`` (a sliding
        layer keeps fewer: the columns before them hold 0, as keys outside the window do in a call without a
        cache), or more (a static cache's unused slots: they stay after the ``L + T`` columns, 0). Columns of
        pads and rows of pad queries hold 0.
        """
        B, total = self.full_mask.shape
        K = w.shape[-1]
        n = min(K, total)
        lead = w.shape[1:-1]  # [H, T]
        kept = w[..., K - n :] if K <= total else w[..., :n]  # [B, H, T, n] over justified slots total-n .. total-1
        real_k = self.mask[:, total - n :].to(device=w.device, dtype=w.dtype)  # [B, n]
        kept = kept * real_k.view(B, *([1] * len(lead[:-1])), 1, n)
        cols = pads_first_order(self.full_mask.to(w.device))[:, total - n :]  # [B, n] caller column of each slot
        out = w.new_zeros(B, *lead, max(K, total))
        out.scatter_(-1, cols.view(B, *([1] * len(lead)), n).expand_as(kept), kept)
        out = self.restore(out.movedim(-2, 1)).movedim(1, -2)  # queries back in the caller's order
        real_q = self.full_mask[:, self.past_len :].to(device=w.device, dtype=w.dtype)  # [B, T]
        return out * real_q.view(B, *([1] * len(lead[:-1])), self.T, 1)

    def position_ids(self) -> Tensor:
        """``[B, T]`` positions of the justified chunk's slots: real tokens count on from the row's cached ones.

        The chunk's leading pad columns get the positions of the cached real tokens that the re-lay moves into
        those slots (a pad query's position changes no real output; a moved key keeps its own), others 1.
        A one-token step's position is the row's cached real tokens ``n_past``, its token a pad or not: a pad
        query changes no real output, and the key its column holds after the re-lay is the row's last cached
        one, rotated at its own position when it was cached (the step's own pad key is dropped).
        """
        if self.decode:
            return self._step_positions()  # [B, 1]
        full = self.mask[:, -self.T :]  # [B, T] real slots of the chunk's columns after the re-lay
        before = self.n_past + self.n_new - full.sum(1)  # [B] real slots before the chunk's columns
        pos = before[:, None] + full.long().cumsum(1) - 1
        return pos.masked_fill(~full, 1)

    def install(self, cache) -> None:
        """Route ``cache.update`` through the re-lay for this call (only when the cached slots must move)."""
        if not self.relay or cache is None:
            return
        if not hasattr(cache, "layers") or not hasattr(type(cache), "update"):
            if _no_pad_step(self.decode, self.n_new):
                return
            raise ValueError(
                f"safepad: a cached call with padding after real tokens needs a transformers Cache with layers "
                f"(DynamicCache), got {type(cache).__name__}"
            )
        self.moved_positions = _justify_position_history(cache, self)
        cache.update = _JustifyingUpdate(cache, self)
        if hasattr(type(cache), "update_indexer"):
            cache.update_indexer = _JustifyingIndexerUpdate(cache, self)
        self._cache = cache

    def with_moved_positions(self, position_ids: Tensor) -> Tensor:
        """The chunk's justified ``position_ids`` (``[B, T]`` or ``[R, B, T]``) with the columns that the re-lay
        fills with cached real slots set to those slots' stored positions (a cache keeping a per-slot position
        history, :func:`_justify_position_history`); unchanged otherwise. ``R`` may exceed the history's ``K``
        by a leading text row (Qwen4-Exp's ``[4, B, T]``), which gets the history's first row."""
        moved = self.moved_positions
        if moved is None:
            return position_ids
        sel = (self.mask[:, -self.T :] & ~self.token_mask).to(position_ids.device)  # [B, T] moved cached slots
        moved = moved.to(device=position_ids.device, dtype=position_ids.dtype)  # [K, B, T]
        if position_ids.dim() == 2:
            return torch.where(sel, moved[0], position_ids)
        R = position_ids.shape[0]
        if moved.shape[0] != R:  # a leading text row: the history's first row; or fewer rows: the last ones
            moved = torch.cat([moved[:1].expand(max(R - moved.shape[0], 0), -1, -1), moved])[-R:]  # [R, B, T]
        return torch.where(sel[None], moved, position_ids.expand(R, *sel.shape))

    def uninstall(self) -> None:
        if self._cache is not None:
            self._cache.__dict__.pop("update", None)
            self._cache.__dict__.pop("update_indexer", None)
            self._cache = None

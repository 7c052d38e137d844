"""The generic padding-correct Griffin recurrent block (RecurrentGemma's ``RecurrentGemmaRecurrentBlock``).

Structure (transformers 5.23 / 5.24)::

    y = act(linear_y(x))
    u = conv_1d(linear_x(x))                 depthwise causal conv, width K
    h = rg_lru(u)                            gated linear recurrence (safepad.ops.rg_lru)
    out = linear_out(h * y)

**Module-state adapter.** The stock block keeps its states on the modules (``conv1d_state`` ``[B, W, K-1]`` and
``rg_lru.recurrent_states`` ``[B, W]`` float32), not in the cache, and it re-initialises them only when the
model builds its own cache; it also ignores ``conv1d_state`` on a multi-token continuation chunk and caches
the last columns of the padded row. The wrapped block keeps both states in the cache it is handed (the
``LinearAttentionLayer`` that ``DynamicCache(config=...)`` builds for each recurrent layer; stock leaves it
empty), so a fresh cache means a fresh sequence whatever the modules hold, and each row's states are those
of its last *real* token. It mirrors them onto the module attributes after every cached call, so code that
reads the module storage sees the same per-row states.

Resets: the first real token of every sequence starts from a reset (``h = i * x``, as the stock module does at
``position_ids == 0``): each packed sequence (``seq_idx``), and each row of a call with no cached state. A call
that continues a cached state never resets (the stock one resets wherever ``position_ids`` is 0).

Spec ``options``: ``activation`` (None: the module's ``act_fn``), ``c`` (8.0). Shapes: ``B`` batch, ``T`` tokens,
``W`` = ``lru_width``, ``K`` conv width.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from .._tracing import tracing
from ..cache import read_states, write_states
from ..context import context_padding_mask, current_context
from ..ops.conv import causal_conv1d
from ..ops.rg_lru import rg_lru, rg_lru_step
from .common import cached_conv_step, hold_masked_rows, pop_cache, prepare_layout

logger = logging.getLogger(__name__)

__all__ = ["rg_lru_block_forward"]


def _layer_idx(self) -> int:
    idx = getattr(self, "layer_idx", None)
    if idx is None:
        idx = self._safepad.layer_idx
    if idx is None:
        raise ValueError(
            f"{type(self).__name__}: safepad could not tell which decoder layer this block is (its name holds no "
            "layer index), so it cannot find its states in the cache; wrap the whole model (safepad.wrap(model))"
        )
    return idx


def _check_cache_layer(cache, idx: int) -> None:
    layers = getattr(cache, "layers", None)
    if layers is None or idx >= len(layers) or not hasattr(layers[idx], "conv_states"):
        raise ValueError(
            f"the cache passed to the wrapped recurrent block of layer {idx} has no recurrent layer there "
            f"({type(cache).__name__}); pass DynamicCache(config=model.config) (what generate() builds), whose "
            "recurrent layers hold the per-row RG-LRU and conv states"
        )


def _refuse_continuation_without_states(self, position_ids: Tensor | None, mask: Tensor | None,
                                        cached: bool = True) -> None:
    """A call whose ``position_ids`` ``[B, T]`` do not start a sequence (a row's first real token past 0, or before
    it) with no state for this block: a cache that holds none (``cached``; the stock forward returns no cache and builds a new one on
    every call without one) or no cache at all (``use_cache=False``: stock runs such a row from a zero state
    without its sequence-start reset, safepad from a reset; neither is the sequence). The tokens before are gone:
    raise naming the fix instead of starting a new sequence."""
    if tracing() or not isinstance(position_ids, Tensor) or position_ids.dim() != 2 or position_ids.numel() == 0:
        return
    # one host read per call, not per block: the verdict is kept in the call's memo (each block asks the same)
    ctx = current_context()
    key = ("rg_lru_continues", id(position_ids), id(mask) if isinstance(mask, Tensor) else None)
    if ctx is not None and key in ctx.layouts:
        continues = ctx.layouts[key]
    else:
        pos = position_ids
        if isinstance(mask, Tensor) and tuple(mask.shape) == tuple(pos.shape):
            pos = pos.masked_fill(~mask.to(torch.bool), torch.iinfo(pos.dtype).max)  # pads do not count
        first = pos.amin(dim=1)  # [B]: each row's first real position
        first = first[first < torch.iinfo(pos.dtype).max]  # rows with a real token
        # a first real position past 0 continues a sequence; one before 0 (position_ids [-1, 0, ...]) is no sequence
        # start either: stock resets exactly where position_ids == 0, so neither reading is the row alone
        off = first[first != 0]
        continues = int(off[0]) if off.numel() else None
        if ctx is not None:
            ctx.layouts[key] = continues
    if continues is not None:
        if not cached:
            raise ValueError(
                f"{type(self).__name__}: position_ids do not start a sequence (a row's first real token is at position "
                f"{continues}, not 0), but this call has no cache, so the earlier tokens' recurrent states are gone "
                "(stock RecurrentGemma would run the row from a zero state without its sequence-start reset). Pass "
                "the whole sequence, continue it through the cache of its earlier tokens (DynamicCache(config="
                "model.config), handed to every call), or give position_ids that start at 0."
            )
        raise ValueError(
            f"{type(self).__name__}: position_ids do not start a sequence (a row's first real token is at position "
            f"{continues}, not 0), but the cache of this call holds no recurrent state: RecurrentGemma's forward "
            "returns no cache and starts a new one on every call that is handed none, so the earlier tokens' states "
            "are gone. Build cache = DynamicCache(config=model.config) and pass it (cache= in transformers 5.24, "
            "past_key_values= in 5.23) to the prefill and to every later call, or use generate(); to start a new "
            "sequence, give position_ids that start at 0."
        )


#: ``[B]`` bool on a cache layer of the RG-LRU: whether each row's state has read a real token (a row of pads only
#: has not: its first real token starts from a reset, as the row alone). Moved by the cache's row operations
#: (``safepad.wrap.cache_rows``); absent means every row has
STARTED_ATTR = "_safepad_rows_started"


def _rows_started(cache, idx: int, B: int) -> Tensor | None:
    """The ``[B]`` bool of :data:`STARTED_ATTR` on the cache's layer ``idx``, or None (every row has started)."""
    started = getattr(cache.layers[idx], STARTED_ATTR, None) if cache is not None else None
    return started if isinstance(started, Tensor) and tuple(started.shape) == (B,) else None


def _mark_started(cache, idx: int, started: Tensor | None, mask: Tensor | None) -> None:
    """After a cached call: a row has started once it read a real token (``mask`` ``[B, T]``, None: every token
    real). Device math only (no host read), once per call for all the recurrent layers that hold the same flags."""
    layer = cache.layers[idx]
    if mask is None:  # every row read a real token: every row has started, which the flags' absence says
        if STARTED_ATTR in vars(layer):
            delattr(layer, STARTED_ATTR)
        return
    # each recurrent layer of one call holds the same flags (shared since the call that set them) and reads the
    # same mask: the first one computes the new flags, the others take them from the call's memo
    ctx = None if tracing() else current_context()
    key = ("rg_lru_started", id(mask), id(started))
    held = ctx.layouts.get(key) if ctx is not None else None
    if held is not None and held[0] is mask and held[1] is started:
        now = held[2]
    else:
        now = mask.to(torch.bool).any(dim=1)  # [B]
        if started is not None:
            now = started.to(now.device) | now
        if ctx is not None:
            ctx.layouts[key] = (mask, started, now)  # (the tensors held: their ids stay theirs for the call)
    setattr(layer, STARTED_ATTR, now)


def rg_lru_block_forward(
    self,
    input_states: Tensor,
    position_ids: Tensor | None = None,
    attention_mask: Tensor | None = None,
    use_cache: bool = True,
    **kwargs,
) -> tuple[Tensor, None]:
    """Padding/packing-correct forward of a Griffin recurrent block. ``input_states [B, T, D]`` -> ``([B, T, D], None)``.

    ``position_ids`` are not read (resets come from the boundaries and the cache); ``attention_mask`` is the
    model's 4-D attention mask, so the padding mask comes from the model call (a 2-D mask passed here wins).
    """
    opts = self._safepad_spec.options
    backend = self._safepad.backend
    cache = pop_cache(None, kwargs)
    if not use_cache:
        cache = None
    B, T = input_states.shape[:2]
    mask2d = attention_mask if isinstance(attention_mask, Tensor) and attention_mask.dim() == 2 else None
    if mask2d is None:
        mask2d = context_padding_mask((B, T))
    idx = _layer_idx(self) if cache is not None else -1
    if cache is not None:
        _check_cache_layer(cache, idx)
    hidden, layout = prepare_layout(self, input_states, mask2d, cache, kwargs)
    if layout.sp is not None:
        raise ValueError(
            f"{type(self).__name__}: sequence parallelism (safepad.distributed) does not cover the RG-LRU yet; run "
            "RecurrentGemma without a sequence-parallel group"
        )
    mask = layout.mask
    dtype = hidden.dtype
    if mask is not None:
        hidden = torch.where(mask[..., None], hidden, 0.0)  # pads contribute nothing (even a NaN)
    y_branch = self.act_fn(self.linear_y(hidden))  # [B, T, W]
    x_branch = self.linear_x(hidden)  # [B, T, W]
    conv = self.conv_1d
    K = conv.weight.shape[-1]  # [W, 1, K]
    lru = self.rg_lru
    params = (lru.input_gate_weight, lru.input_gate_bias, lru.recurrent_gate_weight, lru.recurrent_gate_bias,
              lru.recurrent_param)
    c = float(opts.get("c", 8.0))
    past = read_states(cache, idx) if cache is not None else read_states(None, 0)
    if not past.has_previous:
        _refuse_continuation_without_states(self, position_ids, mask2d, cached=cache is not None)

    started = _rows_started(cache, idx, B) if past.has_previous else None  # [B] bool, or None: every row

    if past.has_previous and T == 1:
        u, conv_new = cached_conv_step(x_branch, conv, past, activation=None, backend=backend)  # [B, 1, W]
        conv_new = hold_masked_rows(mask, conv_new, past.conv)  # [B, W, K-1]
        h, rec_new = rg_lru_step(
            u[:, 0], past.recurrent, *params, c=c, token_mask=mask, started=started  # mask [B, 1]
        )
        h = h[:, None]  # [B, 1, W]
    else:
        want = cache is not None
        out = causal_conv1d(
            x_branch, conv.weight.squeeze(1), conv.bias, seq_idx=layout.seq_idx, initial_state=past.conv,  # [W, K]
            token_mask=mask, return_final_state=want, state_len=max(K - 1, 1), backend=backend,
        )
        u, conv_new = out if want else (out, None)  # [B, T, W], [B, W, K-1]
        out = rg_lru(
            u, *params, c=c, seq_idx=layout.seq_idx, initial_state=past.recurrent, token_mask=mask,
            return_final_state=want, started=started,
        )
        h, rec_new = out if want else (out, None)  # [B, T, W], [B, W] float32
    if cache is not None:
        conv_new = conv_new.to(x_branch.dtype)
        write_states(cache, idx, tokens=T, conv=conv_new, recurrent=rec_new)
        _mark_started(cache, idx, started, mask)
        self.conv1d_state, lru.recurrent_states = conv_new, rec_new  # the module storage mirrors the cache
    elif not use_cache:
        self.conv1d_state, lru.recurrent_states = None, None  # as the stock block
    out = self.linear_out((h * y_branch).to(dtype))  # [B, T, D]
    return layout.restore(out), None

"""Pieces every generic mixer shares: layout preparation (mask, compaction, boundaries) and output restore."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.modules import module as mod

from .._tracing import require, tracing
from ..cache import CACHE_NAMES
from ..context import context_decode_mask, context_token_mask, current_context, resolve_seq_idx
from ..parallel.context import SPContext, resolve_sp
from ..layout.masks import Compaction, is_right_padded, normalize_mask, pads_before_real
from ..ops.conv import causal_conv1d, causal_conv1d_step
from ..ops.norm import gated_rms_norm

logger = logging.getLogger(__name__)

__all__ = [
    "CACHE_KWARGS",
    "Layout",
    "cached_conv",
    "cached_conv_step",
    "gated_norm",
    "hold_masked_rows",
    "layout_op",
    "pop_cache",
    "prepare_layout",
    "probe_gated_norm",
]


#: the names transformers has used for the cache argument of a mixer (one list for the package: safepad.cache)
CACHE_KWARGS = CACHE_NAMES


def pop_cache(cache, kwargs: dict):
    """The cache of this mixer call, whichever of :data:`CACHE_KWARGS` it came under (popped from ``kwargs``)."""
    for name in CACHE_KWARGS:
        other = kwargs.pop(name, None)
        if cache is None:
            cache = other
    return cache


@dataclass
class Layout:
    """How the tokens of this mixer call are laid out.

    ``mask`` ``[B, T]`` bool right-padded token mask (``None``: every token is real);
    ``seq_idx`` ``[B, T]`` int32 packed boundaries (``None``: one sequence per row);
    ``compaction``: set when the rows were compacted (left pads / holes) and outputs must be scattered back;
    ``sp``: the sequence-parallel context when this call is one rank's shard (``safepad.distributed``);
    ``right_padded``: ``[]`` bool, only while tracing (every masked call is compacted then): the mask was
    right-padded already, so the compaction is the identity and the outputs at pads stay as computed.
    """

    mask: Tensor | None
    seq_idx: Tensor | None
    compaction: Compaction | None
    sp: SPContext | None = None
    right_padded: Tensor | None = None

    def restore(self, out: Tensor) -> Tensor:
        """Put ``out`` ``[B, T, ...]`` back into the caller's token order."""
        if self.compaction is None:
            return out
        back = self.compaction.scatter(out)
        if self.right_padded is not None:
            back = torch.where(self.right_padded, out, back)  # eager does not compact a right-padded mask
        return back


def prepare_layout(
    module: torch.nn.Module, hidden_states: Tensor, attention_mask: Tensor | None, cache, kwargs: dict
) -> tuple[Tensor, Layout]:
    """Normalise the mask and boundaries of one mixer call and compact rows when needed.

    ``hidden_states`` ``[B, T, C]`` -> (possibly compacted ``hidden_states``, :class:`Layout`).
    Raises ``ValueError`` for packed rows together with a cache, or packed rows together with padding.
    """
    B, T = hidden_states.shape[:2]
    seq_idx = resolve_seq_idx(module, (B, T), kwargs)
    override = context_token_mask((B, T))  # a slot-justified call: the tokens' own mask, not the slots'
    if override is not None:
        attention_mask = override
    if T == 1:
        # transformers drops the mask on one-token steps (or, glm5_next, replaces it by ones): the caller's
        # mask of this step, when it marks some rows' token as padding, comes from the call context
        step = context_decode_mask((B, T))
        if step is not None:
            attention_mask = step
    mask, compaction, right_padded = _analyse_mask(attention_mask, (B, T))
    if seq_idx is not None and cache is not None:
        raise ValueError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}): a packed row holds several "
            "sequences but a cache was requested; the cache keeps one state per row, so there is no right state to "
            "store. Call with use_cache=False for packed inputs, or pad (left or right) instead of packing."
        )
    if seq_idx is not None and mask is not None:
        both = (
            "packed boundaries (seq_idx / cu_seq_lens / position_ids) came together with an attention_mask that "
            "has zeros; describe padding either as its own segment in the packed row or with a mask, not both"
        )
        # eager, a mask here has zeros (normalize_mask drops all-ones ones): this raises. Traced, the mask is kept
        # whatever its values; a packed call's own mask was dropped by the model hook, so this is one the model
        # built itself (glm5_next hands its mixers ones): all ones, checked on the device
        require(mask.all(), both)
        mask = compaction = right_padded = None
    sp = resolve_sp(module, (B, T))
    if sp is not None and (cache is not None or mask is not None):
        raise ValueError(
            f"{type(module).__name__}: a sequence-parallel shard cannot take a cache or a padding mask; pack the "
            "sequences and call with use_cache=False"
        )
    if compaction is not None:
        hidden_states = compaction.gather(hidden_states)  # [B, T, C] real tokens first
        mask = compaction.mask
    return hidden_states, Layout(mask=mask, seq_idx=seq_idx, compaction=compaction, sp=sp, right_padded=right_padded)


def layout_op(layout: Layout, fn):
    """``fn`` (a torch-core op), or its sequence-parallel version when ``layout`` is one rank's shard."""
    if layout.sp is None:
        return fn
    from ..parallel.ops import sp_op

    return sp_op(fn, layout.sp)


def _analyse_mask(
    attention_mask: Tensor | None, shape: tuple[int, int]
) -> tuple[Tensor | None, Compaction | None, Tensor | None]:
    """``(mask, compaction, right_padded)`` of one call's mask: the bool mask ``[B, T]`` or None, the compaction or
    None, and (traced only) ``[]`` bool whether the mask was right-padded already. One body for eager and traced calls.

    Eager, an all-ones mask gives ``None`` and a right-padded one no compaction (one host read of
    :func:`~safepad.layout.masks.pads_before_real`). Every recurrent layer of a model call gets the same mask
    tensor, so the analysis (that host read, a sort for compaction) runs once per call, memoised in the call context
    and keyed by the tensor object. Traced (no host read): any 2-D mask is kept (all ones: every token is real, the
    same result as none) and compacted (a right-padded mask: the identity, which ``right_padded`` marks).
    """
    traced = tracing()
    ctx = None if traced or attention_mask is None else current_context()  # the memo: eager only
    key = None if ctx is None else (id(attention_mask), tuple(shape))
    if ctx is not None:
        hit = ctx.layouts.get(key)
        if hit is not None and hit[0] is attention_mask:
            return hit[1], hit[2], None
    mask = normalize_mask(attention_mask, shape)
    if traced:
        if mask is None:
            return None, None, None
        return mask, Compaction.from_mask(mask), ~pads_before_real(mask).any()  # right_padded: [] bool
    compaction = Compaction.from_mask(mask) if mask is not None and not is_right_padded(mask) else None
    if ctx is not None:
        ctx.layouts[key] = (attention_mask, mask, compaction)  # holding the tensor keeps its id unique
    return mask, compaction, None


def cached_conv(
    x: Tensor, conv: torch.nn.Conv1d, layout: Layout, past, *, activation: str | None, want_state: bool, backend: str
) -> tuple[Tensor, Tensor | None]:
    """The mixer's depthwise causal conv over a chunk, continuing from the cached conv state.

    ``x`` ``[B, T, D]`` -> (``y`` ``[B, T, D]``, the new cache conv state ``[B, D, K]`` or ``None`` when
    ``want_state`` is False). The window never crosses a ``layout.seq_idx`` boundary, masked (trailing) tokens
    are not part of the state, and ``past.conv`` (the HF cache layout) is the left context of each row.
    """
    weight = conv.weight.squeeze(1)  # [D, 1, K] -> [D, K]
    out = layout_op(layout, causal_conv1d)(
        x,
        weight,
        conv.bias,
        activation=activation,
        seq_idx=layout.seq_idx,
        initial_state=past.conv,
        token_mask=layout.mask,
        return_final_state=want_state,
        state_len=weight.shape[-1],
        backend=backend,
    )
    y, state = out if want_state else (out, None)  # [B, T, D], [B, D, K]
    return y, (state.to(x.dtype) if state is not None else None)


def cached_conv_step(
    x: Tensor, conv: torch.nn.Conv1d, past, *, activation: str | None, backend: str
) -> tuple[Tensor, Tensor]:
    """One decode token through the conv: ``x`` ``[B, D]`` or ``[B, 1, D]`` -> (``y`` shaped as ``x``, new conv
    state ``[B, D, K]``)."""
    return causal_conv1d_step(x, past.conv, conv.weight.squeeze(1), conv.bias, activation=activation, backend=backend)


def hold_masked_rows(mask: Tensor | None, new: Tensor, old: Tensor | None) -> Tensor:
    """Decode: rows whose token is masked (``mask`` ``[B, 1]`` False) keep their ``old`` state ``[B, ...]``."""
    if mask is None or old is None:
        return new
    if mask.dim() != 2 or mask.shape[1] != 1:
        raise ValueError(f"hold_masked_rows takes the decode step's mask [batch, 1], got {tuple(mask.shape)}")
    keep = mask if new.dim() == 2 else mask.view(mask.shape[0], *([1] * (new.dim() - 1)))  # [B, 1, ...]
    return torch.where(keep, new, old.to(new.dtype))


def _has_hooks(module: torch.nn.Module) -> bool:
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or mod._global_forward_hooks
        or mod._global_forward_pre_hooks
        or mod._global_backward_hooks
        or mod._global_backward_pre_hooks
    )


#: per norm class: does its forward compute exactly gated_rms_norm? Checked numerically once per class, so a
#: transformers release that changes the math falls back to the module instead of silently diverging.
_FUSABLE: dict[type, bool] = {}


def _same_math(norm: torch.nn.Module) -> bool:
    cls = type(norm)
    if cls not in _FUSABLE:
        ok = False
        try:
            I = norm.weight.numel()  # noqa: E741
            g = torch.Generator().manual_seed(0)
            y = torch.randn(2, 3, I, generator=g).to(norm.weight)
            z = torch.randn(2, 3, I, generator=g).to(norm.weight)
            with torch.no_grad():
                ref = norm(y, z)
                out = gated_rms_norm(y, z, norm.weight, norm.group_size, norm.variance_epsilon)
            ok = ref.shape == out.shape and ref.dtype == out.dtype and torch.allclose(out, ref, rtol=1e-4, atol=1e-5)
        except (AttributeError, TypeError, ValueError, RuntimeError) as err:
            logger.debug("gated norm %s not fusable: %s", cls.__name__, err)
        if not ok:
            logger.warning(
                "%s does not compute the gated group RMSNorm safepad expects; safepad calls it as a module",
                cls.__qualname__,
            )
        _FUSABLE[cls] = ok
    return _FUSABLE[cls]


def _names(stock_class: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if stock_class is None else (stock_class,) if isinstance(stock_class, str) else tuple(stock_class)


def probe_gated_norm(module: torch.nn.Module, stock_class: str | tuple[str, ...] | None) -> None:
    """Run the once-per-class numeric check of ``module.norm`` now (at wrap time), outside any compiled region."""
    norm = getattr(module, "norm", None)
    if norm is not None and type(norm).__name__ in _names(stock_class):
        _same_math(norm)


def gated_norm(
    norm: torch.nn.Module, y: Tensor, gate: Tensor, stock_class: str | tuple[str, ...] | None
) -> Tensor:
    """The mixer's gated norm ``norm(y, gate)``, ``[B, T, I]`` each.

    ``stock_class`` is the transformers class whose forward is :func:`~safepad.ops.norm.gated_rms_norm`, as
    the family's spec declares it (``options["gated_norm"]``: a class name, or the names it has had across
    releases; None: always call the module). An unmodified
    norm of that class (exact class, no hooks, no per-instance ``forward``, and checked once per class to
    compute the same math) runs as the blocked op (several times fewer memory passes); anything else (a
    subclass, a PEFT wrapper, a module with hooks or with accelerate's replaced ``forward``) is called as the
    module.
    """
    cls = type(norm)
    if (
        cls.__name__ in _names(stock_class)
        and cls.__module__.startswith("transformers.")
        and "forward" not in vars(norm)  # accelerate's device/offload hooks replace the instance's forward
        and not _has_hooks(norm)
        and (cls in _FUSABLE or not tracing())  # the numeric check cannot run while tracing: wrap() runs it
        and _same_math(norm)
    ):
        return gated_rms_norm(y, gate, norm.weight, norm.group_size, norm.variance_epsilon)
    return norm(y, gate)

"""Per-call context: packed boundaries normalised once per model call and handed to every mixer.

Many families drop ``**kwargs`` before their mixers (``Mamba2ForCausalLM``, Jamba's Mamba layers, Mamba,
FalconMamba), so boundaries cannot travel as arguments. A model-level forward pre-hook normalises them
(``seq_idx`` / ``cu_seq_lens_q|k`` / packed ``position_ids``; :mod:`safepad.layout.normalize`) into one
``[B, T]`` ``seq_idx`` and puts it
in a :class:`contextvars.ContextVar` for the duration of the call. Mixers read it from there; a mixer
called directly may also receive the boundaries as its own kwargs.

Gradient checkpointing re-runs mixer forwards during backward, after the model call returned and
possibly after other calls (a second packed forward, an evaluation). The boundaries must travel with the
call that produced them: ``safepad.wrap`` wraps each layer's checkpoint function so that the recompute runs
under the :class:`CallContext` captured at that layer's forward (``safepad.wrap.checkpoint``).
Nothing else is remembered; a mixer recomputed during backward without a context, after it has seen packed
boundaries, raises instead of guessing (see :func:`resolve_seq_idx`).

Under ``torch.compile`` the context also lives in a plain module-level stack that dynamo can trace (it
cannot trace ``ContextVar``): the model hooks push onto it (:func:`enter_call`) whether they run traced
(``torch.compile(model)``) or eagerly around a compiled ``forward`` (``model.forward =
torch.compile(model.forward)``), and traced code reads it from there (:class:`safepad._tracing.CallScope`). Boundaries are then derived and
validated on the device (see :func:`safepad._tracing.require`); that stack is per thread (``threading.local``, which
compiled code reads in the calling thread), so concurrent calls in several threads stay apart.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ._state import module_state, state_of
from ._tracing import CallScope, in_backward, tracing
from .layout.normalize import normalize_boundaries

__all__ = [
    "BOUNDARY_KWARGS",
    "CallContext",
    "context_decode_mask",
    "current_context",
    "enter_call",
    "exit_call",
    "no_call_context",
    "resolve_seq_idx",
]

#: kwargs that describe packed boundaries (consumed by safepad, never needed by a recurrent mixer itself).
BOUNDARY_KWARGS = ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@dataclass(frozen=True)
class CallContext:
    """What one model call told safepad about its layout.

    ``seq_idx`` ``[B, T]`` int32 when the rows are packed (several sequences in a row), else ``None``.
    """

    seq_idx: Tensor | None
    shape: tuple[int, int]
    source: str = "none"
    #: ``[B, 1]`` bool for a one-token step whose 2-D mask marks some rows' new token as padding
    #: (transformers passes no mask to recurrent layers on one-token steps).
    decode_mask: Tensor | None = None
    #: the call's 2-D ``attention_mask`` (past + current columns) when it marks pads and the rows are not packed,
    #: for mixers whose model hands them only a 4-D attention mask (RecurrentGemma)
    padding_mask: Tensor | None = None
    #: ``[B, T]`` bool mask of the current tokens when it is not the attention mask's last ``T`` columns: a
    #: slot-justified call (``safepad.layout.slots``), whose attention mask describes cache slots
    token_mask: Tensor | None = None
    #: per-call memo of the mask analysis, so each layer of one call does not redo it (``safepad.mixers``)
    layouts: dict = field(default_factory=dict, compare=False, repr=False)
    #: a continuous-batching step (``safepad.serving.step.ServingStep``): the packed row is one chunk per request,
    #: each continuing the recurrent state in its slot
    serving: Any = None

    @property
    def packed(self) -> bool:
        return self.seq_idx is not None


#: the context of each model call in progress (per thread; readable by traced code: :class:`~safepad._tracing.CallScope`)
_SCOPE: CallScope[CallContext] = CallScope("safepad_call_context")


def current_context() -> CallContext | None:
    """The context of the model call in progress, if any."""
    return _SCOPE.current()


def set_context(ctx: CallContext | None) -> contextvars.Token:
    return _SCOPE.set_eager(ctx)


def reset_context(token: contextvars.Token) -> None:
    _SCOPE.reset_eager(token)


def enter_call(ctx: CallContext | None) -> contextvars.Token | str:
    """A model call begins: ``ctx`` becomes the current context (the ContextVar, and the traced stack)."""
    return _SCOPE.push(ctx)


def exit_call(token: contextvars.Token | str) -> None:
    """The model call of :func:`enter_call`'s ``token`` ends."""
    _SCOPE.pop(token)


def context_token_mask(shape: tuple[int, int]) -> Tensor | None:
    """The model call's ``[B, T]`` current-token mask when it overrides the mask a mixer is given, else None."""
    ctx = current_context()
    if ctx is not None and ctx.token_mask is not None and ctx.shape == tuple(shape):
        return ctx.token_mask
    return None


def context_decode_mask(shape: tuple[int, int]) -> Tensor | None:
    """The model call's ``[B, 1]`` mask of a one-token step, when it marks some new tokens as padding."""
    ctx = current_context()
    if ctx is not None and ctx.decode_mask is not None and ctx.shape == tuple(shape):
        return ctx.decode_mask
    return None


def context_padding_mask(shape: tuple[int, int]) -> Tensor | None:
    """The model call's 2-D padding mask ``[B, >= T]`` when this mixer call is that call's ``[B, T]`` tokens."""
    ctx = current_context()
    if ctx is not None and ctx.padding_mask is not None and ctx.shape == tuple(shape):
        return ctx.padding_mask
    return None


def no_call_context() -> CallContext:
    """The context a checkpoint recompute runs under when its forward had none (not a model call safepad saw):
    it matches no shape, so a mixer reads no boundaries from it, and it tells the mixer it is no stray recompute.
    A fresh one per forward, so that its per-call memo is freed with it."""
    return CallContext(seq_idx=None, shape=(-1, -1), source="none")


def _saw_packed(module: torch.nn.Module) -> bool:
    state = state_of(module)
    return state is not None and state.saw_packed


def resolve_seq_idx(module: torch.nn.Module, shape: tuple[int, int], kwargs: dict) -> Tensor | None:
    """The ``seq_idx`` ``[B, T]`` a mixer must use for this call, or ``None`` (one sequence per row).

    Order: boundaries passed to the mixer itself > the model call's context (restored by the wrapped
    checkpoint function during a gradient-checkpoint recompute). Boundary kwargs are popped from ``kwargs``.
    A mixer that has seen packed boundaries and is re-run by autograd (a recompute) without any context
    raises ``RuntimeError``: the boundaries of its forward are unknown, and another call's would be wrong.
    """
    direct = {k: kwargs.pop(k, None) for k in BOUNDARY_KWARGS}
    if any(direct[k] is not None for k in ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k")):
        seq_idx, _ = normalize_boundaries(
            shape,
            seq_idx=direct["seq_idx"],
            cu_seq_lens_q=direct["cu_seq_lens_q"],
            cu_seq_lens_k=direct["cu_seq_lens_k"],
        )
    else:
        ctx = current_context()
        if ctx is None:
            if not tracing() and _saw_packed(module) and in_backward():
                raise RuntimeError(
                    f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) is being recomputed during "
                    "backward (activation checkpointing) without the safepad call context of its forward, and it has "
                    "seen packed boundaries: the boundaries of the forward being recomputed are unknown. Checkpoint "
                    "through transformers (model.gradient_checkpointing_enable(), which safepad.wrap hooks), or pass "
                    "seq_idx to the checkpointed module itself."
                )
            return None
        seq_idx = ctx.seq_idx if ctx.shape == tuple(shape) else None
    if seq_idx is not None and not tracing() and not _saw_packed(module):
        module_state(module).saw_packed = True
    return seq_idx

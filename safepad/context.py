"""Per-call context: packed boundaries normalised once per model call and handed to every mixer.

Many families drop ``**kwargs`` before their mixers (``Mamba2ForCausalLM``, Jamba's Mamba layers, Mamba,
FalconMamba), so boundaries cannot travel as arguments. A model-level forward pre-hook normalises them
(``seq_idx`` / ``cu_seq_lens_q|k`` / packed ``position_ids``) into one ``[B, T]`` ``seq_idx`` and puts it
in a :class:`contextvars.ContextVar` for the duration of the call. Mixers read it from there; a mixer
called directly may also receive the boundaries as its own kwargs.

Gradient checkpointing re-runs mixer forwards during backward, after the model call returned and
possibly after other calls (a second packed forward, an evaluation). The boundaries must travel with the
call that produced them: ``safepad.wrap`` wraps each layer's checkpoint function so that the recompute runs
under the :class:`CallContext` captured at that layer's forward (``safepad.wrap._CheckpointWithContext``).
Nothing else is remembered; a mixer recomputed during backward without a context, after it has seen packed
boundaries, raises instead of guessing (see :func:`resolve_seq_idx`).

Under ``torch.compile`` the context also lives in a plain module-level stack that dynamo can trace (it
cannot trace ``ContextVar``): the model hooks push onto it (:func:`enter_call`) whether they run traced
(``torch.compile(model)``) or eagerly around a compiled ``forward`` (``model.forward =
torch.compile(model.forward)``), and traced code reads it from there. Boundaries are then derived and
validated on the device (see :mod:`safepad._tracing`); that stack is per thread (``threading.local``, which
compiled code reads in the calling thread), so concurrent calls in several threads stay apart.
"""

from __future__ import annotations

import contextvars
import threading
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ._tracing import device_check, tracing
from .layout.boundaries import (
    known_multi_sequence,
    mark_valid_seq_idx,
    packing_positions,
    position_ids_restart,
    seq_idx_from_cu_seqlens,
    seq_idx_from_position_ids,
    validate_cu_seqlens,
    validate_seq_idx,
)

__all__ = [
    "BOUNDARY_KWARGS",
    "CallContext",
    "boundaries_from_kwargs",
    "context_decode_mask",
    "current_context",
    "enter_call",
    "exit_call",
    "multi_sequence",
    "no_call_context",
    "position_ids_from_seq_idx",
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

    @property
    def packed(self) -> bool:
        return self.seq_idx is not None


_CONTEXT: contextvars.ContextVar[CallContext | None] = contextvars.ContextVar("safepad_call_context", default=None)
#: the same contexts as a stack that dynamo can trace (innermost call last), one per thread; read only by traced
#: code. Compiled code reads it at run time (``model.forward = torch.compile(model.forward)``: the hooks push
#: eagerly), in the calling thread, so concurrent calls in other threads never see each other's boundaries.
_THREAD = threading.local()
# Created now for the importing thread: compiled code guards on whether the attribute exists, and creating it
# in the first compiled call would make the second call recompile.
_THREAD.stack = []


def _traced_stack() -> list[CallContext | None]:
    stack = getattr(_THREAD, "stack", None)
    if stack is None:
        stack = _THREAD.stack = []
    return stack
#: the token :func:`set_context` returns while tracing (no ContextVar is touched then)
_TRACED_TOKEN = "traced"


def current_context() -> CallContext | None:
    """The context of the model call in progress, if any."""
    if tracing():
        stack = _traced_stack()
        return stack[-1] if stack else None
    return _CONTEXT.get()


def set_context(ctx: CallContext | None) -> contextvars.Token:
    return _CONTEXT.set(ctx)


def reset_context(token: contextvars.Token) -> None:
    _CONTEXT.reset(token)


def enter_call(ctx: CallContext | None) -> contextvars.Token | str:
    """A model call begins: ``ctx`` becomes the current context (the ContextVar, and the traced stack)."""
    _traced_stack().append(ctx)
    if tracing():
        return _TRACED_TOKEN
    return _CONTEXT.set(ctx)


def exit_call(token: contextvars.Token | str) -> None:
    """The model call of :func:`enter_call`'s ``token`` ends."""
    stack = _traced_stack()
    if stack:
        stack.pop()
    if token is not _TRACED_TOKEN:
        _CONTEXT.reset(token)


def multi_sequence(seq_idx: Tensor) -> Tensor:
    """``[]`` bool on the device: some row of ``seq_idx`` ``[B, T]`` holds more than one sequence."""
    if seq_idx.shape[1] < 2:
        return torch.zeros((), dtype=torch.bool, device=seq_idx.device)
    return (seq_idx[:, -1] != seq_idx[:, 0]).any()


def _multi_sequence(seq_idx: Tensor) -> bool:
    known = known_multi_sequence(seq_idx)  # recorded by validate_seq_idx's one host read
    if known is not None:
        return known
    return bool((seq_idx[:, -1] != seq_idx[:, 0]).any()) if seq_idx.shape[1] > 1 else False


def boundaries_from_kwargs(
    shape: tuple[int, int],
    *,
    seq_idx: Tensor | None = None,
    cu_seq_lens_q: Tensor | None = None,
    cu_seq_lens_k: Tensor | None = None,
    position_ids: Tensor | None = None,
    padding_mask: Tensor | None = None,
) -> tuple[Tensor | None, str]:
    """Normalise every way of describing packed rows into ``seq_idx`` ``[B, T]`` int32 (or ``None``).

    * ``seq_idx`` ``[B, T]``: validated (integer, non-decreasing per row).
    * ``cu_seq_lens_q`` / ``cu_seq_lens_k`` ``[S + 1]``: cumulative over the flattened ``[B * T]`` tokens; they
      must agree with each other, end at ``B * T``, put a boundary at every row start, and agree with ``seq_idx``
      when both are given.
    * ``position_ids`` restarting at 0 inside a row (TRL ``padding_free``): ``[B, T]``, ``[1, T]`` or ``[T]``, or the
      text row of ``[4, B, T]`` / ``[1, B, T]`` or the all-zero tokens of ``[3, B, T]`` RoPE rows (see
      :func:`safepad.layout.boundaries.packing_positions`; other layouts are not read). With a
      ``padding_mask`` ``[B, >= T]`` (its last ``T`` columns; 1 = real token) only the real tokens count and a 0
      at a row's first real token is no restart, so ``generate()``'s ids (pads at 1, real tokens from 0) are not
      packing while packed sequences followed by pads are. When ``seq_idx`` / ``cu_seq_lens`` are given too,
      packed ``position_ids`` must put their restarts at the same places (compared between real tokens).

    Returns ``(seq_idx or None, source)``; ``None`` when every row holds a single sequence.
    Raises ``ValueError`` naming the argument on any inconsistency.

    While tracing (``torch.compile``) nothing is read on the host: the result is ``seq_idx`` whenever
    boundaries are given (a row of one sequence runs the varlen path with the same result), and every
    check above runs on the device (a ``RuntimeError`` with the same message).
    """
    if tracing():
        return _boundaries_traced(shape, seq_idx, cu_seq_lens_q, cu_seq_lens_k, position_ids, padding_mask)
    B, T = shape
    real = _real_pairs(padding_mask, T)  # [B, T - 1] or None
    source = "none"
    out: Tensor | None = None
    if seq_idx is not None:
        out = validate_seq_idx(seq_idx, (B, T))
        source = "seq_idx"
    cu = None
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        if cu_seq_lens_q is not None and cu_seq_lens_k is not None:
            q = validate_cu_seqlens(cu_seq_lens_q, B * T, "cu_seq_lens_q")
            k = validate_cu_seqlens(cu_seq_lens_k, B * T, "cu_seq_lens_k")
            if q.shape != k.shape or not torch.equal(q.to(k.device), k):
                raise ValueError(
                    "cu_seq_lens_q and cu_seq_lens_k differ: a recurrent layer has one set of boundaries, so pass "
                    "the same cumulative lengths for both (self-attention over packed rows)"
                )
            cu = q
        else:
            name = "cu_seq_lens_q" if cu_seq_lens_q is not None else "cu_seq_lens_k"
            cu = validate_cu_seqlens(cu_seq_lens_q if cu_seq_lens_q is not None else cu_seq_lens_k, B * T, name)
        flat = seq_idx_from_cu_seqlens(cu, B * T, "cu_seq_lens_q")  # [1, B*T]
        if B > 1:
            starts = torch.arange(B, device=cu.device) * T  # [B]
            if not bool(torch.isin(starts.to(cu.dtype), cu).all()):
                raise ValueError(
                    "cu_seq_lens_q describes a sequence that crosses from one row into the next: with batch > 1 "
                    "every row start must be a boundary (or flatten the batch to [1, total])"
                )
        from_cu = flat.view(B, T)  # [B, T]
        if out is not None:
            if not torch.equal(_change_points(out, real), _change_points(from_cu.to(out.device), real)):
                raise ValueError(
                    "cu_seq_lens_q disagrees with seq_idx: they put sequence boundaries at different tokens; pass "
                    "boundaries from one source (the safepad collator emits consistent ones)"
                )
        else:
            out, source = from_cu, "cu_seq_lens"
    position_ids = packing_positions(position_ids, (B, T))  # [B, T] from [T] / [1|B, T] / [4|3|1, B, T], or None
    if position_ids is not None:
        from_pos = None
        # with boundaries from seq_idx / cu_seq_lens, position_ids that do not restart at all are read too:
        # they disagree with the boundaries (attention layers would see one sequence per row)
        if padding_mask is None:
            if out is not None or position_ids_restart(position_ids):
                from_pos = seq_idx_from_position_ids(position_ids)  # [B, T]
        else:
            m = padding_mask[:, -T:].to(device=position_ids.device, dtype=torch.bool)  # [B, T]
            starts = (position_ids == 0) & m & (m.cumsum(1) > 1)  # a 0 at a real token after the first one
            if out is not None or (T > 1 and bool(starts.any())):  # one token: no restart after it
                from_pos = starts.cumsum(1).to(torch.int32)  # [B, T]; pads take their neighbours' ids
        if from_pos is not None:
            if out is not None:
                if not torch.equal(_change_points(out, real), _change_points(from_pos.to(out.device), real)):
                    raise ValueError(
                        f"position_ids disagree with {source}: they restart at 0 at different tokens than the "
                        "sequence boundaries (or nowhere), so attention layers would see other boundaries than the "
                        "recurrent ones; pass position_ids that restart at 0 at each boundary, or omit them "
                        "(safepad.wrap then derives them from the boundaries)"
                    )
            else:
                out, source = from_pos, "position_ids"
    if out is not None and not _multi_sequence(out):
        return None, source
    if out is not None:
        mark_valid_seq_idx(out, multi_sequence=True)  # validated once here: the mixers' ops skip their host reads
    return out, source


def _boundaries_traced(
    shape: tuple[int, int],
    seq_idx: Tensor | None,
    cu_seq_lens_q: Tensor | None,
    cu_seq_lens_k: Tensor | None,
    position_ids: Tensor | None,
    padding_mask: Tensor | None,
) -> tuple[Tensor | None, str]:
    """:func:`boundaries_from_kwargs` without host syncs (checks on the device). Given boundaries are returned
    even when every row holds one sequence (the varlen path gives the same result)."""
    B, T = shape
    real = _real_pairs(padding_mask, T)  # [B, T - 1] or None
    source = "none"
    out: Tensor | None = None
    if seq_idx is not None:
        out = validate_seq_idx(seq_idx, (B, T))
        source = "seq_idx"
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        if cu_seq_lens_q is not None and cu_seq_lens_k is not None:
            q = validate_cu_seqlens(cu_seq_lens_q, B * T, "cu_seq_lens_q")
            k = validate_cu_seqlens(cu_seq_lens_k, B * T, "cu_seq_lens_k")
            differ = (
                "cu_seq_lens_q and cu_seq_lens_k differ: a recurrent layer has one set of boundaries, so pass "
                "the same cumulative lengths for both (self-attention over packed rows)"
            )
            if q.shape != k.shape:
                raise ValueError(differ)
            device_check((q == k.to(q.device)).all(), differ)
            cu = q
        else:
            name = "cu_seq_lens_q" if cu_seq_lens_q is not None else "cu_seq_lens_k"
            cu = validate_cu_seqlens(cu_seq_lens_q if cu_seq_lens_q is not None else cu_seq_lens_k, B * T, name)
        from_cu = seq_idx_from_cu_seqlens(cu, B * T, "cu_seq_lens_q").view(B, T)  # [B, T]
        if B > 1:
            starts = torch.arange(B, device=cu.device) * T  # [B]
            device_check(
                torch.isin(starts.to(cu.dtype), cu).all(),
                "cu_seq_lens_q describes a sequence that crosses from one row into the next: with batch > 1 "
                "every row start must be a boundary (or flatten the batch to [1, total])",
            )
        if out is not None:
            device_check(
                (_change_points(out, real) == _change_points(from_cu.to(out.device), real)).all(),
                "cu_seq_lens_q disagrees with seq_idx: they put sequence boundaries at different tokens; pass "
                "boundaries from one source (the safepad collator emits consistent ones)",
            )
        else:
            out, source = from_cu, "cu_seq_lens"
    position_ids = packing_positions(position_ids, (B, T))  # [B, T] from [T] / [1|B, T] / [4|3|1, B, T], or None
    if position_ids is not None:
        if out is not None or T > 1:
            if padding_mask is None:
                from_pos = seq_idx_from_position_ids(position_ids)  # [B, T]
            else:
                m = padding_mask[:, -T:].to(device=position_ids.device, dtype=torch.bool)  # [B, T]
                starts = (position_ids == 0) & m & (m.cumsum(1) > 1)  # a 0 at a real token after the first one
                from_pos = starts.cumsum(1).to(torch.int32)  # [B, T]
            if out is not None:
                device_check(
                    (_change_points(out, real) == _change_points(from_pos.to(out.device), real)).all(),
                    f"position_ids disagree with {source}: they restart at 0 at different tokens than the "
                    "sequence boundaries (or nowhere), so attention layers would see other boundaries than the "
                    "recurrent ones; pass position_ids that restart at 0 at each boundary, or omit them "
                    "(safepad.wrap then derives them from the boundaries)",
                )
            else:
                out, source = from_pos, "position_ids"
    return out, source



def _real_pairs(padding_mask: Tensor | None, T: int) -> Tensor | None:
    """``[B, T - 1]`` bool: both tokens of a pair are real (where boundaries are compared); ``None`` without a mask."""
    if padding_mask is None:
        return None
    m = padding_mask[:, -T:].to(torch.bool)  # [B, T]
    return m[:, 1:] & m[:, :-1]

def _change_points(seq_idx: Tensor, real: Tensor | None = None) -> Tensor:
    """``[B, T - 1]`` bool: a new sequence starts at token t + 1 (only between two real tokens when
    ``real`` ``[B, T - 1]`` is given: where the pads' ids sit carries no meaning)."""
    change = seq_idx[:, 1:] != seq_idx[:, :-1]
    return change if real is None else change & real.to(change.device)


def position_ids_from_seq_idx(seq_idx: Tensor) -> Tensor:
    """Positions restarting at 0 at every boundary: ``[B, T]`` int64."""
    B, T = seq_idx.shape
    pos = torch.arange(T, device=seq_idx.device).expand(B, T)  # [B, T]
    start = torch.ones(B, T, dtype=torch.bool, device=seq_idx.device)
    start[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    start_pos = torch.where(start, pos, torch.zeros_like(pos))  # [B, T]
    return pos - torch.cummax(start_pos, dim=1).values  # [B, T]


def _in_backward() -> bool:
    try:
        return torch._C._current_graph_task_id() != -1
    except AttributeError:  # pragma: no cover - very old torch
        return False


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


def resolve_seq_idx(module: torch.nn.Module, shape: tuple[int, int], kwargs: dict) -> Tensor | None:
    """The ``seq_idx`` ``[B, T]`` a mixer must use for this call, or ``None`` (one sequence per row).

    Order: boundaries passed to the mixer itself > the model call's context (restored by the wrapped
    checkpoint function during a gradient-checkpoint recompute). Boundary kwargs are popped from ``kwargs``.
    A mixer that has seen packed boundaries and is re-run by autograd (a recompute) without any context
    raises ``RuntimeError``: the boundaries of its forward are unknown, and another call's would be wrong.
    """
    direct = {k: kwargs.pop(k, None) for k in BOUNDARY_KWARGS}
    if any(direct[k] is not None for k in ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k")):
        seq_idx, _ = boundaries_from_kwargs(
            shape,
            seq_idx=direct["seq_idx"],
            cu_seq_lens_q=direct["cu_seq_lens_q"],
            cu_seq_lens_k=direct["cu_seq_lens_k"],
        )
    else:
        ctx = current_context()
        if ctx is None:
            if not tracing() and module.__dict__.get("_safepad_saw_packed") and _in_backward():
                raise RuntimeError(
                    f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) is being recomputed during "
                    "backward (activation checkpointing) without the safepad call context of its forward, and it has "
                    "seen packed boundaries: the boundaries of the forward being recomputed are unknown. Checkpoint "
                    "through transformers (model.gradient_checkpointing_enable(), which safepad.wrap hooks), or pass "
                    "seq_idx to the checkpointed module itself."
                )
            return None
        seq_idx = ctx.seq_idx if ctx.shape == tuple(shape) else None
    if seq_idx is not None and not tracing() and not module.__dict__.get("_safepad_saw_packed"):
        module._safepad_saw_packed = True
    return seq_idx

"""The sequence-parallel context of one model call: which shard of every row this rank holds.

:class:`SPContext` is built once per model call by the entry point (:mod:`safepad.distributed.model`) and
put in a :class:`contextvars.ContextVar` for the duration of the call. The generic mixers consult it
through :func:`resolve_sp` (a narrow hook in ``safepad.mixers.common``) and dispatch their conv and scan
ops to the sequence-parallel versions in :mod:`safepad.parallel.ops`; the attention function reads it
too. Gradient checkpointing re-runs forwards during backward, after the call returned: each module keeps
the context of its last forward and re-uses it only while autograd runs a backward pass.

Shapes: ``B`` rows, ``T`` tokens of one rank's shard, ``Tg = world * T`` tokens of the whole row.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch
from torch import Tensor

from .._state import module_state, state_of
from .._tracing import CallScope, in_backward

__all__ = ["SPContext", "current_sp", "resolve_sp"]


@dataclass(frozen=True)
class SPContext:
    """One rank's view of a sequence-sharded call.

    ``global_seq_idx`` ``[B, Tg]`` int32 (``None``: every row is one sequence); ``crosses`` ``[world, B]``
    bool: rank ``r``'s first token continues the sequence of rank ``r - 1``'s last token (row ``0`` of it
    is all False). ``offset`` is this rank's first token in the row.
    """

    group: object
    rank: int
    world: int
    offset: int
    shape: tuple[int, int]
    global_len: int
    global_seq_idx: Tensor | None
    crosses: Tensor
    #: modules of attention type that ran through the sequence-parallel attention in this call (checked)
    attention_seen: set

    @property
    def local_len(self) -> int:
        return self.shape[1]

    def halo_valid(self, width: int) -> Tensor:
        """``[B, width]`` bool: the ``width`` tokens before this shard exist and belong to its first sequence."""
        B = self.shape[0]
        pos = torch.arange(self.offset - width, self.offset, device=self.crosses.device)  # [width] global positions
        valid = (pos >= 0).expand(B, width)
        if self.global_seq_idx is not None and self.offset > 0:
            g = self.global_seq_idx
            first = g[:, self.offset : self.offset + 1]  # [B, 1]
            valid = valid & (g[:, pos.clamp(min=0)] == first)
        return valid


#: the SP context of each model call in progress (per thread; readable by traced code)
_SP: CallScope[SPContext] = CallScope("safepad_sp_context")


def current_sp() -> SPContext | None:
    """The sequence-parallel context of the model call in progress, if any."""
    return _SP.current()


def set_sp(ctx: SPContext | None) -> contextvars.Token | str:
    return _SP.push(ctx)


def reset_sp(token: contextvars.Token | str) -> None:
    _SP.pop(token)


def resolve_sp(module: torch.nn.Module, shape: tuple[int, int]) -> SPContext | None:
    """The SP context a module must use for a call of ``[B, T]`` tokens, or ``None`` (no sequence parallelism).

    A call whose shape is not the shard's shape inside a sequence-parallel model call raises: every layer
    of a sharded call must see the shard.
    """
    if torch.compiler.is_compiling():
        if any(c is not None for c in _SP.stack()):
            raise ValueError(
                f"{type(module).__name__}: sequence parallelism is not supported under torch.compile; run the "
                "sequence-parallel model eagerly"
            )
        return None
    ctx = _SP.current()
    if ctx is not None:
        if tuple(shape) != ctx.shape:
            raise ValueError(
                f"{type(module).__name__}: a sequence-parallel call holds shards of shape {list(ctx.shape)} but "
                f"this layer got {list(shape)} tokens; sequence parallelism needs every layer to see the shard"
            )
        module_state(module).last_sp = ctx
        return ctx
    if in_backward():
        state = state_of(module)
        last = state.last_sp if state is not None else None
        if last is not None and tuple(last.shape) == tuple(shape):
            return last  # gradient-checkpoint recomputation of a sharded call
    return None

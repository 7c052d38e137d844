"""Looking up the Python stack: boundaries an enclosing module call did not pass down, and whether the call is
made by ``generate()``.

``safepad.wrap(model.backbone)`` hooks only the backbone, and ``MambaForCausalLM.forward`` drops ``seq_idx``
before calling it; eager calls find such boundaries one module call up (:func:`boundaries_of_enclosing_call`),
traced calls refuse what they cannot see (:func:`check_enclosing_call_at_trace`).
"""

from __future__ import annotations

import inspect
import logging
import sys

import torch
from torch import nn

from .._state import hooked
from ..layout.normalize import normalize_boundaries
from ..layout.boundaries import position_ids_restart

logger = logging.getLogger(__name__)

__all__ = [
    "BOUNDARY_INPUTS",
    "boundaries_of_enclosing_call",
    "check_enclosing_call_at_trace",
    "generate_frame",
    "inside_generate",
]

#: code objects of ``nn.Module.__call__``'s frames: their ``args`` / ``kwargs`` locals are a module call's inputs
_CALL_CODES = frozenset(
    f.__code__ for f in (getattr(nn.Module, n, None) for n in ("_call_impl", "_wrapped_call_impl")) if f is not None
)
BOUNDARY_INPUTS = ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "position_ids")
_MAX_FRAMES = 16


def boundaries_of_enclosing_call(module: nn.Module, shape: tuple[int, int], position_ids, padding_mask):
    """Boundaries that the nearest enclosing module call received but did not hand to this wrapped model.

    ``safepad.wrap(model.backbone)`` hooks only the backbone; ``MambaForCausalLM.forward`` takes ``seq_idx``
    (``**kwargs``) and calls the backbone without it. No hook of the outer model exists to see them, so this
    looks one module call up the Python stack (the ``kwargs`` of its ``nn.Module.__call__`` frame). Found
    boundaries are used when they fit this call's ``[B, T]`` (the outer model passes the same tokens down), and
    raise when they do not: the outer call was packed, and this one cannot know how. Returns
    ``(seq_idx | None, source)``.
    """
    frame = sys._getframe(2)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None, "none"
        if frame.f_code in _CALL_CODES:
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and owner is not module:
                break
        frame = frame.f_back
    else:
        return None, "none"
    outer_kwargs = frame.f_locals.get("kwargs") or {}
    found = {k: outer_kwargs.get(k) for k in BOUNDARY_INPUTS if isinstance(outer_kwargs.get(k), torch.Tensor)}
    if not found or set(found) == {"position_ids"} and not _restarts(found["position_ids"]):
        return None, "none"
    name = type(owner).__name__
    try:
        seq_idx, source = normalize_boundaries(
            shape,
            seq_idx=found.get("seq_idx"),
            cu_seq_lens_q=found.get("cu_seq_lens_q"),
            cu_seq_lens_k=found.get("cu_seq_lens_k"),
            position_ids=position_ids if isinstance(position_ids, torch.Tensor) else found.get("position_ids"),
            padding_mask=padding_mask,
        )
    except ValueError as err:
        raise ValueError(
            f"{name} was called with packed boundaries ({', '.join(found)}) but called the safepad-wrapped "
            f"{type(module).__name__} without them, and they do not fit its input of [batch, seqlen] = "
            f"{list(shape)} ({err}). Call safepad.wrap on the outermost model ({name}), or pass the boundaries to "
            f"the wrapped {type(module).__name__} yourself."
        ) from err
    if seq_idx is not None:
        logger.debug("safepad: %s dropped %s before the wrapped %s; using them", name, source, type(module).__name__)
        source = f"{source} of the enclosing {name} call"
    return seq_idx, source



def inside_generate() -> bool:
    """Is this model call made by transformers' ``generate()`` (a ``generate`` frame of ``transformers.generation``
    a few frames up the stack)?"""
    return generate_frame() is not None


def generate_frame():
    """The frame of the transformers ``generate()`` call that makes this model call, or None (identifies the call)."""
    frame = sys._getframe(2)
    for _ in range(_MAX_FRAMES * 2):
        if frame is None:
            return None
        if frame.f_code.co_name == "generate" and str(frame.f_globals.get("__name__", "")).startswith(
            "transformers.generation"
        ):
            return frame
        frame = frame.f_back
    return None


@torch.compiler.assume_constant_result
def check_enclosing_call_at_trace() -> bool:
    """While dynamo traces a wrapped model's call that received no boundaries: raise ``ValueError`` (surfacing as
    dynamo's ``InternalTorchDynamoError``, a ``RuntimeError`` carrying the message) when the boundaries of an
    enclosing module call could not reach it.

    Eager calls look one module call up the stack (:func:`_boundaries_of_enclosing_call`); a traced one cannot use
    what it would find there (tensors of the real stack, not graph inputs). Run once per trace (dynamo executes this
    for real and keeps the result), it walks the real Python stack to the nearest module call that is neither
    safepad-wrapped nor a ``torch.compile`` wrapper of a wrapped model:

    * a ``torch.compile`` wrapper of an unwrapped model (``torch.compile(model)`` after ``wrap(model.backbone)``)
      whose call holds boundary tensors: the message (dynamo re-traces when those inputs come or go);
    * a plain (not compiled) module around a compiled wrapped submodule, when its call holds boundary tensors, or
      whatever it holds when it is a transformers model whose forward can take boundaries (its compiled submodule's
      graph is reused for its later calls, which may hold some).

    Returns True otherwise (dynamo keeps the result as a constant).
    """
    from torch._dynamo.eval_frame import OptimizedModule

    frame = sys._getframe(1)
    for _ in range(_MAX_FRAMES * 64):  # dynamo's own frames (~80) sit between the traced call and the real stack
        if frame is None:
            return True
        owner = frame.f_locals.get("self") if frame.f_code in _CALL_CODES else None
        if isinstance(owner, nn.Module):
            inner = owner._orig_mod if isinstance(owner, OptimizedModule) else owner
            if not hooked(inner):
                break
        frame = frame.f_back
    else:
        return True
    outer_kwargs = frame.f_locals.get("kwargs") or {}
    found = [k for k in BOUNDARY_INPUTS if isinstance(outer_kwargs.get(k), torch.Tensor)]
    name = type(inner).__name__
    fix = (
        f"Under torch.compile, call safepad.wrap on the outermost model ({name}) and compile that, or pass the "
        "boundaries to the wrapped model yourself."
    )
    compiled = isinstance(owner, OptimizedModule)
    up = frame.f_back
    for _ in range(_MAX_FRAMES):  # the frame dynamo converts is the module's own call; its compile wrapper is above
        if up is None or compiled:
            break
        parent = up.f_locals.get("self") if up.f_code in _CALL_CODES else None
        if isinstance(parent, nn.Module) and parent is not inner:  # (_wrapped_call_impl and _call_impl: 2 frames)
            compiled = isinstance(parent, OptimizedModule) and parent._orig_mod is inner
            break
        up = up.f_back
    if compiled:
        if found:
            raise ValueError(
                f"{name} was called with packed boundaries ({', '.join(found)}) but calls the safepad-wrapped model "
                f"inside it without them; eager safepad finds them one call up the stack, a compiled call cannot. {fix}"
            )
        return True
    try:
        from transformers import PreTrainedModel
    except Exception:  # noqa: BLE001
        PreTrainedModel = ()  # type: ignore[assignment]
    params = inspect.signature(inner.forward).parameters
    takes = isinstance(inner, PreTrainedModel) and (
        any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()) or any(k in params for k in BOUNDARY_INPUTS)
    )  # a transformers model may drop them (pass-through wrappers such as DDP hand them on)
    if found or takes:
        raise ValueError(
            f"a compiled safepad-wrapped model is called by the uncompiled {name}, whose forward can take packed "
            f"boundaries ({', '.join(k for k in BOUNDARY_INPUTS if k in params) or '**kwargs'}) that it may not "
            f"pass down; eager safepad finds them one call up the stack, a compiled call cannot. {fix}"
        )
    return True


def _restarts(position_ids: torch.Tensor) -> bool:
    return position_ids_restart(position_ids)

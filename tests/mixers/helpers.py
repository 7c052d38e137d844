"""Shared by the mixer tests: the aten ops one mixer dispatches in a cached decode step."""

from __future__ import annotations

import copy

import torch

import safepad
from safepad.testing import tiny_model
from safepad.testing.launches import OpCounter
from safepad.testing.syncs import decode_step

__all__ = ["mixer_decode_ops"]


def _mixers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's SSM mixers (the modules with ``A_log`` and ``in_proj``), in order."""
    return [m for m in model.modules() if hasattr(m, "A_log") and hasattr(m, "in_proj")]


def _step_ops(model: torch.nn.Module, padding_side: str) -> list[int]:
    """Aten ops (views included) each SSM mixer of ``model`` dispatches in one cached decode step after a
    ``padding_side``-padded prefill (:func:`safepad.testing.syncs.decode_step`), one count per mixer."""
    step = decode_step(model, batch=4, prompt=6, padding_side=padding_side)
    cache = step.fresh_cache()
    counts: list[int] = []
    mixers = _mixers(model)
    originals = [vars(m).get("forward") for m in mixers]

    def counted(forward):
        def run(*args, **kwargs):
            with OpCounter() as c:
                out = forward(*args, **kwargs)
            counts.append(c.count)
            return out

        return run

    try:
        for m in mixers:
            m.forward = counted(m.forward)
        step(cache)
    finally:
        for m, orig in zip(mixers, originals):
            if orig is None:
                del m.forward
            else:
                m.forward = orig
    return counts


def mixer_decode_ops(family: str, dtype: torch.dtype, padding_side: str) -> tuple[list[int], list[int]]:
    """``(stock, wrapped)``: the ops of each SSM mixer's cached decode step, in the tiny ``family`` model and in its
    wrapped copy (same weights, same prefill, same token)."""
    stock = tiny_model(family, dtype=dtype)
    wrapped = safepad.wrap(copy.deepcopy(stock))
    return _step_ops(stock, padding_side), _step_ops(wrapped, padding_side)

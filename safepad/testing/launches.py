"""Count the aten ops a call dispatches, a CPU proxy for the kernels it would launch on an accelerator.

On CUDA each aten op a step dispatches costs at least one launch (a few microseconds of host time, more than a tiny
decode step's math), except views (``view``, ``slice``, ``transpose``, ... : metadata only). On CPU the same ops go
through the dispatcher, so a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees each of them:
:func:`count_ops` counts every aten op a call dispatches (views included, as the issue 38 target counts them;
``OpCount.launches`` leaves the views out). A custom op (``safepad.causal_conv``) counts once, as the one kernel it
routes to on CUDA; the ops of its CPU body are not counted.

:func:`decode_step_ops` compares one cached decode step of a stock model with the same step of its wrapped copy,
after the same padded prefill (:func:`safepad.testing.syncs.decode_step`).

Example::

    from safepad.testing.launches import count_ops, decode_step_ops

    stock, wrapped = decode_step_ops(model, safepad.wrap(copy.deepcopy(model)), padding_side="right")
    assert wrapped.count <= 1.1 * stock.count, wrapped.ops - stock.ops
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "VIEW_OPS", "OpCount", "OpCounter", "count_ops", "cuda_precision_policy", "decode_step_ops", "generate_step_ops",
]

#: aten ops (overload packet names) that only make a view or read metadata: no kernel on CUDA
VIEW_OPS: frozenset[str] = frozenset(
    {
        "aten.view", "aten._unsafe_view", "aten.reshape", "aten.slice", "aten.select", "aten.unsqueeze",
        "aten.squeeze", "aten.t", "aten.transpose", "aten.permute", "aten.expand", "aten.alias", "aten.as_strided",
        "aten.split", "aten.split_with_sizes", "aten.unbind", "aten.narrow", "aten.detach", "aten.chunk",
        "aten.diagonal", "aten.unfold", "aten.movedim", "aten.view_as_real", "aten.view_as_complex",
        "aten.lift_fresh", "aten.sym_size", "aten.sym_stride", "aten.sym_numel", "aten.sym_storage_offset",
        "aten.is_same_size", "aten.is_nonzero", "aten._reshape_alias",
    }
)


class OpCount(NamedTuple):
    """What :func:`count_ops` returns: ``result, count, ops = count_ops(fn)``."""

    #: what ``fn()`` returned
    result: Any
    #: the number of aten ops dispatched (views included)
    count: int
    #: op name (``"aten.mm"``, ``"aten._to_copy"``, ...) -> how many times it ran
    ops: Counter

    @property
    def launches(self) -> int:
        """The ops that would launch a kernel on CUDA: :attr:`count` without the views (:data:`VIEW_OPS`)."""
        return sum(n for name, n in self.ops.items() if name not in VIEW_OPS)


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: OpCounter):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
        self.owner._record(name)
        return func(*args, **(kwargs or {}))


class OpCounter:
    """Context manager counting the aten ops dispatched inside it: ``with OpCounter() as c: ...``; then ``c.count``,
    ``c.ops``. ``where=True`` also counts each op under the innermost ``safepad`` frame that called it
    (``c.where``: ``Counter`` of ``("path:line:function", op)``; ``"stock"`` for ops outside safepad), to find
    which code a step's ops come from."""

    def __init__(self, where: bool = False):
        self.ops: Counter = Counter()
        self.where: Counter = Counter()
        self._keep_where = where
        self._mode: _Dispatch | None = None

    @property
    def count(self) -> int:
        return sum(self.ops.values())

    def _record(self, name: str) -> None:
        self.ops[name] += 1
        if self._keep_where:
            site = "stock"
            for frame in reversed(traceback.extract_stack()[:-3]):
                path = frame.filename.replace("\\", "/")
                if "/safepad/" in path and "/safepad/testing/" not in path:
                    site = f"{path.split('/safepad/')[-1]}:{frame.lineno}:{frame.name}"
                    break
            self.where[site, name] += 1

    def __enter__(self) -> OpCounter:  # noqa: PYI034 (Self needs Python 3.11)
        self._mode = _Dispatch(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None


def count_ops(fn: Callable[[], Any]) -> OpCount:
    """Run ``fn()`` and count the aten ops it dispatches (forward and any backward it runs).

    Returns ``OpCount(result, count, ops)``: ``fn``'s result, the number of ops, and a ``Counter`` of them by name.
    """
    with OpCounter() as counter:
        result = fn()
    return OpCount(result, counter.count, counter.ops)


@contextmanager
def cuda_precision_policy() -> Iterator[None]:
    """Run half-precision CPU code under the precision policy it has on CUDA, so that its ops count as CUDA's.

    On CPU a bf16 / fp16 model computes two things wider than on CUDA (docs/limits.md, "Precision policy"): the SSD
    and the gated delta rule take float64 inputs (CUDA: float32 / the model dtype), and sdpa attention runs in
    float64 (CUDA: stock sdpa). Their casts are CPU-only ops, no CUDA launch. Inside this block the policy reads
    the device as CUDA (``safepad.ops.precision.device_type``) and attention is not upcast; a model wrapped or
    called inside it dispatches the ops its CUDA path would (the values then differ from the CPU policy's by
    rounding: count with it, do not compare outputs). Stock models are unaffected (they have no such policy).
    """
    from ..ops import precision
    from ..wrap import attention, hooks

    saved = (precision.device_type, attention.upcast_needed, hooks.upcast_needed)
    precision.device_type = lambda x: "cuda"
    attention.upcast_needed = hooks.upcast_needed = lambda model, inputs=None: False
    try:
        yield
    finally:
        precision.device_type, attention.upcast_needed, hooks.upcast_needed = saved


def decode_step_ops(
    stock: torch.nn.Module, wrapped: torch.nn.Module, padding_side: str = "left", batch: int = 4, prompt: int = 6
) -> tuple[OpCount, OpCount]:
    """The aten ops of one cached decode step of ``stock`` and of ``wrapped`` (a wrapped copy of it), each after
    the same prefill of ``batch`` rows padded on ``padding_side`` (:func:`safepad.testing.syncs.decode_step`).

    Only the model's step is counted (the cache copy is made before). Each model first runs the step once on a copy
    of its cache (anything done once per model, not per step, stays out of the count), then the counted step on
    another copy. Returns ``(stock's OpCount, wrapped's OpCount)``; ``result`` is the step's ``[B, 1, V]`` logits.
    """
    from .syncs import decode_step

    out = []
    for model in (stock, wrapped):
        step = decode_step(model, batch=batch, prompt=prompt, padding_side=padding_side)
        step(step.fresh_cache())  # warm: once-per-model work (a first call's setup) is not a step's cost
        cache = step.fresh_cache()
        out.append(count_ops(lambda step=step, cache=cache: step(cache)))
    return out[0], out[1]


def generate_step_ops(
    stock: torch.nn.Module, wrapped: torch.nn.Module, padding_side: str = "left", batch: int = 4, prompt: int = 6
) -> tuple[OpCount, OpCount]:
    """The aten ops of one decode step inside ``generate`` (greedy, ``use_cache=True``), of ``stock`` and of
    ``wrapped`` (a wrapped copy of it), on the same prompt of ``batch`` rows padded on ``padding_side`` (rows of
    ``prompt - b % 3`` real tokens, ``"left"`` or ``"right"``).

    One step is the difference between ``generate`` making 3 new tokens and making 2 (the prefill, generate's own
    setup and the first step cancel out); ``OpCount.result`` is None and ``ops`` the difference per op (an op
    only the longer call ran is positive). Each model generates once before (once-per-model work stays out).
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    cfg = stock.config.get_text_config() if hasattr(stock.config, "get_text_config") else stock.config
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, int(cfg.vocab_size), (batch, prompt), generator=gen)  # [B, L]
    mask = torch.ones(batch, prompt, dtype=torch.long)
    for b in range(batch):
        if b % 3:
            mask[b, : b % 3] = 0 if padding_side == "left" else 1
            if padding_side == "right":
                mask[b, -(b % 3) :] = 0
    pad = 0
    ids = ids.masked_fill(mask == 0, pad)
    out = []
    for model in (stock, wrapped):
        kwargs = dict(input_ids=ids, attention_mask=mask, do_sample=False, use_cache=True, pad_token_id=pad,
                      eos_token_id=None)
        with torch.no_grad():
            model.generate(**kwargs, max_new_tokens=2, min_new_tokens=2)  # warm
            short = count_ops(lambda model=model: model.generate(**kwargs, max_new_tokens=2, min_new_tokens=2))
            long = count_ops(lambda model=model: model.generate(**kwargs, max_new_tokens=3, min_new_tokens=3))
        ops = long.ops.copy()
        ops.subtract(short.ops)
        out.append(OpCount(None, long.count - short.count, Counter({k: v for k, v in ops.items() if v})))
    return out[0], out[1]

"""Autocast boundary for the torch core.

The ops compute in float32 (float64 stays float64) whatever the input dtype, and return outputs in the
input dtype. Under ``torch.autocast`` their internal matmuls would otherwise run in bf16/fp16 and mix
dtypes between a custom ``autograd.Function``'s forward and backward. :func:`fp32_core` turns autocast off
for the duration of an op call, as mamba-ssm's ``custom_fwd`` does for its kernels; layers around the op
(projections, norms) stay under autocast.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["fp32_core"]

F = TypeVar("F", bound=Callable)


def fp32_core(fn: F) -> F:
    """Run ``fn`` with autocast disabled on the device of its first tensor argument.

    The device is taken from the first tensor among the positional arguments, then among the keyword
    arguments, so ``ssd_scan(x=..., dt=...)`` is covered as well as ``ssd_scan(x, dt, ...)``.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        first = next(
            (a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None
        )
        if first is None or not torch.is_autocast_enabled(first.device.type):
            return fn(*args, **kwargs)
        with torch.autocast(device_type=first.device.type, enabled=False):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]

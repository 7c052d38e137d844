"""TF32 matrix products, emulated on CPU: how a stock model computes float32 on CUDA when it takes Triton kernels.

The cause of "fp32 on CUDA is off stock by 2e-4 to 3e-3 on the Mamba2 and gated-DeltaNet families" (and not on
Mamba1 or the short-conv families): transformers >= 5.24 dispatches the SSD scan (``mamba2_chunk_scan`` ->
mamba-ssm's ``mamba_chunk_scan_combined``) and the delta rule (-> FLA's ``chunk_gated_delta_rule``) per op, to the
package whenever it imports and the inputs are on CUDA (``use_kernel_func_from_hub_with_fallback``), whether or not
causal-conv1d is there. Those Triton kernels call ``tl.dot`` without ``input_precision``, and Triton's default for
float32 inputs is TF32 (a 10-bit mantissa: unit roundoff 2^-11 ~ 4.9e-4), whatever ``torch.backends`` say. The
stock reference is then TF32-rounded where safepad's torch core (and the stock torch path on CPU) is IEEE float32.
Mamba1's selective scan needs mamba-ssm's CUDA extension (absent: torch path) and the short convs have no matmul,
which is why those families agreed.

:func:`tf32_matmuls` rounds the float32 inputs of every matrix product in a block to TF32 (round to nearest, ties
away from zero, as ``cvt.rna.tf32.f32``); :func:`stock_package_ops_in_tf32` applies it to exactly the stock ops
transformers sends to those Triton kernels (a wrapped mixer runs safepad's core, IEEE on CUDA too), which reproduces
the CUDA report's sizes on CPU: ``tests/testing/test_tf32.py``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import re
import sys
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

__all__ = ["package_ops", "round_to_tf32", "stock_package_ops_in_tf32", "tf32_matmuls"]

_MATMULS = {
    torch.matmul, torch.mm, torch.bmm, torch.einsum, torch.baddbmm, torch.addmm, torch.nn.functional.linear,
    Tensor.matmul, Tensor.__matmul__, Tensor.__rmatmul__, Tensor.mm, Tensor.bmm,
}  # fmt: skip


def round_to_tf32(x: Tensor) -> Tensor:
    """``x`` (float32) with its mantissa rounded to TF32's 10 bits (round to nearest, ties away from zero); other
    dtypes and non-finite values unchanged."""
    if x.dtype != torch.float32:
        return x
    bits = x.contiguous().view(torch.int32)
    rounded = ((bits + 0x1000) & ~0x1FFF).view(torch.float32)  # +half of the 13 dropped bits, then drop them
    return torch.where(torch.isfinite(x), rounded, x)


def _round_args(obj):
    if isinstance(obj, Tensor):
        return round_to_tf32(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_round_args(o) for o in obj)
    return obj


class _TF32(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS:
            args, kwargs = _round_args(args), {k: _round_args(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


@contextlib.contextmanager
def tf32_matmuls() -> Iterator[None]:
    """Inside the block, every float32 matrix product (``matmul`` / ``mm`` / ``bmm`` / ``einsum`` / ``linear`` ...)
    takes its inputs rounded to TF32, as a Triton ``tl.dot`` or a TF32 cuBLAS call does on CUDA."""
    with _TF32():
        yield


#: package ops whose CUDA path is Triton only (no CUDA extension): what the GPU image runs. mamba-ssm's
#: ``selective_scan_fn`` / ``mamba_inner_fn`` need its CUDA extension; without it stock Mamba1 takes the torch path.
_TRITON_PACKAGES = ("mamba_ssm", "fla")
_NEEDS_EXTENSION = ("selective_scan_fn", "mamba_inner_fn")
_DISPATCHED = re.compile(
    r'@use_kernel_func_from_hub_with_fallback\(\s*"(\w+)",\s*"(\w+)"[^)]*\)\s*\n(?:@[^\n]*\n)*def (\w+)'
)


def package_ops(module_name: str) -> list[str]:
    """The functions of a transformers modeling module that dispatch to a Triton-only package op on CUDA."""
    source = inspect.getsource(sys.modules[module_name])
    return [fn for op, pkg, fn in _DISPATCHED.findall(source) if pkg in _TRITON_PACKAGES and op not in _NEEDS_EXTENSION]


@contextlib.contextmanager
def stock_package_ops_in_tf32(model: nn.Module) -> Iterator[list[str]]:
    """Inside the block, the stock ops of ``model``'s modeling modules that transformers sends to mamba-ssm / FLA on
    CUDA (:func:`package_ops`) run under :func:`tf32_matmuls`, as their Triton kernels round float32 there; the rest
    of the stock model (its ``nn.Linear`` projections: cuBLAS, IEEE by default) and safepad's core stay IEEE.
    Yields the patched ``module.function`` names."""
    modules = {type(m).__module__ for m in model.modules() if type(m).__module__.startswith("transformers.models.")}
    patched: list[tuple[object, str, object]] = []
    try:
        for name in sorted(modules):
            mod = sys.modules[name]
            for fn_name in package_ops(name):
                original = getattr(mod, fn_name)
                setattr(mod, fn_name, _in_tf32(original))
                patched.append((mod, fn_name, original))
        yield [f"{m.__name__}.{f}" for m, f, _ in patched]
    finally:
        for mod, fn_name, original in reversed(patched):
            setattr(mod, fn_name, original)


def _in_tf32(fn):
    """``fn`` under :func:`tf32_matmuls` when its floating inputs are float32, as the Triton kernel is: a float64 call
    (a float64 copy of the model) is not rounded to TF32, though the stock torch op may cast it to float32 inside."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        floats = [a.dtype for a in (*args, *kwargs.values()) if isinstance(a, Tensor) and a.is_floating_point()]
        if torch.float64 in floats:
            return fn(*args, **kwargs)
        with tf32_matmuls():
            return fn(*args, **kwargs)

    return run

"""Run the CUDA kernel routes on CPU, for tests only: Triton's interpreter plus torch stand-ins for C++.

safepad's dispatchers send a call to mamba-ssm / causal-conv1d / FLA only when the tensors are on CUDA.
:func:`install` makes those routes run on CPU tensors, so that CI executes them without a GPU:

* the Triton kernels run for real under ``TRITON_INTERPRET=1`` (set before triton is imported);
* ``torch.cuda.device(idx)`` becomes a null context when torch has no CUDA (the kernels' launch wrappers
  enter it), and ``torch.cuda.get_device_properties`` reports an H100's SM count (mamba-ssm's backward
  sizes its work split by it);
* triton's autotuner takes the first config instead of timing them (there is no driver to time with), and
  the interpreter skips its integer-overflow checks (as a GPU build without debug does; half the time);
* the compiled extensions ``causal_conv1d_cuda`` and ``selective_scan_cuda`` are replaced at their C++
  boundary by the small torch stand-ins below, built from the packages' own reference functions, so the
  packages' real Python wrappers (argument checks, layouts, limits) run unchanged;
* safepad's one device check (:func:`safepad.ops.kernels.set_kernel_device_check`) accepts CPU tensors.

Only tests and ``python -m benchmarks.gpu_check --emulate`` call this; the library never does. The stand-ins
prove the wrappers and safepad's dispatch around them, not the CUDA code itself: a GPU run
(``python -m benchmarks.gpu_check``) still has to confirm the compiled kernels.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import importlib
import logging
import os
import sys
import types

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

__all__ = ["install", "installed", "causal_conv1d_cuda_standin", "selective_scan_cuda_standin"]

_STATE: dict[str, object] = {}


# ----------------------------------------------------------------------------------------------
# causal_conv1d_cuda stand-in (csrc/causal_conv1d.cpp of causal-conv1d 1.7.0)
# ----------------------------------------------------------------------------------------------


def _conv_ref():
    from causal_conv1d.causal_conv1d_interface import causal_conv1d_ref, causal_conv1d_update_ref

    return causal_conv1d_ref, causal_conv1d_update_ref


def _conv_ref_fp32(x, weight, bias, seq_idx, initial_states, want_final, silu):
    """causal_conv1d_ref in fp32 (the CUDA kernel accumulates in fp32): ``(out [B, D, T], final | None)``."""
    ref, _ = _conv_ref()
    res = ref(
        x.float(),
        weight.float(),
        None if bias is None else bias.float(),
        initial_states=None if initial_states is None else initial_states.float(),
        return_final_states=want_final,
        activation="silu" if silu else None,
        seq_idx=seq_idx,
    )
    return res if want_final else (res, None)


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _check(cond: bool, msg: str) -> None:
    """The C++ extensions' ``TORCH_CHECK``: a ``RuntimeError`` where the compiled kernel would raise one."""
    if not cond:
        raise RuntimeError(f"(C++ check, emulated) {msg}")


def _check_conv_fwd(x, weight, bias, seq_idx, initial_states, final_states_out):
    """The argument checks of causal_conv1d.cpp ``causal_conv1d_fwd`` that a caller can trip."""
    _check(x.dtype in _FLOATS and weight.dtype in _FLOATS, "x and weight must be float32/float16/bfloat16")
    batch, dim, seqlen = x.shape
    width = weight.shape[-1]
    _check(tuple(weight.shape) == (dim, width), "weight must have shape (dim, width)")
    _check(x.stride(2) == 1 or x.stride(1) == 1, "x must be contiguous along seqlen or channels")
    channel_last = x.stride(1) == 1 and x.stride(2) > 1
    if channel_last:
        _check(dim % 8 == 0, "causal_conv1d only supports channel dimension divisible by 8 for now")
        _check(x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0, "channel last layout requires strides multiple of 8")
    _check(2 <= width <= 4, "causal_conv1d only supports width between 2 and 4")
    if bias is not None:
        _check(bias.dtype == weight.dtype and bias.stride(-1) == 1 and tuple(bias.shape) == (dim,), "bad bias")
    if seq_idx is not None:
        _check(channel_last, "seq_idx is only supported for channel last layout")
        _check(seq_idx.dtype == torch.int32 and seq_idx.is_contiguous() and tuple(seq_idx.shape) == (batch, seqlen),
               "seq_idx must be contiguous int32 (batch, seqlen)")
    for name, st in (("initial_states", initial_states), ("final_states", final_states_out)):
        if st is not None:
            _check(channel_last, f"{name} is only supported for channel last layout")
            _check(st.dtype == x.dtype and tuple(st.shape) == (batch, dim, width - 1) and st.stride(1) == 1,
                   f"{name} must be (batch, dim, width - 1) in x's dtype with stride(1) == 1")


def _vjp(fn, inputs: list, grads_out: list) -> list:
    """Gradients of ``fn(*inputs)`` (a list of outputs) w.r.t. the tensor inputs (``None`` stays ``None``).

    The packages call the C++ backward from inside a ``torch.library.custom_op`` (causal-conv1d), which
    runs below the autograd dispatch key, where no graph is recorded even under ``enable_grad``; the
    reference's autograd therefore runs in a helper thread, whose dispatch state is fresh.
    """

    def run():
        leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
        with torch.enable_grad():
            outs = fn(*leaves)
            wanted = [t for t in leaves if t is not None]
            grads = torch.autograd.grad(outs, wanted, grads_out, allow_unused=True)
        it = iter(grads)
        res = []
        for t in leaves:
            if t is None:
                res.append(None)
            else:
                gr = next(it)
                res.append(torch.zeros_like(t) if gr is None else gr.to(t.dtype))
        return res

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run).result()


def causal_conv1d_fwd(x, weight, bias, seq_idx, initial_states, out, final_states_out, silu_activation):
    """Stands in for C++ ``causal_conv1d_cuda.causal_conv1d_fwd``: writes ``out`` (and ``final_states_out``)."""
    _check_conv_fwd(x, weight, bias, seq_idx, initial_states, final_states_out)
    y, final = _conv_ref_fp32(x, weight, bias, seq_idx, initial_states, final_states_out is not None, silu_activation)
    out.copy_(y)
    if final_states_out is not None:
        final_states_out.copy_(final)


def causal_conv1d_bwd(
    x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx, dweight, dbias, dinitial_states, silu_activation
):
    """Stands in for C++ ``causal_conv1d_cuda.causal_conv1d_bwd``: autograd through the reference, into the outs."""
    _check_conv_fwd(x, weight, bias, seq_idx, initial_states, None)
    def fwd(x_, w_, b_, init_):
        y, final = _conv_ref_fp32(x_, w_, b_, seq_idx, init_, dfinal_states is not None, silu_activation)
        return [y] if final is None else [y, final]

    grads_in = [dout.float()] + ([] if dfinal_states is None else [dfinal_states.float()])
    gx, gw, gb, ginit = _vjp(fwd, [x, weight, bias, initial_states], grads_in)
    dx.copy_(gx)
    dweight.add_(gw)
    if dbias is not None:
        dbias.add_(gb)
    if dinitial_states is not None:
        dinitial_states.copy_(ginit)


def causal_conv1d_update(x, conv_state, weight, bias, out, silu_activation, cache_seqlens, conv_state_indices):
    """Stands in for C++ ``causal_conv1d_cuda.causal_conv1d_update``: writes ``out``, updates ``conv_state``."""
    width = weight.shape[-1]
    _check(x.dtype in _FLOATS and weight.dtype in _FLOATS, "x and weight must be float32/float16/bfloat16")
    _check(conv_state.dtype == x.dtype, "conv_state must have x's dtype")
    _check(2 <= width <= 4, "causal_conv1d only supports width between 2 and 4")
    _check(conv_state.shape[-1] >= width - 1, "conv_state must hold at least width - 1 columns")
    _, ref = _conv_ref()
    state = conv_state if conv_state_indices is None else conv_state.index_select(0, conv_state_indices.long())
    work = state.float()
    y = ref(
        x.float(), work, weight.float(), None if bias is None else bias.float(),
        activation="silu" if silu_activation else None, cache_seqlens=cache_seqlens,
    )
    out.copy_(y)
    if conv_state_indices is None:
        conv_state.copy_(work)
    else:
        conv_state.index_copy_(0, conv_state_indices.long(), work.to(conv_state.dtype))


def causal_conv1d_cuda_standin() -> types.ModuleType:
    """A module object with the three entry points of ``causal_conv1d_cuda``."""
    mod = types.ModuleType("causal_conv1d_cuda", "safepad torch stand-in for causal-conv1d's C++ extension")
    mod.causal_conv1d_fwd = causal_conv1d_fwd
    mod.causal_conv1d_bwd = causal_conv1d_bwd
    mod.causal_conv1d_update = causal_conv1d_update
    mod.__safepad_standin__ = True
    return mod


# ----------------------------------------------------------------------------------------------
# selective_scan_cuda stand-in (csrc/selective_scan/selective_scan.cpp of mamba-ssm 2.3.2.post1)
# ----------------------------------------------------------------------------------------------


def _scan_ref(u, delta, A, B, C, D, delta_bias, delta_softplus):
    from mamba_ssm.ops.selective_scan_interface import selective_scan_ref

    return selective_scan_ref(u, delta, A, B, C, D=D, delta_bias=delta_bias, delta_softplus=delta_softplus,
                              return_last_state=True)


def _check_scan(u, delta, A, B, C, D, z, delta_bias):
    """The argument checks of selective_scan.cpp ``selective_scan_fwd`` / ``_bwd`` that a caller can trip."""
    _check(u.dtype in _FLOATS and A.dtype == torch.float32, "u must be float32/float16/bfloat16 and A float32")
    _check(delta.dtype == u.dtype, "delta must have u's dtype")
    _check(B.dim() < 3 or B.dtype == u.dtype, "a variable B must have u's dtype")
    _check(C.dim() < 3 or C.dtype == u.dtype, "a variable C must have u's dtype")
    _check(u.stride(-1) == 1 or u.shape[-1] == 1, "u must be contiguous along seqlen")
    _check(delta.stride(-1) == 1 or delta.shape[-1] == 1, "delta must be contiguous along seqlen")
    _check(A.shape[1] <= 256, "selective_scan only supports state dimension <= 256")
    for name, t in (("D", D), ("delta_bias", delta_bias)):
        ok = t is None or (t.dtype == torch.float32 and tuple(t.shape) == (u.shape[1],))
        _check(ok, f"{name} must be float32 (dim,)")
    _check(z is None or (z.dtype == u.dtype and z.shape == u.shape), "z must have u's shape and dtype")


def selective_scan_fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus):
    """Stands in for C++ ``selective_scan_cuda.fwd``: ``[out, x]`` (+ ``out_z`` with ``z``).

    ``x`` is the kernel's chunk-state buffer ``[B, Dm, n_chunks, 2N]``; the wrapper reads only the last
    state from ``x[:, :, -1, 1::2]``, which is all that is filled here.
    """
    _check_scan(u, delta, A, B, C, D, z, delta_bias)
    out, last = _scan_ref(u, delta, A, B, C, D, delta_bias, delta_softplus)
    x = last.new_zeros(*last.shape[:2], 1, 2 * last.shape[2])  # [B, Dm, 1, 2N]
    x[:, :, 0, 1::2] = last
    res = [out, x]
    if z is not None:
        res.append((out.float() * F.silu(z.float())).to(out.dtype))
    return res


def selective_scan_bwd(u, delta, A, B, C, D, z, delta_bias, dout, x, out, dz, delta_softplus, recompute_out_z):
    """Stands in for C++ ``selective_scan_cuda.bwd``: ``[du, ddelta, dA, dB, dC, dD, ddelta_bias]`` (+ ``dz``)."""
    _check_scan(u, delta, A, B, C, D, z, delta_bias)
    def fwd(u_, d_, A_, B_, C_, D_, z_, bias_):
        y, _ = _scan_ref(u_, d_, A_, B_, C_, D_, bias_, delta_softplus)
        return [y if z_ is None else y.float() * F.silu(z_.float())]

    du, ddelta, dA, dB, dC, dD, dzz, dbias = _vjp(fwd, [u, delta, A, B, C, D, z, delta_bias], [dout])
    outs = [du, ddelta, dA, dB, dC, dD, dbias]
    if z is not None:
        outs.append(dzz)
    return outs


def selective_scan_cuda_standin() -> types.ModuleType:
    """A module object with the two entry points of ``selective_scan_cuda``."""
    mod = types.ModuleType("selective_scan_cuda", "safepad torch stand-in for mamba-ssm's C++ selective scan")
    mod.fwd = selective_scan_fwd
    mod.bwd = selective_scan_bwd
    mod.__safepad_standin__ = True
    return mod


# ----------------------------------------------------------------------------------------------
# install
# ----------------------------------------------------------------------------------------------


class _NullCudaDevice(contextlib.nullcontext):
    """``torch.cuda.device(idx)`` on a torch without CUDA: the kernels' launch wrappers enter it."""

    def __init__(self, device=None):
        super().__init__()
        self.idx = device


def _emulated_device_properties(device=None) -> types.SimpleNamespace:
    """``torch.cuda.get_device_properties`` without CUDA: mamba-ssm's backward sizes its splits by the SM
    count; an H100's 132 SMs are reported."""
    return types.SimpleNamespace(name="safepad kernel emulation", multi_processor_count=132, major=9, minor=0)


def installed() -> bool:
    return bool(_STATE.get("installed"))


def install() -> dict[str, bool]:
    """Make the kernel routes run on CPU (idempotent). Returns ``safepad.ops.kernels.kernels_available()``.

    Call it before anything imports triton (``TRITON_INTERPRET`` is read when the kernels are defined);
    :mod:`safepad` itself may already be imported: its kernel imports are redone here.
    """
    from safepad.ops import kernels

    if installed():
        return kernels.kernels_available()
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("kernel emulation needs TRITON_INTERPRET=1 before triton is imported")
    os.environ["TRITON_INTERPRET"] = "1"
    standins = {"causal_conv1d_cuda": causal_conv1d_cuda_standin, "selective_scan_cuda": selective_scan_cuda_standin}
    for name, make in standins.items():
        if name not in sys.modules:
            try:
                importlib.import_module(name)  # a real build wins (never on a CPU-only machine)
            except ImportError:
                sys.modules[name] = make()
        # a module imported before, without the extension (safepad.ops.kernels lets mamba-ssm's Triton kernels
        # import that way), holds safepad's missing-extension stub under this name: it gets the stand-in too
        for key, mod in list(sys.modules.items()):
            if key.startswith(("mamba_ssm.", "causal_conv1d.")) and getattr(
                mod.__dict__.get(name) if mod is not None else None, "__safepad_missing__", False
            ):
                setattr(mod, name, sys.modules[name])
    if not torch.cuda.is_available():
        torch.cuda.device = _NullCudaDevice
        torch.cuda.get_device_properties = _emulated_device_properties
    try:
        from triton.runtime.autotuner import Autotuner
    except Exception:  # noqa: BLE001 - no triton: nothing Triton-based will import either
        Autotuner = None
    if Autotuner is not None:
        _prune = Autotuner.prune_configs

        def first_config(self, kwargs):  # one config left: the autotuner launches it without timing
            return _prune(self, kwargs)[:1]

        Autotuner.prune_configs = first_config
    try:  # the interpreter checks every integer op for overflow (a GPU build does so only in debug mode): ~2x slower
        from triton.runtime import interpreter as _interp

        builder = _interp.interpreter_builder  # one module-level builder runs every interpreted kernel
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    except Exception:  # noqa: BLE001
        pass
    kernels.reload_kernels()
    kernels.set_kernel_device_check(lambda t: t.device.type in ("cpu", "cuda"))
    _STATE["installed"] = True
    avail = kernels.kernels_available()
    logger.info("kernel emulation installed: %s", avail)
    return avail

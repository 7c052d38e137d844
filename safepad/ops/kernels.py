"""Optional CUDA kernels: one try-import per package, a ``None`` marker, one availability check.

safepad's torch core runs everywhere. When the tensors are on CUDA and these packages import, the
dispatchers in ``safepad.ops`` use them for the calls they can express exactly; every other call goes
to the torch core (same result) or raises. Nothing here changes a result silently.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import sys
import types
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "mamba_chunk_scan_combined",
    "mamba_split_conv1d_scan_combined",
    "selective_state_update",
    "selective_scan_fn",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "causal_conv1d_varlen_states",
    "fla_causal_conv1d",
    "fla_causal_conv1d_update",
    "fla_chunk_gated_delta_rule",
    "fla_fused_recurrent_gated_delta_rule",
    "kernels_available",
    "on_kernel_device",
    "reload_kernels",
    "set_kernel_device_check",
    "state_update",
    "use_kernels",
]

mamba_chunk_scan_combined = None
mamba_split_conv1d_scan_combined = None
selective_state_update = None
selective_scan_fn = None
causal_conv1d_fn = None
causal_conv1d_update = None
causal_conv1d_varlen_states = None
fla_causal_conv1d = None
fla_causal_conv1d_update = None
fla_chunk_gated_delta_rule = None
fla_fused_recurrent_gated_delta_rule = None

# module.attribute to import for each marker; any import failure means "not available"
_SOURCES = {
    "mamba_chunk_scan_combined": ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"),
    "mamba_split_conv1d_scan_combined": ("mamba_ssm.ops.triton.ssd_combined", "mamba_split_conv1d_scan_combined"),
    "selective_state_update": ("mamba_ssm.ops.triton.selective_state_update", "selective_state_update"),
    "selective_scan_fn": ("mamba_ssm.ops.selective_scan_interface", "selective_scan_fn"),
    "causal_conv1d_fn": ("causal_conv1d", "causal_conv1d_fn"),
    "causal_conv1d_update": ("causal_conv1d", "causal_conv1d_update"),
    "causal_conv1d_varlen_states": ("causal_conv1d.causal_conv1d_varlen", "causal_conv1d_varlen_states"),
    # FLA's Triton causal conv (flash-linear-attention 0.6.0's module path): the conv route when causal-conv1d is
    # not installed (safepad.ops.conv)
    "fla_causal_conv1d": ("fla.modules.causal_conv1d", "causal_conv1d"),
    "fla_causal_conv1d_update": ("fla.modules.causal_conv1d", "causal_conv1d_update"),
    "fla_chunk_gated_delta_rule": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    "fla_fused_recurrent_gated_delta_rule": ("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule"),
}
_KERNELS: dict[str, object] = {}


@contextlib.contextmanager
def _keep_transformers_model_types():
    """Undo what an import registers in transformers' ``AutoConfig`` over a model type transformers ships.

    Importing any ``fla.*`` module runs ``fla/__init__``, which (flash-linear-attention 0.6.0) registers
    FLA's own ``mamba`` / ``mamba2`` / ``bitnet`` configs with ``exist_ok=True``: from then on
    ``AutoModelForCausalLM.from_config`` / ``from_pretrained`` build FLA's models for those checkpoints,
    whose mixers are not transformers' (and not wrappable). safepad only wants FLA's ops, so such a
    shadowing registration is removed again; FLA's registrations of new model types are kept.
    """
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

        extra = CONFIG_MAPPING._extra_content
        before = dict(extra)
    except Exception:  # noqa: BLE001 - no transformers (or another layout): nothing to protect
        yield
        return
    try:
        yield
    finally:
        for key in [k for k in extra if k in CONFIG_MAPPING_NAMES and before.get(k) is not extra[k]]:
            if key in before:
                extra[key] = before[key]
            else:
                del extra[key]
            logger.debug("kept transformers' model type %r (an optional kernel import had registered its own)", key)


#: the compiled extension each marker calls; a marker whose extension is :func:`_missing_extension`'s stub is None
_EXTENSIONS = {"selective_scan_fn": "selective_scan_cuda"}


def _missing_extension(name: str) -> types.ModuleType:
    """A stand-in for a compiled extension that is not installed: every attribute raises ``ImportError``."""

    class _Missing(types.ModuleType):
        __safepad_missing__ = True

        def __getattr__(self, attr: str):
            if attr.startswith("__"):
                raise AttributeError(attr)
            raise ImportError(f"{name} (mamba-ssm's CUDA extension) is not installed: {name}.{attr} is unavailable")

    return _Missing(name, f"safepad: {name} is not installed")


@contextlib.contextmanager
def _triton_only_mamba_ssm():
    """Let mamba-ssm import without its CUDA extension, for its Triton kernels.

    ``mamba_ssm/__init__`` (2.3.2.post1) imports ``selective_scan_interface``, which imports the compiled
    ``selective_scan_cuda`` unguarded: a mamba-ssm built without CUDA (``MAMBA_SKIP_CUDA_BUILD``; the Triton-only
    default of later releases) does not import at all, although its Triton SSD kernels need nothing compiled.
    While an import runs here, a missing ``selective_scan_cuda`` is a module whose attributes raise
    ``ImportError``; it is removed from ``sys.modules`` afterwards, and the marker that calls it
    (``selective_scan_fn``) stays ``None``.
    """
    name = "selective_scan_cuda"
    added = False
    if name not in sys.modules and importlib.util.find_spec("mamba_ssm") is not None:
        try:
            importlib.import_module(name)
        except ImportError:
            sys.modules[name] = _missing_extension(name)
            added = True
    try:
        yield
    finally:
        if added and getattr(sys.modules.get(name), "__safepad_missing__", False):
            del sys.modules[name]


def _extension_missing(marker: str, fn: object) -> bool:
    """True when ``fn`` (the kernel of ``marker``) calls an extension that is only :func:`_missing_extension`."""
    ext = _EXTENSIONS.get(marker)
    if ext is None or fn is None:
        return False
    module = sys.modules.get(getattr(fn, "__module__", ""), None)
    return bool(getattr(getattr(module, ext, None), "__safepad_missing__", False))


def reload_kernels() -> dict[str, bool]:
    """(Re)do the try-imports and set each marker to the kernel or ``None``; returns :func:`kernels_available`.

    Runs once at import. Called again only by test support that installs stand-ins for the compiled
    extensions (``safepad.testing.kernel_emulation``). mamba-ssm's Triton kernels import without its CUDA
    extension (:func:`_triton_only_mamba_ssm`).
    """
    g = globals()
    for name, (module, attr) in _SOURCES.items():
        try:
            with _keep_transformers_model_types(), _triton_only_mamba_ssm():
                fn = getattr(importlib.import_module(module), attr)
        except Exception as e:  # noqa: BLE001 - any import failure means "not available"
            logger.debug("kernel %s not available: %s", name, e)
            fn = None
        if _extension_missing(name, fn):
            logger.debug("kernel %s not available: %s is not installed", name, _EXTENSIONS[name])
            fn = None
        g[name] = fn
        _KERNELS[name] = fn
    return kernels_available()


def _on_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda


_device_check: Callable[[torch.Tensor], bool] = _on_cuda


def set_kernel_device_check(check: Callable[[torch.Tensor], bool] | None) -> Callable[[torch.Tensor], bool]:
    """Replace the one device test of :func:`use_kernels` (default: ``tensor.is_cuda``); returns the previous one.

    A test seam: the CPU kernel tier (``safepad.testing.kernel_emulation``) runs the kernel routes on CPU
    tensors through it. ``None`` restores the default.
    """
    global _device_check
    prev = _device_check
    _device_check = _on_cuda if check is None else check
    return prev


def on_kernel_device(t: torch.Tensor) -> bool:
    """True when ``t`` is on a device the kernels run on (CUDA, unless a test replaced the check)."""
    return _device_check(t)


def kernels_available() -> dict[str, bool]:
    """Which optional kernels imported, by name."""
    return {name: fn is not None for name, fn in _KERNELS.items()}


def use_kernels(*tensors: torch.Tensor, need: tuple[str, ...] = (), backend: str = "auto") -> bool:
    """The one availability check: should this call go to the CUDA kernels?

    ``backend``: ``"auto"`` uses kernels when every tensor is on CUDA and every kernel in ``need``
    imported; ``"torch"`` never does; ``"kernels"`` requires them and raises ``ValueError`` if they
    cannot be used. ``SAFEPAD_BACKEND=torch`` in the environment forces the torch core.
    """
    if backend not in ("auto", "torch", "kernels"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'kernels', got {backend!r}")
    if backend == "auto" and os.environ.get("SAFEPAD_BACKEND", "").lower() == "torch":
        return False
    if backend == "torch":
        return False
    on_cuda = all(_device_check(t) for t in tensors if t is not None)
    missing = [n for n in need if _KERNELS.get(n) is None]
    ok = on_cuda and not missing
    if backend == "kernels" and not ok:
        why = "tensors are not on CUDA" if not on_cuda else f"missing kernels: {', '.join(missing)}"
        raise ValueError(
            f"backend='kernels' was requested but {why}; install safepad[cuda] on a CUDA machine or use backend='auto'"
        )
    return ok


def state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
) -> torch.Tensor:
    """mamba-ssm ``selective_state_update`` with dt ALREADY processed (no bias, no softplus); updates ``state``.

    Shapes as the kernel's (``state [B, H, P, N]`` or ``[B, Dm, N]``, ``dt`` like ``x``, ``A`` like one
    state row, ``D`` like ``x[0]``). The released wrapper (mamba-ssm 2.3.2.post1) dereferences
    ``dt_bias.stride(...)`` and ``D.stride(...)`` unconditionally (``AttributeError`` / ``TypeError``
    for ``None``), so a zero ``dt_bias`` and a zero ``D`` are passed instead of ``None``; both are
    broadcast views (stride 0 over the last dim where ``dt`` is), which keeps the kernel's head-tied fast
    path (``TIE_HDIM``: A and dt tied over ``P`` and ``N``) when ``A`` and ``dt`` are tied.
    """
    like = x[0]  # [H, P] or [Dm]
    tied = dt.stride(-1) == 0
    zeros = x.new_zeros(like.shape[:-1] + (1,), dtype=torch.float32).expand(like.shape)  # [H, P] / [Dm], stride 0
    dt_bias = zeros if tied else x.new_zeros(like.shape, dtype=torch.float32)
    D_k = zeros if D is None else D
    return selective_state_update(state, x, dt, A, B, C, D=D_k, z=z, dt_bias=dt_bias, dt_softplus=False)


reload_kernels()

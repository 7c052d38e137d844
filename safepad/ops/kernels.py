"""Optional CUDA kernels: one try-import per package, a ``None`` marker, one availability check.

safepad's torch core runs everywhere. When the tensors are on CUDA and these packages import, the
dispatchers in ``safepad.ops`` use them for the calls they can express exactly; every other call goes
to the torch core (same result) or raises. Nothing here changes a result silently.
"""

from __future__ import annotations

import logging
import os

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
    "fla_chunk_gated_delta_rule",
    "fla_fused_recurrent_gated_delta_rule",
    "kernels_available",
    "use_kernels",
]

try:  # mamba-ssm (CUDA only)
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined, mamba_split_conv1d_scan_combined
except Exception:  # noqa: BLE001 - any import failure means "not available"
    mamba_chunk_scan_combined = None
    mamba_split_conv1d_scan_combined = None
try:
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update
except Exception:  # noqa: BLE001
    selective_state_update = None
try:
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
except Exception:  # noqa: BLE001
    selective_scan_fn = None

try:  # causal-conv1d (CUDA only)
    from causal_conv1d import causal_conv1d_fn, causal_conv1d_update
except Exception:  # noqa: BLE001
    causal_conv1d_fn = None
    causal_conv1d_update = None
try:
    from causal_conv1d.causal_conv1d_varlen import causal_conv1d_varlen_states
except Exception:  # noqa: BLE001
    causal_conv1d_varlen_states = None

try:  # flash-linear-attention (triton)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_fused_recurrent_gated_delta_rule
except Exception:  # noqa: BLE001
    fla_chunk_gated_delta_rule = None
    fla_fused_recurrent_gated_delta_rule = None

_KERNELS = {
    "mamba_chunk_scan_combined": mamba_chunk_scan_combined,
    "mamba_split_conv1d_scan_combined": mamba_split_conv1d_scan_combined,
    "selective_state_update": selective_state_update,
    "selective_scan_fn": selective_scan_fn,
    "causal_conv1d_fn": causal_conv1d_fn,
    "causal_conv1d_update": causal_conv1d_update,
    "causal_conv1d_varlen_states": causal_conv1d_varlen_states,
    "fla_chunk_gated_delta_rule": fla_chunk_gated_delta_rule,
    "fla_fused_recurrent_gated_delta_rule": fla_fused_recurrent_gated_delta_rule,
}


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
    on_cuda = all(t.is_cuda for t in tensors if t is not None)
    missing = [n for n in need if _KERNELS.get(n) is None]
    ok = on_cuda and not missing
    if backend == "kernels" and not ok:
        why = "tensors are not on CUDA" if not on_cuda else f"missing kernels: {', '.join(missing)}"
        raise ValueError(
            f"backend='kernels' was requested but {why}; install safepad[cuda] on a CUDA machine or use backend='auto'"
        )
    return ok

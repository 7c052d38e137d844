"""The Mamba2 dt pipeline, shared by every scan and every decode step.

``dt`` (raw, from the input projection) -> ``dt + dt_bias`` -> ``softplus`` -> ``clamp(lo, hi)``.
Stock transformers applies the clamp in the chunked scan but not in the single-token update; using
this one function on both paths is what makes decode-after-prefix equal the full scan.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["process_dt", "validate_dt_limit", "widens_into"]


_WIDENS_INTO: dict[torch.dtype, frozenset[torch.dtype]] = {
    torch.float32: frozenset({torch.float16, torch.bfloat16, torch.float32}),
    torch.float64: frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
}


def widens_into(ct: torch.dtype) -> frozenset[torch.dtype]:
    """The float dtypes that type promotion against ``ct`` (float32 or float64) turns into ``ct`` exactly: an
    elementwise op computing in ``ct`` may read them as they are, without a ``.to(ct)`` copy first (a host-side
    lookup: ``torch.promote_types`` would be a dispatched op)."""
    return _WIDENS_INTO.get(ct, frozenset({ct}))


def validate_dt_limit(dt_limit: tuple[float, float], name: str = "dt_limit") -> tuple[float, float]:
    """Check ``dt_limit = (lo, hi)`` with ``lo <= hi`` and return it as floats."""
    try:
        lo, hi = (float(v) for v in dt_limit)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a pair (lower, upper) of floats, got {dt_limit!r}") from None
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
        raise ValueError(f"{name} must satisfy lower <= upper (no NaN), got {dt_limit!r}")
    return lo, hi


def process_dt(
    dt: Tensor,
    dt_bias: Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    dt_softplus: bool = True,
) -> Tensor:
    """Apply the dt pipeline in float32 (float64 stays float64).

    Args:
        dt: raw step sizes ``[..., H]``.
        dt_bias: ``[H]`` or ``None``; added before the softplus.
        dt_limit: ``(lo, hi)``; only the non-trivial bounds are applied (``lo > 0`` or, without
            softplus, any finite ``lo``; any finite ``hi``). ``(0, inf)`` is a no-op after softplus.
        dt_softplus: apply ``softplus`` after the bias.

    Returns:
        processed ``dt`` ``[..., H]`` in float32 (float64 when ``dt`` is float64).
    """
    if not isinstance(dt, Tensor) or dt.dim() < 1:
        raise ValueError(f"dt must be a tensor of shape [..., H], got {getattr(dt, 'shape', type(dt).__name__)}")
    lo, hi = validate_dt_limit(dt_limit)
    out = dt.to(torch.float64 if dt.dtype == torch.float64 else torch.float32)
    if dt_bias is not None:
        if dt_bias.shape != (dt.shape[-1],):
            raise ValueError(f"dt_bias must have shape [H] = [{dt.shape[-1]}], got {tuple(dt_bias.shape)}")
        # a narrower bias (bf16 parameters) is widened exactly inside the add: the same sum without a cast's copy
        out = out + (dt_bias if dt_bias.dtype in widens_into(out.dtype) else dt_bias.to(out.dtype))
    if dt_softplus:
        out = F.softplus(out)
    apply_lo = math.isfinite(lo) and (lo > 0.0 or not dt_softplus)
    apply_hi = math.isfinite(hi)
    if apply_lo or apply_hi:
        out = out.clamp(min=lo if apply_lo else None, max=hi if apply_hi else None)
    return out

"""Test utilities shipped with safepad: tiny in-memory models and the stock-vs-wrapped scenario engine."""

from __future__ import annotations

from .scenarios import (
    PACKED_LENGTHS,
    AUDIT_SCENARIOS,
    NO_POSITION_SCENARIOS,
    SCENARIOS,
    AuditReport,
    ScenarioResult,
    audit,
    cache_states,
    default_tol,
    packed_loss_grad_errors,
    pad_sweep,
    run_matrix,
    run_scenario,
)
from .tiny import (
    CACHE_PARAMS_FAMILIES,
    EXTRA_FAMILIES,
    FAMILIES,
    GDN_FAMILIES,
    MAMBA1_FAMILIES,
    MAMBA2_FAMILIES,
    find_mixers,
    strengthen_mixers,
    tiny_config,
    tiny_model,
)

__all__ = [
    "CACHE_PARAMS_FAMILIES",
    "EXTRA_FAMILIES",
    "FAMILIES",
    "GDN_FAMILIES",
    "MAMBA1_FAMILIES",
    "MAMBA2_FAMILIES",
    "PACKED_LENGTHS",
    "AUDIT_SCENARIOS",
    "NO_POSITION_SCENARIOS",
    "SCENARIOS",
    "AuditReport",
    "ScenarioResult",
    "audit",
    "cache_states",
    "default_tol",
    "find_mixers",
    "packed_loss_grad_errors",
    "pad_sweep",
    "run_matrix",
    "run_scenario",
    "strengthen_mixers",
    "tiny_config",
    "tiny_model",
]

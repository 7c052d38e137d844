"""Ops: the torch core (varlen conv, dt pipeline, chunked scans) with optional CUDA kernel dispatch."""

from __future__ import annotations

from .conv import causal_conv1d, causal_conv1d_step, conv_states_from_inputs
from .delta_rule import chunk_gated_delta_rule, gated_delta_rule_step, l2norm
from .dt import process_dt, validate_dt_limit
from .norm import gated_rms_norm
from .selective_scan import selective_scan, selective_state_step
from .ssd import ssd_scan, ssd_step

__all__ = [
    "causal_conv1d",
    "causal_conv1d_step",
    "chunk_gated_delta_rule",
    "conv_states_from_inputs",
    "gated_delta_rule_step",
    "gated_rms_norm",
    "l2norm",
    "process_dt",
    "selective_scan",
    "selective_state_step",
    "ssd_scan",
    "ssd_step",
    "validate_dt_limit",
]

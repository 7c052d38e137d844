"""Ops: the torch core (varlen conv, dt pipeline, chunked scans) with optional CUDA kernel dispatch."""

from __future__ import annotations

from .conv import causal_conv1d, causal_conv1d_step, conv_states_from_inputs
from .dt import process_dt, validate_dt_limit
from .ssd import ssd_scan, ssd_step

__all__ = [
    "causal_conv1d",
    "causal_conv1d_step",
    "conv_states_from_inputs",
    "process_dt",
    "ssd_scan",
    "ssd_step",
    "validate_dt_limit",
]

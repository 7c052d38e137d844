"""Layout conversions: sequence boundaries and padding masks (the bottom layer of safepad)."""

from .boundaries import (
    cu_seqlens_from_seq_idx,
    packing_positions,
    position_ids_restart,
    seq_idx_from_cu_seqlens,
    seq_idx_from_position_ids,
    sequence_ids,
    validate_cu_seqlens,
    validate_seq_idx,
)

__all__ = [
    "cu_seqlens_from_seq_idx",
    "packing_positions",
    "position_ids_restart",
    "seq_idx_from_cu_seqlens",
    "seq_idx_from_position_ids",
    "sequence_ids",
    "validate_cu_seqlens",
    "validate_seq_idx",
]

"""Packing collators and dataset packing for SSM / hybrid models (re-exported by ``safepad``).

* :class:`DataCollatorForPackedSSM` — a batch of features -> one ``[1, T]`` packed row with
  ``seq_idx``, ``position_ids``, ``cu_seq_lens_q/k`` and ``max_length_q/k``.
* :func:`pack_dataset` — best-fit-decreasing (or wrapped) packing of a ``datasets`` dataset into rows
  of at most ``max_length`` tokens carrying ``seq_lengths``; :class:`PackingStats` / :func:`packing_stats`.
"""

from __future__ import annotations

from .flatten import PER_TOKEN_KEYS, CollatorStats, DataCollatorForPackedSSM
from .packing import PackingStats, bfd_assign, pack_dataset, packing_stats

__all__ = [
    "PER_TOKEN_KEYS",
    "CollatorStats",
    "DataCollatorForPackedSSM",
    "PackingStats",
    "bfd_assign",
    "pack_dataset",
    "packing_stats",
]

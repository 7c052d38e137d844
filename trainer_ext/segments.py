"""Where the sequences of a training batch are: the boundaries the shadow check compares against.

A batch reaching ``model(**batch)`` can describe its sequences several ways at once: ``seq_idx`` ``[B, T]``,
``cu_seq_lens_q`` ``[S + 1]`` over the flattened ``[B * T]`` row, ``position_ids`` ``[B, T]`` restarting at 0,
and an ``attention_mask`` ``[B, T]`` marking pads. A collator may also have been told the boundaries (the
``seq_lengths`` / ``position_ids`` of each feature) and failed to pass them on. :func:`sequence_starts` takes
the UNION of every boundary any of these declares (a boundary anyone declared is a real one), so a model or a
collator that drops one of them is caught by the shadow check rather than trusted.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

__all__ = ["Segment", "feature_starts", "segments", "sequence_starts"]


@dataclass(frozen=True)
class Segment:
    """One sequence of a batch: tokens ``[start, end)`` of row ``row``; ``index`` counts sequences in the row."""

    row: int
    start: int
    end: int
    index: int

    @property
    def length(self) -> int:
        return self.end - self.start

    def describe(self) -> str:
        return f"sequence {self.index} of row {self.row} (tokens {self.start}..{self.end - 1}, length {self.length})"


def sequence_starts(batch: Mapping[str, Any], shape: tuple[int, int], extra: Tensor | None = None) -> Tensor:
    """``[B, T]`` bool: True where a sequence starts, from every boundary encoding in ``batch`` (and ``extra``).

    Args:
        batch: the forward's keyword arguments (``seq_idx``, ``cu_seq_lens_q``, ``position_ids`` are read).
        shape: ``[B, T]`` of ``input_ids``.
        extra: ``[B, T]`` bool starts known from elsewhere (the collator's features), or None.
    """
    B, T = shape
    starts = torch.zeros(B, T, dtype=torch.bool)
    starts[:, 0] = True
    seq_idx = batch.get("seq_idx")
    if isinstance(seq_idx, Tensor) and tuple(seq_idx.shape) == (B, T) and T > 1:
        s = seq_idx.detach().cpu()
        starts[:, 1:] |= s[:, 1:] != s[:, :-1]
    cu = batch.get("cu_seq_lens_q")
    if isinstance(cu, Tensor) and cu.dim() == 1 and cu.numel() >= 2 and int(cu[-1]) == B * T:
        flat = starts.view(-1)
        begins = cu[:-1].detach().cpu().long()
        flat[begins[begins < B * T]] = True
    pos = batch.get("position_ids")
    if isinstance(pos, Tensor) and tuple(pos.shape) == (B, T) and "attention_mask" not in _present(batch):
        starts |= pos.detach().cpu() == 0  # 2-D positions restarting at 0, no padding mask: packing
    if extra is not None and tuple(extra.shape) == (B, T):
        starts |= extra
    return starts


def _present(batch: Mapping[str, Any]) -> set[str]:
    return {k for k, v in batch.items() if v is not None}


def segments(starts: Tensor, mask: Tensor | None = None) -> list[Segment]:
    """The sequences of ``starts`` ``[B, T]`` bool, each trimmed to its real tokens under ``mask`` ``[B, T]``.

    A sequence whose real tokens are not contiguous (holes in the mask) is left out: it has no alone run to
    compare with.
    """
    B, T = starts.shape
    m = None if mask is None else mask.detach().cpu().bool()
    out: list[Segment] = []
    for r in range(B):
        begins = starts[r].nonzero().flatten().tolist() + [T]
        for i, (a, b) in enumerate(itertools.pairwise(begins)):
            if m is not None:
                real = m[r, a:b].nonzero().flatten()
                if real.numel() == 0:
                    continue
                lo, hi = a + int(real[0]), a + int(real[-1]) + 1
                if hi - lo != real.numel():
                    continue
                a, b = lo, hi
            out.append(Segment(r, a, b, i))
    return out


def _feature_lengths(feature: Mapping[str, Any]) -> tuple[int, list[int]] | None:
    """(tokens of one collator feature, offsets inside it where a sequence starts), or None when unreadable."""
    ids = feature.get("input_ids")
    if ids is None:
        return None
    n = len(ids)
    begins = {0}
    lengths = feature.get("seq_lengths")
    if lengths is not None:
        acc = 0
        for length in list(lengths)[:-1]:
            acc += int(length)
            begins.add(acc)
    pos = feature.get("position_ids")
    if pos is not None:
        p = torch.as_tensor(pos).flatten()
        if p.numel() == n:
            begins |= set((p == 0).nonzero().flatten().tolist())
    return n, sorted(b for b in begins if 0 <= b < n)


def feature_starts(features: Sequence[Any], collated: Mapping[str, Any]) -> Tensor | None:
    """``[B, T]`` bool starts of the sequences the collator was GIVEN, placed in its output, or None.

    Two layouts are recognised: every feature concatenated into one ``[1, T]`` row in order (packing
    collators, a pad tail allowed), and one feature per row ``[B, T]`` (padding collators; a row's offset is
    its first unmasked token).
    """
    ids = collated.get("input_ids") if isinstance(collated, Mapping) else None
    if not isinstance(ids, Tensor) or ids.dim() != 2 or not features:
        return None
    parts = [_feature_lengths(f) if isinstance(f, Mapping) else None for f in features]
    if any(p is None for p in parts):
        return None
    B, T = ids.shape
    starts = torch.zeros(B, T, dtype=torch.bool)
    if B == 1 and sum(n for n, _ in parts) <= T:
        offset = 0
        for n, begins in parts:
            for b in begins:
                starts[0, offset + b] = True
            offset += n
        return starts
    if B == len(parts):
        mask = collated.get("attention_mask")
        for r, (n, begins) in enumerate(parts):
            offset = 0
            if isinstance(mask, Tensor) and tuple(mask.shape) == (B, T):
                real = mask[r].nonzero().flatten()
                offset = int(real[0]) if real.numel() else 0
            if offset + n > T:
                return None
            for b in begins:
                starts[r, offset + b] = True
        return starts
    logger.debug(
        "shadow check: collator output %s does not match its %d features; batch boundaries only", B, len(parts)
    )
    return None

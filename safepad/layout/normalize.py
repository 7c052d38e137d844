"""Boundary normalisation: every way a call describes packed rows, turned into one ``seq_idx`` ``[B, T]``.

One body serves eager and traced calls (``torch.compile``). Every predicate is a device tensor; each check
goes through :func:`safepad._tracing.require`, which raises ``ValueError`` on the host in eager mode and checks
on the device while tracing (a ``RuntimeError`` with the same message). The steps that need the host are two
explicit eager-only branches: whether ``position_ids`` restart at all (an eager call reads packing from
``position_ids`` only when they do), and collapsing boundaries that hold one sequence per row to ``None`` (the
varlen path gives the same result, so a traced call keeps them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._tracing import require, tracing
from .boundaries import (
    known_multi_sequence,
    mark_valid_seq_idx,
    packing_positions,
    seq_idx_from_cu_seqlens,
    seq_idx_from_position_ids,
    validate_cu_seqlens,
    validate_seq_idx,
)

__all__ = [
    "change_points",
    "multi_sequence",
    "normalize_boundaries",
    "position_ids_from_seq_idx",
    "real_pairs",
    "restarts_at_real_tokens",
]


def multi_sequence(seq_idx: Tensor) -> Tensor:
    """``[]`` bool on the device: some row of ``seq_idx`` ``[B, T]`` holds more than one sequence."""
    if seq_idx.shape[1] < 2:
        return torch.zeros((), dtype=torch.bool, device=seq_idx.device)
    return (seq_idx[:, -1] != seq_idx[:, 0]).any()


def real_pairs(padding_mask: Tensor | None, T: int) -> Tensor | None:
    """``[B, T - 1]`` bool: both tokens of a pair are real (where boundaries are compared); ``None`` without a mask
    or with one token (``T < 2``: there is no pair, and :func:`change_points` then compares nothing)."""
    if padding_mask is None or T < 2:  # one token: no pair (and no op dispatched on a decode step)
        return None
    m = padding_mask[:, -T:].to(torch.bool)  # [B, T]
    return m[:, 1:] & m[:, :-1]


def change_points(seq_idx: Tensor, real: Tensor | None = None) -> Tensor:
    """``[B, T - 1]`` bool: a new sequence starts at token t + 1 (only between two real tokens when
    ``real`` ``[B, T - 1]`` is given: where the pads' ids sit carries no meaning)."""
    change = seq_idx[:, 1:] != seq_idx[:, :-1]
    return change if real is None else change & real.to(change.device)


def restarts_at_real_tokens(position_ids: Tensor, mask: Tensor | None) -> Tensor:
    """``[B, T]`` bool: a 0 in ``position_ids`` ``[B, T]`` at a real token after the row's first real one (a packed
    sequence starts there). ``mask`` ``[B, T]``: 1 = real token (``None``: every token is real, so a 0 anywhere
    after a row's first token). ``generate()``'s ids (pads at 1, real tokens from 0) hold no such restart."""
    if mask is None:
        restarts = position_ids == 0
        restarts[:, :1] = False
        return restarts
    m = mask.to(device=position_ids.device, dtype=torch.bool)
    return (position_ids == 0) & m & (m.cumsum(1) > 1)


def position_ids_from_seq_idx(seq_idx: Tensor) -> Tensor:
    """Positions restarting at 0 at every boundary: ``[B, T]`` int64."""
    B, T = seq_idx.shape
    pos = torch.arange(T, device=seq_idx.device).expand(B, T)  # [B, T]
    start = torch.ones(B, T, dtype=torch.bool, device=seq_idx.device)
    start[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    start_pos = torch.where(start, pos, torch.zeros_like(pos))  # [B, T]
    return pos - torch.cummax(start_pos, dim=1).values  # [B, T]


def _cu_seq_lens(cu_seq_lens_q: Tensor | None, cu_seq_lens_k: Tensor | None, total: int) -> Tensor:
    """The validated cumulative lengths ``[S + 1]`` of a call that gave ``cu_seq_lens_q`` and/or ``_k``."""
    if cu_seq_lens_q is not None and cu_seq_lens_k is not None:
        q = validate_cu_seqlens(cu_seq_lens_q, total, "cu_seq_lens_q")
        k = validate_cu_seqlens(cu_seq_lens_k, total, "cu_seq_lens_k")
        differ = (
            "cu_seq_lens_q and cu_seq_lens_k differ: a recurrent layer has one set of boundaries, so pass "
            "the same cumulative lengths for both (self-attention over packed rows)"
        )
        require(q.shape == k.shape, differ)
        require((q == k.to(q.device)).all(), differ)
        return q
    name = "cu_seq_lens_q" if cu_seq_lens_q is not None else "cu_seq_lens_k"
    return validate_cu_seqlens(cu_seq_lens_q if cu_seq_lens_q is not None else cu_seq_lens_k, total, name)


def _packed_positions(
    position_ids: Tensor, padding_mask: Tensor | None, T: int, boundaries_given: bool
) -> Tensor | None:
    """``seq_idx`` ``[B, T]`` read from packing ``position_ids`` ``[B, T]``, or ``None`` when they are no packing.

    An eager call reads them only when they restart (one host read); a traced call always reads them when
    ``T > 1`` (a row of one sequence gives the same result through the varlen path). With boundaries given by
    ``seq_idx`` / ``cu_seq_lens`` they are always read: positions that restart nowhere disagree with them.
    """
    if not boundaries_given and T < 2:  # one token: no restart after it (decided before any op is dispatched)
        return None
    restarts = restarts_at_real_tokens(position_ids, None if padding_mask is None else padding_mask[:, -T:])  # [B, T]
    if padding_mask is None:
        derive = seq_idx_from_position_ids
    else:
        derive = lambda _: restarts.cumsum(1).to(torch.int32)  # noqa: E731  [B, T]; pads take their neighbours' ids
    if not boundaries_given:
        if not tracing() and not bool(restarts.any()):  # eager only: a host read decides
            return None
    return derive(position_ids)


def normalize_boundaries(
    shape: tuple[int, int],
    *,
    seq_idx: Tensor | None = None,
    cu_seq_lens_q: Tensor | None = None,
    cu_seq_lens_k: Tensor | None = None,
    position_ids: Tensor | None = None,
    padding_mask: Tensor | None = None,
) -> tuple[Tensor | None, str]:
    """Normalise every way of describing packed rows into ``seq_idx`` ``[B, T]`` int32 (or ``None``).

    * ``seq_idx`` ``[B, T]``: validated (integer, non-decreasing per row).
    * ``cu_seq_lens_q`` / ``cu_seq_lens_k`` ``[S + 1]``: cumulative over the flattened ``[B * T]`` tokens; they
      must agree with each other, end at ``B * T``, put a boundary at every row start, and agree with ``seq_idx``
      when both are given.
    * ``position_ids`` restarting at 0 inside a row (TRL ``padding_free``): ``[B, T]``, ``[1, T]`` or ``[T]``, or the
      text row of ``[4, B, T]`` / ``[1, B, T]`` or the all-zero tokens of ``[3, B, T]`` RoPE rows (see
      :func:`safepad.layout.boundaries.packing_positions`; other layouts are not read). With a
      ``padding_mask`` ``[B, >= T]`` (its last ``T`` columns; 1 = real token) only the real tokens count and a 0
      at a row's first real token is no restart, so ``generate()``'s ids (pads at 1, real tokens from 0) are not
      packing while packed sequences followed by pads are. When ``seq_idx`` / ``cu_seq_lens`` are given too,
      packed ``position_ids`` must put their restarts at the same places (compared between real tokens).

    Returns ``(seq_idx or None, source)``, ``source`` one of ``"none"``, ``"seq_idx"``, ``"cu_seq_lens"``,
    ``"position_ids"``. An eager call returns ``None`` when every row holds a single sequence; a traced call
    returns the boundaries whenever some are given (nothing is read on the host). Raises ``ValueError`` naming
    the argument on any inconsistency (``RuntimeError`` with the same message from the device while tracing).
    """
    B, T = shape
    real = real_pairs(padding_mask, T)  # [B, T - 1] or None
    source = "none"
    out: Tensor | None = None
    if seq_idx is not None:
        out, source = validate_seq_idx(seq_idx, (B, T)), "seq_idx"
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        cu = _cu_seq_lens(cu_seq_lens_q, cu_seq_lens_k, B * T)
        from_cu = seq_idx_from_cu_seqlens(cu, B * T, "cu_seq_lens_q").view(B, T)  # [B, T]
        if B > 1:
            starts = torch.arange(B, device=cu.device) * T  # [B]
            require(
                torch.isin(starts.to(cu.dtype), cu).all(),
                "cu_seq_lens_q describes a sequence that crosses from one row into the next: with batch > 1 "
                "every row start must be a boundary (or flatten the batch to [1, total])",
            )
        if out is not None:
            require(
                (change_points(out, real) == change_points(from_cu.to(out.device), real)).all(),
                "cu_seq_lens_q disagrees with seq_idx: they put sequence boundaries at different tokens; pass "
                "boundaries from one source (the safepad collator emits consistent ones)",
            )
        else:
            out, source = from_cu, "cu_seq_lens"
    # [B, T] from [T] / [1|B, T] / [4|3|1, B, T], or None; a one-token call without boundaries reads none (no restart)
    positions = packing_positions(position_ids, (B, T)) if out is not None or T > 1 else None
    if positions is not None:
        from_pos = _packed_positions(positions, padding_mask, T, boundaries_given=out is not None)
        if from_pos is not None and out is not None:
            require(
                (change_points(out, real) == change_points(from_pos.to(out.device), real)).all(),
                f"position_ids disagree with {source}: they restart at 0 at different tokens than the "
                "sequence boundaries (or nowhere), so attention layers would see other boundaries than the "
                "recurrent ones; pass position_ids that restart at 0 at each boundary, or omit them "
                "(safepad.wrap then derives them from the boundaries)",
                f"position_ids disagree with {source}: they must restart at 0 at each sequence boundary, or be "
                "omitted (docs/limits.md, check D8)",
            )
        elif from_pos is not None:
            out, source = from_pos, "position_ids"
    if out is None or tracing():
        return out, source
    # eager only: one sequence per row needs no boundaries (a host read, unless validate_seq_idx recorded it)
    known = known_multi_sequence(out)
    if not (known if known is not None else bool(multi_sequence(out))):
        return None, source
    return mark_valid_seq_idx(out, multi_sequence=True), source  # validated once: the ops skip their host reads

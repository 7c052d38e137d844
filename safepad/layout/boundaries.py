"""Sequence boundaries: conversions between the three ways packed rows are described.

A *packed* batch is ``[B, T]`` tokens where each row holds one or more sequences back to back.
Its boundaries come in three equivalent encodings:

* ``seq_idx``      ``[B, T]`` int32 — the sequence number of every token; it is non-decreasing
  inside a row and a boundary sits wherever the value changes (mamba-ssm's convention).
* ``cu_seqlens``   ``[S + 1]`` int32 — cumulative lengths over the flattened ``[B * T]`` tokens
  (flash-attention's ``cu_seq_lens_q/k`` convention); ``cu_seqlens[0] == 0`` and
  ``cu_seqlens[-1] == B * T``.
* ``position_ids`` ``[B, T]`` — positions that restart at 0 for each sequence (TRL's
  ``padding_free`` convention). A row whose first position is not 0 continues a sequence that
  started earlier. Every other layout transformers models accept is read through
  :func:`packing_positions`: ``[T]``, ``[1, T]``, ``[4, B, T]`` (text row first), ``[1, B, T]`` and
  ``[3, B, T]`` (multimodal RoPE rows).

Every function here validates its input and raises ``ValueError`` naming the argument.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._tracing import device_check, size_in, tracing
from .facts import fact, record

__all__ = [
    "known_multi_sequence",
    "mark_valid_seq_idx",
    "validate_seq_idx",
    "validate_cu_seqlens",
    "seq_idx_from_cu_seqlens",
    "seq_idx_from_position_ids",
    "packing_positions",
    "position_ids_restart",
    "cu_seqlens_from_seq_idx",
    "sequence_ids",
]

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def validate_seq_idx(seq_idx: Tensor, shape: tuple[int, int] | None = None, name: str = "seq_idx") -> Tensor:
    """Check a ``[B, T]`` integer ``seq_idx`` and return it as int32.

    Raises ``ValueError`` when it is not a 2-D integer tensor, does not match ``shape``, is
    negative, or decreases inside a row. The value checks (a host read) are skipped for a tensor whose
    validity is recorded (:func:`mark_valid_seq_idx`, done once per model call by ``safepad.wrap``).
    """
    if not isinstance(seq_idx, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape [batch, seqlen], got {type(seq_idx).__name__}")
    if seq_idx.dtype not in _INT_DTYPES:
        raise ValueError(f"{name} must have an integer dtype (int32 preferred), got {seq_idx.dtype}")
    if seq_idx.dim() != 2:
        raise ValueError(f"{name} must have shape [batch, seqlen], got shape {tuple(seq_idx.shape)}")
    if shape is not None and tuple(seq_idx.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(seq_idx.shape)} but the inputs have [batch, seqlen] = {tuple(shape)}")
    if seq_idx.numel() and tracing():
        device_check(~(seq_idx < 0).any(), f"{name} must be non-negative")
        if seq_idx.shape[1] > 1:
            device_check(
                ~(seq_idx[:, 1:] < seq_idx[:, :-1]).any(),
                f"{name} decreases inside a row: it must be non-decreasing along the sequence dimension "
                "(a new sequence starts wherever the value increases)",
            )
    elif seq_idx.numel() and not fact(seq_idx, "valid_seq_idx", False):
        # one host read for both checks, and for whether a row holds several sequences (recorded below)
        no = torch.zeros((), dtype=torch.bool, device=seq_idx.device)
        long = seq_idx.shape[1] > 1
        negative, decreasing, multi = torch.stack([
            (seq_idx < 0).any(),
            (seq_idx[:, 1:] < seq_idx[:, :-1]).any() if long else no,
            (seq_idx[:, -1] != seq_idx[:, 0]).any() if long else no,
        ]).tolist()
        if negative:
            raise ValueError(f"{name} must be non-negative")
        if decreasing:
            row = int((seq_idx[:, 1:] < seq_idx[:, :-1]).any(dim=1).nonzero()[0])
            raise ValueError(
                f"{name} decreases inside row {row}: it must be non-decreasing along the sequence dimension "
                "(a new sequence starts wherever the value increases)"
            )
        return mark_valid_seq_idx(seq_idx.to(torch.int32), multi_sequence=multi)
    return seq_idx.to(torch.int32)


def mark_valid_seq_idx(seq_idx: Tensor, multi_sequence: bool | None = None) -> Tensor:
    """Record that ``seq_idx`` ``[B, T]`` int32 passed :func:`validate_seq_idx` (and, when known, whether some row
    holds several sequences), so that the ops given this tensor skip their host reads. Returns ``seq_idx``."""
    facts: dict = {"valid_seq_idx": True}
    if multi_sequence is not None:
        facts["multi_sequence"] = bool(multi_sequence)
    return record(seq_idx, **facts)


def known_multi_sequence(seq_idx: Tensor) -> bool | None:
    """Whether some row of ``seq_idx`` holds several sequences, when recorded (:func:`mark_valid_seq_idx`)."""
    return fact(seq_idx, "multi_sequence")


def validate_cu_seqlens(cu_seqlens: Tensor, total: int | None = None, name: str = "cu_seqlens") -> Tensor:
    """Check a 1-D cumulative-length tensor ``[S + 1]`` and return it as int32.

    It must start at 0, be non-decreasing and, when ``total`` is given, end at ``total``.
    """
    if not isinstance(cu_seqlens, Tensor):
        raise ValueError(f"{name} must be a 1-D torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in _INT_DTYPES:
        raise ValueError(f"{name} must have an integer dtype, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        hint = (
            " (a single entry: was the batch cut by accelerate's batch dispatcher, the default for an IterableDataset "
            "under Trainer? Set TrainingArguments(accelerator_config={'dispatch_batches': False}), or add "
            "safepad's PaddingGuardCallback, which passes one process's dispatched batches on whole)"
            if cu_seqlens.dim() == 1 and cu_seqlens.numel() == 1 else ""
        )
        raise ValueError(
            f"{name} must have shape [num_seqs + 1] with num_seqs >= 1, got {tuple(cu_seqlens.shape)}{hint}"
        )
    if tracing():
        device_check(cu_seqlens[0] == 0, f"{name} must start at 0")
        device_check(~(cu_seqlens[1:] < cu_seqlens[:-1]).any(), f"{name} must be non-decreasing")
        if total is not None:
            device_check(
                cu_seqlens[-1] == total,
                # no {total} in the message: formatting a symbolic length would specialise it (dynamic=True)
                f"{name} does not end at the number of tokens of the packed input: the sequence lengths must add "
                "up to the row length",
            )
        return cu_seqlens.to(torch.int32)
    if int(cu_seqlens[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(cu_seqlens[0])}")
    if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing")
    if total is not None and int(cu_seqlens[-1]) != total:
        raise ValueError(
            f"{name} ends at {int(cu_seqlens[-1])} but the packed input has {total} tokens: "
            "the sequence lengths must add up to the row length"
        )
    return cu_seqlens.to(torch.int32)


def seq_idx_from_cu_seqlens(cu_seqlens: Tensor, total: int, name: str = "cu_seqlens") -> Tensor:
    """``cu_seqlens`` ``[S + 1]`` over a flattened ``[1, total]`` row -> ``seq_idx`` ``[1, total]`` int32."""
    cu = validate_cu_seqlens(cu_seqlens, total, name)
    if tracing():  # static shape: token t belongs to the last sequence starting at or before t
        t = torch.arange(total, device=cu.device, dtype=cu.dtype)  # [total]
        return (torch.searchsorted(cu, t, right=True) - 1).to(torch.int32).unsqueeze(0)  # [1, total]
    lengths = (cu[1:] - cu[:-1]).to(torch.int64)  # [S]
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)  # [total]
    return seq.to(torch.int32).unsqueeze(0)  # [1, total]


def packing_positions(position_ids: Tensor | None, shape: tuple[int, int] | None = None) -> Tensor | None:
    """The ``[B, T]`` positions whose zeros start sequences, from any ``position_ids`` layout a model accepts.

    * ``[T]`` and ``[1, T]``: one row of positions for the whole batch (transformers' mask code expands
      them, as several collators pass them);
    * ``[B, T]``: as they are;
    * ``[4, B, T]`` (``[text, temporal, height, width]``, the Qwen2-VL .. Qwen3.5 text models) and ``[1, B, T]``
      (Qwen4-Exp): row 0, the text positions those models hand to ``create_causal_mask``;
    * ``[3, B, T]`` (multimodal RoPE rows without a text row): a token starts a sequence where all three rows
      are 0. ``get_rope_index`` gives ``(0, 0, 0)`` to a sequence's first token only (text at ``(p, p, p)``,
      vision patches at ``(s + t, s + h, s + w)``, all 0 only for the first patch of an image that opens the
      sequence), so the all-zero tokens after a row's first one are restarts. They come back as the rows'
      max ``[B, T]``, which is 0 exactly there.

    With ``shape`` ``(B, T)`` the result is expanded to ``[B, T]``, and ``None`` comes back when the
    positions do not fit it; without it the rows come back as they are (``[1 | B, T]``). ``None`` for any
    other layout (no packing is read from it).
    """
    if not isinstance(position_ids, Tensor):
        return None
    pos = position_ids
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)  # [1, T]
    elif pos.dim() == 3:
        if size_in(pos.shape[0], (1, 4)):
            pos = pos[0]  # [B, T]: the text positions
        elif pos.shape[0] == 3:
            pos = pos.abs().amax(0)  # [B, T]: 0 where all three RoPE rows are 0
        else:
            return None
    elif pos.dim() != 2:
        return None
    if shape is None:
        return pos
    B, T = shape
    if pos.shape[-1] != T or not size_in(pos.shape[0], (1, B)):  # (`in` misreads a symbolic B: size_in)
        return None
    return pos.expand(B, T)


def position_ids_restart(position_ids: Tensor) -> bool:
    """True when some row of ``position_ids`` (any layout of :func:`packing_positions`) restarts at 0 after its
    first token (packing)."""
    pos = packing_positions(position_ids)
    if pos is None or pos.shape[1] < 2:
        return False
    return bool((pos[:, 1:] == 0).any())


def seq_idx_from_position_ids(position_ids: Tensor) -> Tensor:
    """``position_ids`` ``[B, T]`` restarting at 0 per sequence -> ``seq_idx`` ``[B, T]`` int32.

    A new sequence starts wherever the position is 0; consecutive zeros are consecutive
    length-1 sequences. Tokens before the first 0 in a row continue an earlier sequence and get id 0.
    """
    if not isinstance(position_ids, Tensor) or position_ids.dim() != 2:
        shape = tuple(position_ids.shape) if isinstance(position_ids, Tensor) else type(position_ids).__name__
        raise ValueError(f"position_ids must be a [batch, seqlen] tensor to describe packing, got {shape}")
    starts = (position_ids == 0).to(torch.int32)  # [B, T]
    seq = torch.cumsum(starts, dim=1) - starts[:, :1]  # [B, T]; the row's first sequence is 0
    return seq.to(torch.int32)


def cu_seqlens_from_seq_idx(seq_idx: Tensor) -> Tensor:
    """``seq_idx`` ``[B, T]`` -> ``cu_seqlens`` ``[S + 1]`` int32 over the flattened ``[B * T]`` tokens.

    A sequence ends where ``seq_idx`` changes or at the end of a row.
    """
    B, T = seq_idx.shape
    change = torch.ones(B, T, dtype=torch.bool, device=seq_idx.device)  # [B, T]: token starts a sequence
    if T > 1:
        change[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    starts = change.reshape(-1).nonzero().squeeze(1)  # [S]
    total = torch.tensor([B * T], device=seq_idx.device, dtype=starts.dtype)
    return torch.cat([starts, total]).to(torch.int32)  # [S + 1]


def sequence_ids(seq_idx: Tensor) -> Tensor:
    """A globally unique, row-major sequence number for every token: ``[B, T]`` int64.

    Two tokens share an id iff they are in the same row and have the same ``seq_idx``.
    Ids run 0..S-1 in order of appearance, matching the order of ``cu_seqlens_from_seq_idx``.
    """
    B, T = seq_idx.shape
    change = torch.ones(B, T, dtype=torch.int64, device=seq_idx.device)  # [B, T]
    if T > 1:
        change[:, 1:] = (seq_idx[:, 1:] != seq_idx[:, :-1]).to(torch.int64)
    return (torch.cumsum(change.reshape(-1), 0) - 1).reshape(B, T)  # [B, T]

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
  started earlier.

Every function here validates its input and raises ``ValueError`` naming the argument.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._tracing import device_check, tracing

__all__ = [
    "validate_seq_idx",
    "validate_cu_seqlens",
    "seq_idx_from_cu_seqlens",
    "seq_idx_from_position_ids",
    "position_ids_restart",
    "cu_seqlens_from_seq_idx",
    "sequence_ids",
]

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def validate_seq_idx(seq_idx: Tensor, shape: tuple[int, int] | None = None, name: str = "seq_idx") -> Tensor:
    """Check a ``[B, T]`` integer ``seq_idx`` and return it as int32.

    Raises ``ValueError`` when it is not a 2-D integer tensor, does not match ``shape``, is
    negative, or decreases inside a row.
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
    elif seq_idx.numel():
        if bool((seq_idx < 0).any()):
            raise ValueError(f"{name} must be non-negative")
        if seq_idx.shape[1] > 1 and bool((seq_idx[:, 1:] < seq_idx[:, :-1]).any()):
            row = int((seq_idx[:, 1:] < seq_idx[:, :-1]).any(dim=1).nonzero()[0])
            raise ValueError(
                f"{name} decreases inside row {row}: it must be non-decreasing along the sequence dimension "
                "(a new sequence starts wherever the value increases)"
            )
    return seq_idx.to(torch.int32)


def validate_cu_seqlens(cu_seqlens: Tensor, total: int | None = None, name: str = "cu_seqlens") -> Tensor:
    """Check a 1-D cumulative-length tensor ``[S + 1]`` and return it as int32.

    It must start at 0, be non-decreasing and, when ``total`` is given, end at ``total``.
    """
    if not isinstance(cu_seqlens, Tensor):
        raise ValueError(f"{name} must be a 1-D torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in _INT_DTYPES:
        raise ValueError(f"{name} must have an integer dtype, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must have shape [num_seqs + 1] with num_seqs >= 1, got {tuple(cu_seqlens.shape)}")
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


def position_ids_restart(position_ids: Tensor) -> bool:
    """True when some row of 2-D ``position_ids`` restarts at 0 after its first token (packing)."""
    if position_ids.dim() != 2 or position_ids.shape[1] < 2:
        return False
    return bool((position_ids[:, 1:] == 0).any())


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

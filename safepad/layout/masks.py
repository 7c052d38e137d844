"""Padding masks: classify a ``[B, T]`` mask and move each row's real tokens to the front.

safepad's ops take a *right-padded* token mask (real tokens first, pads trailing) together with an
optional cached state. Any other layout (left pads, holes) is first *compacted*: a per-row gather moves
the real tokens to the front, the mixer runs, and a scatter puts the outputs back where they came from.
Compaction keeps the order of the real tokens, so a left pad inside a continuation chunk can no longer
sit between the cached context and the new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .._tracing import device_check, tracing

__all__ = [
    "check_mask_values",
    "normalize_mask",
    "trailing_pad_counts",
    "ends_in_padding",
    "has_holes",
    "hole_positions",
    "is_right_padded",
    "pads_after_real",
    "pads_before_real",
    "Compaction",
]


def normalize_mask(attention_mask: Tensor | None, shape: tuple[int, int], name: str = "attention_mask") -> Tensor | None:
    """A 2-D padding mask as bool ``[B, T]``, or ``None`` when there is none or it is all ones.

    The mask may be longer than ``T`` (a full-length mask during chunked prefill or decode); its last ``T``
    columns are the current tokens. Anything that is not a 2-D mask (a 4-D custom mask, a dict of masks)
    carries no padding information for a recurrent layer and gives ``None``. While tracing
    (``torch.compile``) and for one token (``T == 1``, a decode step) an all-ones mask is returned as it is.
    """
    if attention_mask is None or not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2:
        return None
    B, T = shape
    if attention_mask.shape[0] != B or attention_mask.shape[1] < T:
        raise ValueError(
            f"{name} has shape {tuple(attention_mask.shape)} but the input has [batch, seqlen] = [{B}, {T}]: "
            "pass a [batch, seqlen] mask (or the full-length mask of the cached context plus the new tokens)"
        )
    mask = (attention_mask if attention_mask.shape[1] == T else attention_mask[:, -T:]).to(torch.bool)  # [B, T]
    if tracing() or T == 1:
        # no host sync (under compile, and on every one-token decode step, which a CUDA graph may capture): an
        # all-ones mask stays a mask (every token real, the same result)
        return mask
    if bool(mask.all()):
        return None
    return mask


def trailing_pad_counts(mask: Tensor) -> Tensor:
    """Number of trailing zeros in each row of a ``[B, T]`` mask: ``[B]`` int64."""
    m = mask.to(torch.bool)
    T = m.shape[1]
    pos = torch.arange(1, T + 1, device=m.device)  # [T]
    last_real = (m * pos).amax(dim=1)  # [B]; 0 for an all-pad row
    return T - last_real


def ends_in_padding(mask: Tensor) -> Tensor:
    """``[B]`` bool on the device: the row of ``mask`` ``[B, T]`` has real tokens and ends in a pad (right padding,
    with or without holes or left pads before it). No host read: eager and traced callers share it."""
    m = mask.to(torch.bool)
    return ~m[:, -1] & m.any(1)


def hole_positions(mask: Tensor) -> Tensor:
    """``[B, T]`` bool on the device: the pads of ``mask`` ``[B, T]`` that sit between two real tokens of their row."""
    m = mask.to(torch.bool)
    c = m.cumsum(1)  # [B, T]: real tokens up to and including each position
    return ~m & (c > 0) & (c < c[:, -1:])


def has_holes(mask: Tensor) -> Tensor:
    """Per row: is there a pad between two real tokens?  ``[B]`` bool."""
    return hole_positions(mask).any(1)


def pads_after_real(mask: Tensor) -> Tensor:
    """``[B]`` bool on the device: the row of ``mask`` ``[B, T]`` has a pad right after a real token (right padding
    or holes), i.e. it is not left-padded. No host read: eager and traced callers share it."""
    m = mask.to(torch.bool)
    if m.shape[1] < 2:
        return torch.zeros(m.shape[0], dtype=torch.bool, device=m.device)
    return (m[:, :-1] & ~m[:, 1:]).any(1)


def pads_before_real(mask: Tensor) -> Tensor:
    """``[B]`` bool on the device: the row of ``mask`` ``[B, T]`` has a real token right after a pad (left pads or
    holes), i.e. it is not right-padded. No host read: eager and traced callers share it."""
    m = mask.to(torch.bool)
    if m.shape[1] < 2:
        return torch.zeros(m.shape[0], dtype=torch.bool, device=m.device)
    return (m[:, 1:] & ~m[:, :-1]).any(1)


def is_right_padded(mask: Tensor) -> bool:
    """True when every row of ``[B, T]`` is real tokens followed only by pads (no left pads, no holes; one host
    read of :func:`pads_before_real`, none for one token)."""
    if mask.shape[1] < 2:
        return True
    return not bool(pads_before_real(mask).any())


@dataclass
class Compaction:
    """Per-row gather that moves real tokens to the front of each row (stable), and its inverse scatter.

    ``index``  ``[B, T]`` int64: position in the original row of the token that lands at each slot
    (real tokens first, in order, then the pads). ``mask`` ``[B, T]`` bool: the compacted (right-padded) mask.
    """

    index: Tensor
    mask: Tensor
    lengths: Tensor

    @classmethod
    def from_mask(cls, mask: Tensor) -> "Compaction":
        m = mask.to(torch.bool)
        B, T = m.shape
        pos = torch.arange(T, device=m.device).expand(B, T)  # [B, T]
        # real tokens sort before pads, ties keep their order (stable sort on the key "is pad")
        key = (~m).to(torch.int8)
        index = torch.sort(key, dim=1, stable=True).indices  # [B, T]
        lengths = m.sum(dim=1)  # [B]
        new_mask = pos < lengths[:, None]  # [B, T]
        return cls(index=index, mask=new_mask, lengths=lengths)

    def gather(self, x: Tensor) -> Tensor:
        """``x`` ``[B, T, ...]`` in the original layout -> compacted layout."""
        idx = self.index.view(*self.index.shape, *([1] * (x.dim() - 2))).expand_as(x)  # [B, T, ...]
        return torch.gather(x, 1, idx)

    def scatter(self, y: Tensor) -> Tensor:
        """``y`` ``[B, T, ...]`` in the compacted layout -> original layout; pad positions get zeros."""
        y = torch.where(self.mask.view(*self.mask.shape, *([1] * (y.dim() - 2))), y, 0.0)  # (even a NaN)
        idx = self.index.view(*self.index.shape, *([1] * (y.dim() - 2))).expand_as(y)  # [B, T, ...]
        return torch.zeros_like(y).scatter(1, idx, y)


_MASK_VALUES_MESSAGE = (
    "attention_mask: a 2-D attention_mask is a padding mask holding 1 for a real token and 0 for a pad (or bool); "
    "this one ({dtype}) holds {what}. An additive mask (0 keep, -inf pad) must be converted first: pass "
    "`(additive_mask == 0).long()`."
)
#: the device check's short message (CUDA's limit: safepad._tracing.device_check); docs/limits.md, check D1
_MASK_VALUES_DEVICE_MESSAGE = (
    "attention_mask ({dtype}) must hold only 0 and 1, or be bool; convert an additive mask (0 keep, -inf pad) with "
    "(mask == 0).long() (docs/limits.md, check D1)"
)


def check_mask_values(attention_mask: Tensor | None, on_device: bool = False) -> Tensor | None:
    """Raise unless a 2-D ``[B, T]`` ``attention_mask`` is a padding mask: bool, or holding only 0 and 1.

    A float *additive* mask (0 keep, ``-inf`` / a large negative number for pads) reads as "every token is real
    except the ones holding exactly 0" under transformers' 2-D convention, so it silently keeps the pads and drops
    real tokens. One host read per call (``ValueError``; none for a bool mask); on the device while tracing or with
    ``on_device`` (:func:`safepad._tracing.device_check`: on CUDA a failure is a device-side assert that loses the
    process's CUDA context, so the caller checks on the host wherever that is free); other shapes pass.

    The check compares the mask with its own truth value (``mask.to(bool) == mask``: only 0 and 1 equal theirs;
    a NaN does not), and returns that bool copy ``[B, T]`` for the caller to reuse (the mask itself when bool;
    None for other shapes or an empty mask).
    """
    if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2:
        return None
    if attention_mask.dtype == torch.bool:
        return attention_mask
    if attention_mask.numel() == 0:
        return None
    real = attention_mask.to(torch.bool)  # [B, T]
    ok = (real == attention_mask).all()  # (the bool promoted to the mask's dtype: 1 where nonzero)
    if on_device or tracing():  # a decode step, or traced: no host read (a RuntimeError carrying the message)
        device_check(ok, _MASK_VALUES_DEVICE_MESSAGE.format(dtype=attention_mask.dtype))
        return real
    if not bool(ok):
        bad = attention_mask[(attention_mask != 0) & (attention_mask != 1)][0].item()
        raise ValueError(_MASK_VALUES_MESSAGE.format(dtype=attention_mask.dtype, what=repr(bad)))
    return real

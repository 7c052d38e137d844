"""Checks that every rank of a sequence-parallel group was handed the same call (one collective per call).

Every rank of a group must receive the same full batch: the ranks shard the rows themselves. A per-rank
sampler, per-rank label masking or a per-rank embedding lookup would otherwise train on a mixture of
shards of different batches (a loss off by 0.24 for different labels, logits off by 1.0 for different
``position_ids``, with no error). :func:`check_same_call` fingerprints every tensor argument of the call on
its own device and all-gathers the fingerprints ONCE, so a mismatch raises on every rank (no rank is left
waiting in a later collective) and names the arguments that differ.

A fingerprint is, per argument: present, the shape (hashed), the number of elements, and two weighted sums
in float64 (position weights ``1..n`` and ``cos(0.7548 k)``), so a permutation or a changed value changes it.
Equal inputs on equal devices give bit-identical fingerprints (the same reduction on the same values).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import torch
from torch import Tensor

from ..parallel.collectives import all_gather_stack

__all__ = ["CHECKED_ARGUMENTS", "check_same_call"]

#: arguments fingerprinted one by one (named in the error); any other tensor argument goes into one more slot
CHECKED_ARGUMENTS = (
    "input_ids", "inputs_embeds", "labels", "position_ids", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k",
    "token_type_ids", "attention_mask", "num_items_in_batch",
)
_OTHER = "other tensor arguments"
_WIDTH = 5  # present, shape hash, numel, sum(x * k), sum(x * cos(0.7548 k))


def _name_weight(name: str) -> float:
    """A stable per-name factor in [1, 2), so that two other arguments cannot swap values unnoticed."""
    return 1.0 + zlib.crc32(name.encode()) / 2**32


def _fingerprint(t: Tensor, device: torch.device) -> Tensor:
    """``[5]`` float64 fingerprint of ``t`` (any shape and dtype) on ``device``."""
    x = t.detach().reshape(-1).to(device=device)
    x = x.to(torch.float64) if not x.is_complex() else torch.view_as_real(x).reshape(-1).to(torch.float64)
    x = torch.nan_to_num(x, nan=-7.25e300, posinf=3.5e300, neginf=-3.5e300)  # NaN == NaN here
    k = torch.arange(x.numel(), device=device, dtype=torch.float64)
    shape = float(sum((d + 1) * 1000003.0 ** i for i, d in enumerate(t.shape))) + 7.0 * t.dim()
    head = torch.tensor([1.0, shape, float(x.numel())], dtype=torch.float64, device=device)
    return torch.cat([head, torch.stack([(x * (k + 1)).sum(), (x * torch.cos(0.7548776662 * k)).sum()])])


def check_same_call(arguments: Mapping[str, object], group, rank: int, world: int, device: torch.device) -> None:
    """Raise ``ValueError`` on every rank when the ranks' tensor ``arguments`` (name -> value) differ.

    ``arguments``: the call's keyword arguments (non-tensors other than Python numbers are ignored; numbers
    in :data:`CHECKED_ARGUMENTS` count). One all-gather of a ``[len(CHECKED_ARGUMENTS) + 1, 5]`` float64 tensor.
    """
    rows = torch.zeros(len(CHECKED_ARGUMENTS) + 1, _WIDTH, dtype=torch.float64, device=device)
    for name, value in arguments.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and name in CHECKED_ARGUMENTS:
            value = torch.tensor(value)
        if not isinstance(value, Tensor):
            continue
        fp = _fingerprint(value, device)
        if name in CHECKED_ARGUMENTS:
            rows[CHECKED_ARGUMENTS.index(name)] = fp
        else:
            rows[-1] += fp * _name_weight(name)
    with torch.no_grad():
        every = all_gather_stack(rows, group, rank, world)  # [W, slots, 5]
    differs = (every != every[:1]).any(dim=2).any(dim=0)  # [slots]
    if bool(differs.any()):
        names = [n for n, d in zip((*CHECKED_ARGUMENTS, _OTHER), differs.tolist()) if d]
        raise ValueError(
            f"the ranks of the sequence-parallel group were given different {', '.join(names)}: every rank must "
            "receive the same full batch, every tensor argument included (use one sampler for the group, not a "
            "per-rank DistributedSampler over these ranks, and no per-rank masking or embedding)"
        )

"""Checks that every rank of a sequence-parallel group was handed the same call (one collective per call).

Every rank of a group must receive the same full batch: the ranks shard the rows themselves. A per-rank
sampler, per-rank label masking or a per-rank embedding lookup would otherwise train on a mixture of
shards of different batches (a loss off by 0.24 for different labels, logits off by 1.0 for different
``position_ids``, with no error). :func:`check_same_call` fingerprints every tensor argument of the call on
its own device and all-gathers the fingerprints ONCE, so a mismatch raises on every rank (no rank is left
waiting in a later collective) and names the arguments that differ.

A fingerprint is, per argument: present, the shape (hashed), the number of elements, and two weighted sums
in float64 over its rows (row weights ``1..R`` on the row sums, and cosine weights over rows and columns), so
a permutation or a changed value changes it; converted to float64 in chunks of rows (bounded memory).
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


#: float64 elements converted at a time (32 MiB): a [1, 1M, 4096] inputs_embeds is never copied whole
_CHUNK = 1 << 22


def _fingerprint(t: Tensor, device: torch.device) -> Tensor:
    """``[5]`` float64 fingerprint of ``t`` (any shape and dtype) on ``device``.

    ``t`` is read as rows ``[R, C]`` (its last dim; a 1-D tensor as ``[n, 1]``), in chunks of rows converted to
    float64: ``Σ_r (r + 1) Σ_c x[r, c]`` and ``Σ_r cos(0.5698 r) Σ_c cos(0.7549 c) x[r, c]``.
    """
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    x = x.reshape(-1, x.shape[-1]) if x.dim() >= 2 else x.reshape(-1, 1)  # [R, C]
    R, C = x.shape
    w = torch.cos(0.7548776662 * torch.arange(C, device=device, dtype=torch.float64))  # [C]
    s1 = torch.zeros((), dtype=torch.float64, device=device)
    s2 = torch.zeros((), dtype=torch.float64, device=device)
    step = max(1, _CHUNK // max(C, 1))
    for start in range(0, R, step):
        c = x[start : start + step].to(device=device, dtype=torch.float64)  # [r, C]
        c = torch.nan_to_num(c, nan=-7.25e300, posinf=3.5e300, neginf=-3.5e300)  # NaN == NaN here
        k = torch.arange(start, start + c.shape[0], device=device, dtype=torch.float64)  # [r]
        s1 = s1 + (c.sum(-1) * (k + 1)).sum()
        s2 = s2 + ((c @ w) * torch.cos(0.5698402910 * k)).sum()
    shape = float(sum((d + 1) * 1000003.0 ** i for i, d in enumerate(t.shape))) + 7.0 * t.dim()
    head = torch.tensor([1.0, shape, float(t.numel())], dtype=torch.float64, device=device)
    return torch.cat([head, torch.stack([s1, s2])])


def check_same_call(arguments: Mapping[str, object], group, rank: int, world: int, device: torch.device) -> None:
    """Raise ``ValueError`` on every rank when the ranks' tensor ``arguments`` (name -> value) differ.

    ``arguments``: the call's keyword arguments (non-tensors other than Python numbers are ignored; numbers
    in :data:`CHECKED_ARGUMENTS` count). One all-gather of a ``[len(CHECKED_ARGUMENTS) + 1, 5]`` float64 tensor.
    """
    rows = torch.zeros(len(CHECKED_ARGUMENTS) + 1, _WIDTH, dtype=torch.float64, device=device)
    for name, value in arguments.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and name in CHECKED_ARGUMENTS:
            value = torch.tensor(value)  # host: _fingerprint moves it to the group's device
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

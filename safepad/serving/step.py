"""One continuous-batching step as the recurrent layers see it: the packed batch re-laid as one row per request.

transformers' continuous batching hands the model one packed row ``[1, T]``: the scheduled requests back to back
(``cu_seq_lens_q``), each a prefill chunk or a one-token decode step, each continuing its own cache. Attention reads
its keys and values from the paged cache; a recurrent layer must continue each request from that request's own
state (its slot, :mod:`safepad.serving.slots`) and leave its new state there.

:class:`ServingStep` lays the packed tokens out as right-padded rows, one per request, in at most two groups (the
one-token decode steps ``[n, 1]``, the prefill chunks ``[n, L]``, ``L`` the longest chunk), so every wrapped mixer
runs its padded cached path, the one checked against each sequence alone for every family, once per group, on a
:class:`SlotRowsCache`: a cache whose row ``r`` is the slot of the group's request ``r``, gathered before the mixer reads it (zeros for a request whose chunk starts its sequence) and
scattered back when the mixer writes it. The indices are built once per step on the host from the scheduler's own
lists (one host-to-device copy, no device read) and every gather / scatter runs on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .slots import RecurrentSlots

__all__ = ["RowGroup", "ServingStep", "SlotRowsCache", "StepEntry"]


@dataclass(frozen=True)
class StepEntry:
    """One scheduled request of a step: its slot, the tokens its cache holds and the tokens this step feeds."""

    request_id: str
    slot: int
    past_length: int
    query_length: int


class RowGroup:
    """Some requests of a step laid out as ``[n, L]`` right-padded rows (``L`` their longest chunk).

    Attributes:
        n, L: rows and columns; ``tokens``: the group's real tokens.
        slots: ``[n]`` int64 slot of each row; ``fresh``: ``[n]`` bool, the row's chunk starts its sequence.
        row_index: ``[n, L]`` int64 packed position of each row token (0 at pads); ``mask``: ``[n, L]`` bool real
            tokens (None when every chunk has ``L`` tokens); ``dest``: ``[tokens]`` packed position of each real
            token and ``real_flat``: ``[tokens]`` its flat row position ``r * L + j``, in the same order.
    """

    def __init__(self, entries: list[StepEntry], starts: list[int], store: RecurrentSlots, device: torch.device):
        lengths = [e.query_length for e in entries]
        self.entries = entries
        self.store = store
        self.n, self.L, self.tokens = len(entries), max(lengths), sum(lengths)
        row_index, dest, real_flat = [], [], []
        for r, (q, start) in enumerate(zip(lengths, starts)):
            row_index.extend(list(range(start, start + q)) + [0] * (self.L - q))
            dest.extend(range(start, start + q))
            real_flat.extend(range(r * self.L, r * self.L + q))
        small = torch.tensor(
            [[e.slot for e in entries], [int(e.past_length == 0) for e in entries], lengths], dtype=torch.int64
        ).to(device, non_blocking=True)
        big = torch.tensor(row_index + dest + real_flat, dtype=torch.int64).to(device, non_blocking=True)
        self.slots = small[0]  # [n]
        self.fresh = small[1].bool()  # [n]
        self.row_index = big[: self.n * self.L].view(self.n, self.L)  # [n, L]
        self.dest = big[self.n * self.L : self.n * self.L + self.tokens]  # [tokens]
        self.real_flat = big[self.n * self.L + self.tokens :]  # [tokens]
        padded = any(q != self.L for q in lengths)
        self.mask = (torch.arange(self.L, device=device)[None, :] < small[2][:, None]) if padded else None

    def __repr__(self) -> str:
        return f"RowGroup(n={self.n}, L={self.L})"

    def unpack(self, packed: Tensor) -> Tensor:
        """``packed`` ``[1, T, ...]`` -> this group's rows ``[n, L, ...]`` (pads hold a copy of token 0; masked)."""
        rows = packed[0].index_select(0, self.row_index.reshape(-1))  # [n * L, ...]
        return rows.view(self.n, self.L, *packed.shape[2:])

    def pack_into(self, out: Tensor, rows: Tensor) -> None:
        """Write the real tokens of ``rows`` ``[n, L, ...]`` at their packed positions of ``out`` ``[T, ...]``."""
        flat = rows.reshape(self.n * self.L, *rows.shape[2:])
        out.index_copy_(0, self.dest, flat.index_select(0, self.real_flat).to(out.dtype))


class ServingStep:
    """One step's requests (``entries``, in the packed order) as row groups: the one-token decode steps as ``[n, 1]``
    rows and the prefill chunks as ``[n, L]`` right-padded rows (``L`` the longest chunk), so that a long chunk
    next to many decode steps does not pad each of them to its length. ``T``: the packed tokens of the step."""

    def __init__(self, entries: list[StepEntry], slots: RecurrentSlots, device: torch.device) -> None:
        if not entries:
            raise ValueError("a continuous-batching step with no request")
        self.entries = entries
        self.store = slots
        starts, start = [], 0
        for e in entries:
            starts.append(start)
            start += e.query_length
        self.T = start
        self.groups: list[RowGroup] = []
        for decode in (True, False):
            picked = [i for i, e in enumerate(entries) if (e.query_length == 1) == decode]
            if picked:
                self.groups.append(RowGroup([entries[i] for i in picked], [starts[i] for i in picked], slots, device))

    def __repr__(self) -> str:
        return f"ServingStep(T={self.T}, groups={self.groups})"

    def pack(self, group_rows: list[Tensor]) -> Tensor:
        """The groups' rows (``[n, L, ...]`` each, in :attr:`groups` order) -> ``[1, T, ...]`` in the packed order."""
        first = group_rows[0]
        out = first.new_empty((self.T, *first.shape[2:]))
        for group, rows in zip(self.groups, group_rows):
            group.pack_into(out, rows)
        return out[None]


class _LayerView:
    """What :func:`safepad.cache.read_states` asks a cache layer: whether it holds a previous state."""

    def __init__(self, has_previous: bool) -> None:
        self.has_previous_state = {0: has_previous} if has_previous else {}


class SlotRowsCache:
    """A cache whose row ``n`` is the slot of the step's request ``n`` (the interface the wrapped mixers use:
    ``get_conv_state`` / ``get_recurrent_state`` / ``update_conv_state`` / ``update_recurrent_state`` /
    ``layers[i].has_previous_state``). Reads gather the slots and zero the rows of fresh requests; writes scatter."""

    def __init__(self, group: RowGroup) -> None:
        self.step = group
        self.store = group.store

    @property
    def layers(self) -> _Layers:
        return _Layers(self)

    def _read(self, layer_idx: int, kind: str, state_idx: int) -> Tensor | None:
        pool = self.store.pool(layer_idx, kind, state_idx)
        if pool is None:  # nothing written yet: every request of the session is at its first chunk
            return None
        states = pool.index_select(0, self.step.slots)  # [N, ...]
        keep = ~self.step.fresh.view(-1, *([1] * (states.dim() - 1)))
        return torch.where(keep, states, torch.zeros((), dtype=states.dtype, device=states.device))

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        return self._read(layer_idx, "conv", state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        return self._read(layer_idx, "recurrent", state_idx)

    def update_conv_state(self, conv: Tensor, layer_idx: int, state_idx: int = 0, **_: object) -> None:
        self.store.write(layer_idx, "conv", state_idx, self.step.slots, conv)

    def update_recurrent_state(self, recurrent: Tensor, layer_idx: int, state_idx: int = 0, **_: object) -> None:
        self.store.write(layer_idx, "recurrent", state_idx, self.step.slots, recurrent)


class _Layers:
    def __init__(self, cache: SlotRowsCache) -> None:
        self.cache = cache

    def __getitem__(self, layer_idx: int) -> _LayerView:
        store = self.cache.store
        written = any(key[0] == layer_idx for key in store.pools)
        return _LayerView(written)

    def __len__(self) -> int:  # pragma: no cover - not read by the mixers
        return 1 + max((key[0] for key in self.cache.store.pools), default=-1)

"""One continuous-batching step as the recurrent layers see it: the packed batch re-laid as one row per request.

transformers' continuous batching hands the model one packed row ``[1, T]``: the scheduled requests back to back
(``cu_seq_lens_q``), each a prefill chunk or a one-token decode step, each continuing its own cache. Attention reads
its keys and values from the paged cache; a recurrent layer must continue each request from that request's own
state (its slot, :mod:`safepad.serving.slots`) and leave its new state there.

:class:`ServingStep` lays the packed tokens out as ``[N, L]`` right-padded rows (``N`` requests, ``L`` the longest
chunk; a decode-only step is ``[N, 1]`` with no padding), so every wrapped mixer runs its padded cached path, the
one checked against each sequence alone for every family, on a :class:`SlotRowsCache`: a cache whose row ``n`` is
request ``n``'s slot, gathered before the mixer reads it (zeros for a request whose chunk starts its sequence) and
scattered back when the mixer writes it. The indices are built once per step on the host from the scheduler's own
lists (one host-to-device copy, no device read) and every gather / scatter runs on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .slots import RecurrentSlots

__all__ = ["ServingStep", "SlotRowsCache", "StepEntry"]


@dataclass(frozen=True)
class StepEntry:
    """One scheduled request of a step: its slot, the tokens its cache holds and the tokens this step feeds."""

    request_id: str
    slot: int
    past_length: int
    query_length: int


class ServingStep:
    """The row layout of one step (``entries`` in the packed order) and the slots behind it.

    Attributes:
        T: packed tokens of the step; ``N`` requests; ``L`` the longest chunk.
        slots: ``[N]`` int64 slot of each row; ``fresh``: ``[N]`` bool, the row's chunk starts its sequence.
        row_index: ``[N, L]`` int64 packed position of each row token (0 at pads); ``mask``: ``[N, L]`` bool real
            tokens (None when every chunk has ``L`` tokens); ``pack_index``: ``[T]`` int64 flat ``n * L + j`` of each
            packed token.
    """

    def __init__(self, entries: list[StepEntry], slots: RecurrentSlots, device: torch.device) -> None:
        if not entries:
            raise ValueError("a continuous-batching step with no request")
        self.entries = entries
        self.store = slots
        lengths = [e.query_length for e in entries]
        self.N, self.L, self.T = len(entries), max(lengths), sum(lengths)
        starts, row_index, pack_index = [], [], []
        start = 0
        for n, q in enumerate(lengths):
            starts.append(start)
            row_index.extend(list(range(start, start + q)) + [0] * (self.L - q))
            pack_index.extend(range(n * self.L, n * self.L + q))
            start += q
        host = torch.tensor(
            [[e.slot for e in entries], [int(e.past_length == 0) for e in entries], lengths], dtype=torch.int64
        )
        big = torch.tensor([row_index, pack_index[: len(row_index)] + [0] * (len(row_index) - len(pack_index))])
        host_dev = host.to(device, non_blocking=True)
        big_dev = big.to(device, non_blocking=True)
        self.slots = host_dev[0]  # [N]
        self.fresh = host_dev[1].bool()  # [N]
        self.row_index = big_dev[0].view(self.N, self.L)  # [N, L]
        self.pack_index = big_dev[1, : self.T]  # [T]
        padded = any(q != self.L for q in lengths)
        self.mask = (torch.arange(self.L, device=device)[None, :] < host_dev[2][:, None]) if padded else None

    def __repr__(self) -> str:
        return f"ServingStep(N={self.N}, L={self.L}, T={self.T})"

    def unpack(self, packed: Tensor) -> Tensor:
        """``packed`` ``[1, T, ...]`` -> rows ``[N, L, ...]`` (pads hold the row's... first token; masked anyway)."""
        rows = packed[0].index_select(0, self.row_index.reshape(-1))  # [N * L, ...]
        return rows.view(self.N, self.L, *packed.shape[2:])

    def pack(self, rows: Tensor) -> Tensor:
        """rows ``[N, L, ...]`` -> ``[1, T, ...]`` in the packed order."""
        flat = rows.reshape(self.N * self.L, *rows.shape[2:])
        return flat.index_select(0, self.pack_index)[None]


class _LayerView:
    """What :func:`safepad.cache.read_states` asks a cache layer: whether it holds a previous state."""

    def __init__(self, has_previous: bool) -> None:
        self.has_previous_state = {0: has_previous} if has_previous else {}


class SlotRowsCache:
    """A cache whose row ``n`` is the slot of the step's request ``n`` (the interface the wrapped mixers use:
    ``get_conv_state`` / ``get_recurrent_state`` / ``update_conv_state`` / ``update_recurrent_state`` /
    ``layers[i].has_previous_state``). Reads gather the slots and zero the rows of fresh requests; writes scatter."""

    def __init__(self, step: ServingStep) -> None:
        self.step = step
        self.store = step.store

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

"""A fixed number of recurrent-state slots, one per request in flight, for continuous batching.

A request of a continuous-batching session (``model.generate_batch`` / ``ContinuousBatchingManager``) owns one slot
from the step its first tokens are scheduled until it finishes, is cancelled or is soft-reset by transformers'
offloading manager. The slot holds, for every recurrent layer, the states a cached call of that layer keeps: the
conv state ``[D, K]`` and the recurrent (SSM / delta-rule / RG-LRU) state, in one pool tensor per
``(layer, state kind, state index)`` of shape ``[S, ...]`` (``S`` slots), allocated on the first write of that layer
with the shape and dtype the mixer writes.

Bookkeeping (which request holds which slot) is on the host and never reads the device. A slot is not zeroed when it
is handed out: a step reads a request's slot as zeros whenever its chunk starts the sequence (``past_length == 0``;
:class:`safepad.serving.step.ServingStep`), on the device, in the forward itself, so a slot reused while an earlier
step still runs on the compute stream (asynchronous batching) is never raced.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

__all__ = ["RecurrentSlots"]


class RecurrentSlots:
    """``num_slots`` recurrent-state slots and the requests holding them.

    Args:
        num_slots: how many requests may hold a slot at once (requests beyond wait, as for a full KV cache).
        device: where the pools live (the model's device).
    """

    def __init__(self, num_slots: int, device: torch.device | str) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.device = torch.device(device)
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._owner: dict[str, int] = {}
        #: (layer_idx, kind, state_idx) -> [S, ...] pool; kind is "conv" or "recurrent"
        self.pools: dict[tuple[int, str, int], Tensor] = {}

    def __repr__(self) -> str:
        return f"RecurrentSlots(num_slots={self.num_slots}, held={len(self._owner)}, pools={len(self.pools)})"

    # ------------------------------------------------------------------ host bookkeeping

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot_of(self, request_id: str) -> int | None:
        """The slot ``request_id`` holds, or None."""
        return self._owner.get(request_id)

    def acquire(self, request_id: str) -> int:
        """The slot of ``request_id``, taking a free one if it holds none. Raises ``RuntimeError`` when none is free
        (callers check :attr:`num_free` first)."""
        slot = self._owner.get(request_id)
        if slot is not None:
            return slot
        if not self._free:
            raise RuntimeError(f"no free recurrent-state slot for request {request_id!r} ({self.num_slots} held)")
        slot = self._free.pop()
        self._owner[request_id] = slot
        return slot

    def release(self, request_id: str) -> None:
        """Give back the slot of ``request_id`` (no-op when it holds none)."""
        slot = self._owner.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def release_all(self) -> None:
        for request_id in list(self._owner):
            self.release(request_id)

    # ------------------------------------------------------------------ device pools

    def pool(self, layer_idx: int, kind: str, state_idx: int) -> Tensor | None:
        """The ``[S, ...]`` pool of one state, or None before that layer's first write."""
        return self.pools.get((layer_idx, kind, state_idx))

    def write(self, layer_idx: int, kind: str, state_idx: int, slots: Tensor, states: Tensor) -> None:
        """Store ``states`` ``[N, ...]`` in the slots ``slots`` ``[N]`` (int64, on the device; distinct)."""
        key = (layer_idx, kind, state_idx)
        pool = self.pools.get(key)
        if pool is None:
            pool = torch.zeros((self.num_slots, *states.shape[1:]), dtype=states.dtype, device=states.device)
            self.pools[key] = pool
            logger.debug("recurrent-state pool %s: %s %s", key, tuple(pool.shape), pool.dtype)
        elif pool.shape[1:] != states.shape[1:]:
            raise ValueError(
                f"layer {layer_idx} wrote a {kind} state of shape {tuple(states.shape[1:])}, but its slots hold "
                f"{tuple(pool.shape[1:])}: a mixer's state shape changed between continuous-batching steps"
            )
        pool.index_copy_(0, slots, states.to(pool.dtype))

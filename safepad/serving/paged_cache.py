"""transformers' paged attention cache for a hybrid model: paged keys / values for the attention layers only, and one
recurrent-state slot per request (:mod:`safepad.serving.slots`) for the others.

transformers 5.25's ``PagedAttentionCache`` groups *every* layer of ``config.layer_types`` into a per-attention-type
``CacheAllocator`` (``ATTN_TYPE_TO_ALLOCATOR``, continuous_batching/cache.py:43) and raises ``Invalid layer type`` for
any other type (cache.py:66). :class:`SafepadPagedCache` builds the parent on a view of the config that lists only
the layers that keep keys and values, and maps each attention layer's index to its place in that view
(:meth:`SafepadPagedCache.update`); the recurrent layers get slots instead of pages. It also tracks, per scheduled
step, which request sits where in the packed batch: the batch preparation asks the cache for each request's read /
write indices in the packed order (``extend_read_and_write_indices`` / ``fill_block_table``), which is where the
step's slot list is taken (:meth:`SafepadPagedCache.take_step`, called by the wrapped model's pre-hook).

Prefix sharing is off: a shared prefix's keys and values can be reused, but the recurrent state after that prefix is
not kept anywhere.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers.generation.continuous_batching.cache import PagedAttentionCache

from .slots import RecurrentSlots
from .step import ServingStep, StepEntry

logger = logging.getLogger(__name__)

__all__ = ["ATTENTION_LAYER_TYPES", "RECURRENT_LAYER_TYPES", "SafepadPagedCache", "kv_layer_indices"]

#: layer types whose keys and values transformers' paged cache allocates
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
#: layer types that keep no keys and values: recurrent layers (their state goes to a slot) and stateless MLP blocks
RECURRENT_LAYER_TYPES = ("linear_attention", "conv", "mamba", "mlp", "moe")


def kv_layer_indices(config: Any) -> list[int]:
    """The indices of the layers of ``config`` (a text config with ``layer_types``) that keep keys and values."""
    layer_types = list(getattr(config, "layer_types", None) or ())
    return [i for i, t in enumerate(layer_types) if t in ATTENTION_LAYER_TYPES]


class _KVConfigView:
    """``config`` as transformers' paged cache must see it: ``layer_types`` lists only the layers that keep keys and
    values (several configs compute ``layer_types`` in a property, so a copy cannot override it); every other
    attribute is the config's own."""

    def __init__(self, config: Any, kv_indices: list[int]) -> None:
        self._config = config
        self.layer_types = [config.layer_types[i] for i in kv_indices]
        self.num_hidden_layers = len(kv_indices)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def _kv_config(config: Any, kv_indices: list[int]) -> Any:
    """A view of ``config`` whose ``layer_types`` lists only the layers at ``kv_indices``."""
    return _KVConfigView(config, kv_indices)


class SafepadPagedCache(PagedAttentionCache):
    """A ``PagedAttentionCache`` for the attention layers of a hybrid, plus :class:`RecurrentSlots`.

    Args: those of ``PagedAttentionCache`` (``config`` is the model's text config, all its layers), and
        ``num_slots``: how many requests may be in flight at once (each holds one slot until it ends).
    """

    def __init__(self, config: Any, continuous_batching_config: Any, device: torch.device | str, *args: Any,
                 num_slots: int, **kwargs: Any) -> None:  # fmt: skip
        kv_indices = kv_layer_indices(config)
        if not kv_indices:
            raise ValueError(
                f"{getattr(config, 'model_type', 'this model')} has no attention layer: transformers' paged cache "
                "sizes itself by its attention layers (continuous_batching/cache.py PagedAttentionCache.__init__), so "
                "continuous batching cannot serve it; use model.generate with a padded batch instead"
            )
        self._kv_index = {layer: i for i, layer in enumerate(kv_indices)}
        super().__init__(_kv_config(config, kv_indices), continuous_batching_config, device, *args, **kwargs)
        self.config = config
        self.use_prefix_sharing = False  # the recurrent state after a shared prefix is kept nowhere
        self.slots = RecurrentSlots(num_slots, device)
        self._entries: list[StepEntry] = []

    # ------------------------------------------------------------------ attention: the parent, re-indexed

    def update(self, key_states, value_states, layer_idx: int, kwargs: dict):
        return super().update(key_states, value_states, self._kv_index[layer_idx], kwargs)

    def search_prefix_match(self, request_id: str, prompt_ids: list[int]) -> int:
        return 0

    # ------------------------------------------------------------------ request lifetime: a slot each

    def can_store_request_tokens(self, state, request_len: int, dry_run: bool = False) -> bool:
        """The parent's check, and a slot for a request that holds none (taken unless ``dry_run``)."""
        has_slot = self.slots.slot_of(state.request_id) is not None
        if not has_slot and self.slots.num_free == 0 and state.request_id:
            return False
        if not super().can_store_request_tokens(state, request_len, dry_run=dry_run):
            return False
        if not dry_run and not has_slot and state.request_id:
            if state.position_offset != 0:
                raise RuntimeError(
                    f"request {state.request_id!r} resumes at position {state.position_offset} without a recurrent "
                    "state (restored from a CPU offload or a prefix match); safepad's continuous batching keeps the "
                    "recurrent state on the device only: leave cpu_offload_space at 0 and block sharing off"
                )
            self.slots.acquire(state.request_id)
        return True

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        super().free_blocks(request_id, no_cache)
        self.slots.release(request_id)

    def free_all_requests(self, clear_ledgers: bool = False) -> None:
        super().free_all_requests(clear_ledgers)
        self.slots.release_all()
        self._entries = []

    def prepare_fork_request(self, src_state, dst_req_ids, copy_src_and_dst):
        raise NotImplementedError(
            "forking a request (num_return_sequences > 1) would copy its recurrent state; safepad's continuous "
            "batching does not do it yet: submit the prompt once per sequence instead"
        )

    # ------------------------------------------------------------------ the packed order of each step

    def _record(self, request_id: str, past_length: int, query_length: int) -> None:
        slot = self.slots.slot_of(request_id)
        if slot is None:
            raise RuntimeError(f"request {request_id!r} is scheduled without a recurrent-state slot")
        self._entries.append(StepEntry(request_id, slot, past_length, query_length))

    def extend_read_and_write_indices(self, request_id, past_length, query_length, read_index, write_index) -> None:
        super().extend_read_and_write_indices(request_id, past_length, query_length, read_index, write_index)
        self._record(request_id, past_length, query_length)

    def fill_block_table(self, request_id, past_length, query_length, block_table) -> None:
        super().fill_block_table(request_id, past_length, query_length, block_table)
        self._record(request_id, past_length, query_length)

    def take_step(self, num_tokens: int, device: torch.device) -> ServingStep:
        """The step the batch preparation just laid out (then forgotten). ``num_tokens``: the packed row's length,
        which must be the scheduled tokens (inputs padded for CUDA graphs or compile are refused upstream)."""
        entries, self._entries = self._entries, []
        step = ServingStep(entries, self.slots, device)
        if step.T != num_tokens:
            raise RuntimeError(
                f"the continuous-batching step holds {num_tokens} tokens but its requests scheduled {step.T}: padded "
                "inputs (CUDA graphs, compiled steps) are not supported with recurrent layers"
            )
        return step

"""Continuous batching of wrapped hybrid models (transformers' ``generate_batch`` / ``ContinuousBatchingManager``).

``safepad.wrap(model)`` makes ``model.generate_batch``, ``model.init_continuous_batching`` and
``model.continuous_batching_context_manager`` serve hybrids (attention + Mamba2 / Mamba1 / gated-delta / short-conv
layers): each request continues its own recurrent state, kept in a slot of its own (docs/inference.md).

Modules: ``slots`` (the slot pool), ``step`` (one step as rows of requests, the slot-backed cache view),
``paged_cache`` (transformers' paged cache for the attention layers plus the slots), ``mixer_call`` (a mixer's call
inside a step), ``manager`` (the manager and the ``init_continuous_batching`` of a wrapped model).
"""

from .manager import SafepadContinuousBatching, SafepadContinuousBatchingManager, check_servable
from .paged_cache import SafepadPagedCache
from .slots import RecurrentSlots
from .step import ServingStep, SlotRowsCache

__all__ = [
    "RecurrentSlots",
    "SafepadContinuousBatching",
    "SafepadContinuousBatchingManager",
    "SafepadPagedCache",
    "ServingStep",
    "SlotRowsCache",
    "check_servable",
]

"""Continuous batching (``model.generate_batch``, ``model.init_continuous_batching``, the context manager) for a
wrapped hybrid model.

:func:`safepad.wrap` sets ``model.init_continuous_batching`` to :class:`SafepadContinuousBatching` (an instance
attribute, removed by :func:`safepad.unwrap`); ``generate_batch`` and ``continuous_batching_context_manager`` reach
it through that attribute. It builds a :class:`SafepadContinuousBatchingManager`: transformers' manager, whose batch
processor gets a :class:`~safepad.serving.paged_cache.SafepadPagedCache` (paged keys / values for the attention
layers, one recurrent-state slot per request for the others) instead of a ``PagedAttentionCache``, which refuses
recurrent layer types (continuous_batching/cache.py:66).

What a session refuses, each with a ``ValueError`` naming why: a model without attention layers, a layer type or a
mixer kind this module does not serve, ``num_return_sequences > 1`` (a fork would copy the recurrent state), CPU
offloading (``cpu_offload_space > 0``: the restored request would lack its state), CUDA graphs and compiled steps
(the slot indices of a step are built by the host for each step; a replayed graph would reuse stale ones),
asynchronous batching (not checked), and a transformers release outside 5.23-5.25 (whose batch processor this
module builds as they do).
"""

from __future__ import annotations

import copy
import logging
import threading
from typing import Any

import transformers
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import cache as cb_cache
from transformers.generation.continuous_batching import continuous_api as cb_api

from ..wrap.attention import UPCAST_SDPA, upcast_needed
from .mixer_call import SERVED_KINDS
from .paged_cache import ATTENTION_LAYER_TYPES, RECURRENT_LAYER_TYPES, SafepadPagedCache, kv_layer_indices

logger = logging.getLogger(__name__)

__all__ = ["SafepadContinuousBatching", "SafepadContinuousBatchingManager", "check_servable"]

#: the transformers minor releases whose batch-processor construction (``_create_batch_processor``,
#: ``init_continuous_batching``) this module follows: identical in 5.23 and 5.25, both run by the tests
SERVED_TRANSFORMERS = ("5.23", "5.24", "5.25")


class _RecurrentLayers:
    """Stands in ``ATTN_TYPE_TO_ALLOCATOR`` for the recurrent layer types while a safepad manager resolves its config
    (``ensure_decode_fast_path_is_available`` asks every layer type whether it supports block tables; recurrent
    layers hold no pages, so they leave that to the attention layers). Never instantiated."""

    supports_block_table = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # pragma: no cover - guard
        raise TypeError("safepad's recurrent layers are served by SafepadPagedCache, not by a CacheAllocator")


_REGISTRY_LOCK = threading.Lock()


def _text_config(model: Any) -> Any:
    return model.config.get_text_config()


def check_servable(model: Any) -> None:
    """Raise ``ValueError`` naming why ``model`` (wrapped) cannot be served by continuous batching; else None."""
    version = ".".join(transformers.__version__.split(".")[:2])
    if version not in SERVED_TRANSFORMERS:
        raise ValueError(
            f"safepad's continuous batching builds transformers' batch processor as transformers "
            f"{SERVED_TRANSFORMERS[0]}-{SERVED_TRANSFORMERS[-1]} do; transformers {transformers.__version__} is "
            "installed: pip install 'transformers>=5.23,<5.26'"
        )
    config = _text_config(model)
    model_type = getattr(config, "model_type", type(model).__name__)
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        raise ValueError(
            f"{model_type}: its config has no layer_types, so transformers' paged cache cannot tell its attention "
            "layers from its recurrent ones; continuous batching is not available for it (use model.generate)"
        )
    unknown = sorted({t for t in layer_types if t not in ATTENTION_LAYER_TYPES + RECURRENT_LAYER_TYPES})
    if unknown:
        raise ValueError(
            f"{model_type}: layer types {unknown} are neither attention types transformers' paged cache pages "
            f"({', '.join(ATTENTION_LAYER_TYPES)}) nor layers without keys / values ({', '.join(RECURRENT_LAYER_TYPES)}); "
            "a layer that holds keys / values next to a recurrent state, or indexed attention, is not served: "
            "continuous batching is not available for it (use model.generate)"
        )
    if not kv_layer_indices(config):
        raise ValueError(
            f"{model_type} has no attention layer: transformers' paged cache sizes itself by its attention layers "
            "(continuous_batching/cache.py PagedAttentionCache.__init__), so continuous batching cannot serve it; "
            "use model.generate with a padded batch instead"
        )
    if getattr(config, "kv_lora_rank", None) is not None and not hasattr(cb_cache, "MLACacheAllocator"):
        raise ValueError(
            f"{model_type}: its attention is multi-head latent attention (kv_lora_rank), which the paged cache of "
            f"transformers {transformers.__version__} cannot hold (its MLA allocator came in 5.25: "
            "continuous_batching/cache_allocators/compressed_latents.py): pip install 'transformers>=5.25,<5.26'"
        )
    if upcast_needed(model):
        raise ValueError(
            f"{model_type}: a {next(model.parameters()).dtype} model on the CPU runs its attention in float64 under "
            f"safepad (\"{UPCAST_SDPA}\", so that a one-query decode step rounds like the full forward), which "
            "transformers' continuous batching does not take; serve it in float32 on the CPU (model.float()) or in "
            "half precision on a CUDA device"
        )
    for name, module in model.named_modules():
        spec = getattr(module, "_safepad_spec", None)
        if spec is not None and spec.kind not in SERVED_KINDS:
            raise ValueError(
                f"{model_type}: its {spec.kind} mixer ({name}) is not served by safepad's continuous batching "
                f"(served kinds: {', '.join(SERVED_KINDS)})"
            )


def _check_cb_config(cb_config: ContinuousBatchingConfig) -> ContinuousBatchingConfig:
    """A copy of ``cb_config`` with accelerator graphs off (unless the caller asked for them: raises)."""
    cb_config = copy.deepcopy(cb_config)
    if cb_config.use_cuda_graph not in (None, False, (False, False)):
        raise ValueError(
            "use_cuda_graph: a replayed graph would reuse the recurrent-state slots of the step it captured; "
            "safepad's continuous batching runs without accelerator graphs (leave use_cuda_graph unset or False)"
        )
    if cb_config.q_padding_interval_size or cb_config.kv_padding_interval_size:
        raise ValueError(
            "q_padding_interval_size / kv_padding_interval_size pad the packed batch for accelerator graphs, which "
            "safepad's continuous batching does not use: leave them unset"
        )
    if getattr(cb_config, "varlen_compile_config", None) is not None or getattr(
        cb_config, "decode_compile_config", None
    ) is not None:
        raise ValueError(
            "compiled continuous-batching steps pad their inputs and fix the step's slots at trace time; safepad's "
            "continuous batching runs them eagerly: leave varlen_compile_config / decode_compile_config unset"
        )
    if cb_config.use_async_batching:
        raise ValueError(
            "use_async_batching=True: asynchronous batching prepares a step while the previous one runs, which "
            "safepad's continuous batching has not been checked with; leave use_async_batching unset or False"
        )
    if cb_config.cpu_offload_space:
        raise ValueError(
            f"cpu_offload_space={cb_config.cpu_offload_space}: a request restored from the CPU would resume without "
            "its recurrent state, which stays on the device; leave cpu_offload_space at 0 (a request the cache "
            "cannot hold is then re-prefilled from its tokens)"
        )
    cb_config.use_cuda_graph = False
    return cb_config


class SafepadContinuousBatchingManager(cb_api.ContinuousBatchingManager):
    """transformers' ``ContinuousBatchingManager`` whose cache is a :class:`SafepadPagedCache`."""

    def __init__(
        self,
        model: Any,
        generation_config: Any,
        continuous_batching_config: ContinuousBatchingConfig,
        workload_hints: Any = None,
    ) -> None:
        check_servable(model)
        num_return = getattr(generation_config, "num_return_sequences", None) or 1
        if num_return > 1:
            raise ValueError(
                f"num_return_sequences={num_return}: transformers forks a request's cache after its prefill, which "
                "would have to copy its recurrent state; safepad's continuous batching does not: submit the prompt "
                "once per sequence (a different request_id each)"
            )
        cb_config = _check_cb_config(continuous_batching_config)
        layer_types = set(_text_config(model).layer_types) - set(ATTENTION_LAYER_TYPES)
        with _REGISTRY_LOCK:  # resolve asks ATTN_TYPE_TO_ALLOCATOR about every layer type (initialization.py:135)
            added = [t for t in layer_types if t not in cb_cache.ATTN_TYPE_TO_ALLOCATOR]
            for t in added:
                cb_cache.ATTN_TYPE_TO_ALLOCATOR[t] = _RecurrentLayers
            try:
                super().__init__(model, generation_config, cb_config, workload_hints)
            finally:
                for t in added:
                    cb_cache.ATTN_TYPE_TO_ALLOCATOR.pop(t, None)
        resolved = self.continuous_batching_config
        if any(resolved.cuda_graph_booleans) or resolved.varlen_compile_config or resolved.decode_compile_config:
            raise ValueError(
                "the resolved continuous-batching config turned on accelerator graphs or compiled steps (from the "
                "model's compile_config?); safepad's continuous batching runs eagerly: pass a ContinuousBatchingConfig "
                "that leaves them off"
            )

    def _create_batch_processor(self) -> cb_api.ContinuousBatchProcessor:
        """transformers 5.23-5.25's ``ContinuousBatchingManager._create_batch_processor`` with a :class:`SafepadPagedCache`
        (one slot per request the batch may hold: ``max_requests_per_batch``)."""
        batch_processor = getattr(self, "batch_processor", None)
        if isinstance(batch_processor, cb_api.ContinuousBatchProcessor):
            batch_processor.reset()
            return batch_processor
        cb_config = self.continuous_batching_config
        supports_logits_to_keep = getattr(self.model, "_supports_logits_to_keep", None)
        cache = SafepadPagedCache(
            config=self.model.config.get_text_config(),
            continuous_batching_config=cb_config,
            device=self.model.device,
            distributed_helper=self.distributed_helper,
            dtype=self.model.dtype,
            model_supports_logits_to_keep=callable(supports_logits_to_keep) and supports_logits_to_keep(),
            num_slots=cb_config.max_requests_per_batch,
        )
        self._use_prefix_sharing = cache.use_prefix_sharing
        cb_api.update_cb_config_after_cache_creation(
            cb_config=cb_config, num_blocks=cache.num_blocks, max_batch_tokens=cache.max_batch_tokens
        )
        if cb_api.SLIDING_ATTENTION in cache.cache_allocators:
            cb_config.max_blocks_per_request = 0
        scheduler_cls = cb_api.SCHEDULER_MAPPING.get(cb_config.scheduler_type, None)
        if scheduler_cls is None:
            logger.warning("Scheduler %r not found. Defaulting to FIFO.", cb_config.scheduler_type)
            scheduler_cls = cb_api.FIFOScheduler
        scheduler = scheduler_cls(
            cache=cache, safety_margin=cb_config.safety_margin, max_requests_per_batch=cb_config.max_requests_per_batch
        )
        return cb_api.ContinuousBatchProcessor(
            cache=cache,
            config=self.model.config.get_text_config(),
            generation_config=self.generation_config,
            continuous_batching_config=cb_config,
            logit_processor=self.logit_processor,
            input_queue=self.input_queue if self.is_tp_driver else None,
            cancel_queue=self.cancel_queue if self.is_tp_driver else None,
            output_router=self.output_router,
            background_thread_status=self.background_thread_status,
            model_device=self.model.device,
            model_dtype=self.model.dtype,
            scheduler=scheduler,
            distributed_helper=self.distributed_helper,
        )


class SafepadContinuousBatching:
    """``model.init_continuous_batching`` of a wrapped model: transformers' ``ContinuousMixin.init_continuous_batching``
    building a :class:`SafepadContinuousBatchingManager`. ``generate_batch`` and the context manager call it."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __repr__(self) -> str:
        return f"SafepadContinuousBatching({type(self.model).__name__})"

    def __call__(
        self,
        generation_config: Any = None,
        continuous_batching_config: ContinuousBatchingConfig | None = None,
        workload_hints: Any = None,
    ) -> cb_api.ContinuousBatchingManager:
        model = self.model
        cached = getattr(model, "_cached_continuous_batching_manager", None)
        if isinstance(cached, SafepadContinuousBatchingManager):
            cached.switch_to_cb_friendly_attn(model, cached.continuous_batching_config.auto_switch_to_flash)
            return cached
        gen_config = generation_config if generation_config is not None else model.generation_config
        if gen_config is None:
            raise ValueError("A GenerationConfig must be provided or set in the model.")
        if gen_config.eos_token_id is None:
            logger.warning("`eos_token_id` not set in GenerationConfig. Setting to -1 (disabled).")
            gen_config.eos_token_id = -1
        if continuous_batching_config is None:
            continuous_batching_config = getattr(gen_config, "continuous_batching_config", None)
            if not isinstance(continuous_batching_config, ContinuousBatchingConfig):
                continuous_batching_config = ContinuousBatchingConfig()
        return SafepadContinuousBatchingManager(
            model=model,
            generation_config=gen_config,
            continuous_batching_config=continuous_batching_config,
            workload_hints=workload_hints,
        )

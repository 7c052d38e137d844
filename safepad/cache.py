"""One adapter between safepad's mixers and transformers' recurrent cache layers.

transformers 5.x keeps a recurrent layer's states in ``cache.layers[layer_idx]`` (``LinearAttentionLayer``):
``conv_states[i]`` ``[B, D, K]`` (the last K conv inputs, oldest first) and ``recurrent_states[i]`` (the
SSM / delta-rule state). The stock cache layer never sees the padding mask, so safepad computes the final
states itself and writes them whole through :func:`write_states`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

__all__ = ["CachedStates", "read_states", "write_states"]


@dataclass
class CachedStates:
    """States of one layer before this call: ``None`` when the cache holds nothing yet (first prefill)."""

    conv: Tensor | None
    recurrent: Tensor | None

    @property
    def has_previous(self) -> bool:
        return self.conv is not None or self.recurrent is not None


def _check_cache(cache, layer_idx: int) -> None:
    if not hasattr(cache, "get_conv_state"):
        raise ValueError(
            f"safepad expected a transformers Cache with recurrent layers (DynamicCache(config=...)), got "
            f"{type(cache).__name__}"
        )
    if hasattr(cache, "is_recording_past") and cache.is_recording_past(layer_idx):
        raise ValueError(
            "the cache records past states for rollback (assisted / speculative generation); safepad-wrapped "
            "recurrent layers do not support cache cropping yet: unwrap the model for assisted generation"
        )


def read_states(cache, layer_idx: int, state_idx: int = 0, *, conv: bool = True, recurrent: bool = True) -> CachedStates:
    """The layer's cached conv / recurrent states, or ``None`` for each one that holds no previous state."""
    if cache is None:
        return CachedStates(None, None)
    _check_cache(cache, layer_idx)
    c = cache.get_conv_state(layer_idx, state_idx=state_idx) if conv else None
    r = cache.get_recurrent_state(layer_idx, state_idx=state_idx) if recurrent else None
    layer = cache.layers[layer_idx]
    has_prev = bool(getattr(layer, "has_previous_state", {}).get(state_idx, c is not None))
    if not has_prev:
        return CachedStates(None, None)
    return CachedStates(c, r)


def write_states(
    cache, layer_idx: int, *, conv: Tensor | None = None, recurrent: Tensor | None = None, state_idx: int = 0
) -> None:
    """Store the layer's new states, replacing the old ones.

    ``conv`` ``[B, D, K]`` must hold exactly the cache's K columns (the last K real inputs, oldest first);
    transformers' ``update_conv_state`` then stores it as is on prefill and, on a continuation, keeps the last
    K columns of ``[old ‖ conv]``, which is ``conv`` itself.
    """
    if cache is None:
        return
    if conv is not None:
        cache.update_conv_state(conv, layer_idx, state_idx=state_idx, conv_kernel_size=conv.shape[-1])
    if recurrent is not None:
        cache.update_recurrent_state(recurrent, layer_idx, state_idx=state_idx)

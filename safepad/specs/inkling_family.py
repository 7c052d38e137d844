"""Specs for Inkling / Inkling2 / Inkling2-Loop: short convolutions inside attention and on the residual stream.

One spec per text model type; it claims both the static (depthwise) and, for Inkling2, the dynamic (per-token
taps) short convolution classes, served by :func:`safepad.mixers.attn_conv.attention_conv_forward`. The
multimodal wrappers (``inkling_mm_model``, ``inkling2``, ``inkling2_loop``) hold the same classes.
"""

from __future__ import annotations

from types import MappingProxyType

import torch
from torch import nn

from .._config import text_config_value
from .._tracing import device_check, tracing

from ..mixers.attn_conv import attention_conv_forward
from .registry import MixerSpec, register

__all__ = ["INKLING_FAMILY", "check_slot_log_scaling"]


def check_slot_log_scaling(module: nn.Module, layout: torch.Tensor) -> None:
    """Inkling's log scaling takes each query's scale from its slot (``tau(slot + 1)``), not its position.

    ``layout`` ``[B, N]`` bool: the slots the call's queries and keys occupy (True = real). Exact unless a real
    token after a pad sits past the floor (``tau`` is 1 up to it); raise there.
    """
    floor = text_config_value(module, "log_scaling_n_floor")
    if floor is None or layout.shape[1] <= floor:
        return
    slots = torch.arange(layout.shape[1], device=layout.device)[None]  # [1, N]
    after_pad = (~layout).cumsum(1) > 0  # [B, N]
    bad = layout & after_pad & (slots + 1 > floor)

    def message(row: str) -> str:
        return (
            f"{type(module).__name__}: log-scaled attention (log_scaling_n_floor={floor}) scales each query by its "
            f"cache slot, and {row} has real tokens past slot {floor} with pads before them, so its slots run "
            "ahead of its positions there: those queries would be scaled wrong. Keep padded batches shorter than "
            "the floor, or run such rows without padding."
        )

    if tracing():  # a compiled call (safepad.wrap.traced_slot_calls.traced_slot_step): checked on the device
        device_check(
            ~bad.any(),
            f"{type(module).__name__}: real tokens past slot {floor} (log_scaling_n_floor) after pads get wrong "
            "query scales; keep padded batches shorter (docs/limits.md, check D7)",
        )
    elif bool(bad.any()):
        raise ValueError(message(f"row {int(bad.any(1).nonzero()[0])}"))


def _spec(model_type: str, classes: tuple[str, ...], scale, description: str, slot_log_scaling: bool = False) -> MixerSpec:
    # relative positions (and sliding windows) count cache slots: every family's cached calls keep each row's real
    # tokens contiguous at the end of the cache (safepad.layout.slots). Inkling's log scaling reads query slots
    # too (Inkling2's reads position_ids): refuse the layouts it cannot serve
    slot_check = {"slot_check": check_slot_log_scaling} if slot_log_scaling else {}
    # Inkling2's relative position bias reads slot distances (get_relative_distance), not position_ids: a call
    # without a cache on rows with holes (a pad between real tokens) is re-laid too (safepad.wrap.slot_calls)
    uncached = {} if slot_log_scaling else {"slot_distances": True}
    return MixerSpec(
        model_type=model_type,
        kind="attn_conv",
        mixer_classes=classes,
        forward=attention_conv_forward,
        options=MappingProxyType(
            {
                "residual_scale": scale,
                # the dynamic class has no conv1d child: no accelerate hook forcing
                "accelerate_children": (),
                **slot_check,
                **uncached,
            }
        ),
        hybrid=True,
        description=description,
    )


INKLING_FAMILY = tuple(
    register(s)
    for s in (
        _spec(
            "inkling_text", ("InklingShortConvolution",), 1.0, "static short convs (residual, no scale)",
            slot_log_scaling=True,
        ),
        _spec(
            "inkling2_text",
            ("Inkling2ShortConvolution", "Inkling2DynamicShortConvolution"),
            "sqrt_k1",
            "static short convs (residual / sqrt(K + 1)) and per-token-tap key/value convs",
        ),
        _spec(
            "inkling2_loop_text",
            ("Inkling2LoopShortConvolution", "Inkling2LoopDynamicShortConvolution"),
            "sqrt_k1",
            "as inkling2_text, with looped layers (cache_offset)",
        ),
    )
)

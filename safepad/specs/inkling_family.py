"""Specs for Inkling / Inkling2 / Inkling2-Loop: short convolutions inside attention and on the residual stream.

One spec per text model type; it claims both the static (depthwise) and, for Inkling2, the dynamic (per-token
taps) short convolution classes, served by :func:`safepad.mixers.attn_conv.attention_conv_forward`. The
multimodal wrappers (``inkling_mm_model``, ``inkling2``, ``inkling2_loop``) hold the same classes.
"""

from __future__ import annotations

from types import MappingProxyType

from ..mixers.attn_conv import attention_conv_forward
from .registry import MixerSpec, register

__all__ = ["INKLING_FAMILY"]


def _spec(model_type: str, classes: tuple[str, ...], scale, description: str, slot_log_scaling: bool = False) -> MixerSpec:
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
                # relative positions (and sliding windows) counted in cache slots: cached calls keep each row's
                # real tokens contiguous at the end of the cache (safepad.layout.slots)
                "slot_positions": True,
                # Inkling's log scaling reads query slots too (Inkling2's reads position_ids)
                "slot_log_scaling": slot_log_scaling,
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

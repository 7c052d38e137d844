"""Specs for the gated-delta-rule family (Qwen3-Next, OLMo-Hybrid, Kimi-Linear) and LFM2's short conv.

All four are hybrids (linear-attention / conv layers interleaved with full attention). Their model forwards
pass ``position_ids`` to ``create_causal_mask``, so the restarting ``position_ids`` safepad synthesises for
packed calls (``hybrid=True``) are enough for their attention layers to keep packed sequences apart.
"""

from __future__ import annotations

from types import MappingProxyType

from ..mixers.gated_delta import gated_delta_mixer_forward
from ..mixers.short_conv import short_conv_mixer_forward
from .registry import MixerSpec, register

__all__ = ["GDN_FAMILY", "SHORT_CONV_FAMILY"]


def _gdn(model_type: str, cls: str, options: dict, description: str) -> MixerSpec:
    return MixerSpec(
        model_type=model_type,
        kind="gated_delta",
        mixer_classes=(cls,),
        forward=gated_delta_mixer_forward,
        options=MappingProxyType(options),
        hybrid=True,
        description=description,
    )


GDN_FAMILY = tuple(
    register(s)
    for s in (
        _gdn(
            "qwen3_next",
            "Qwen3NextGatedDeltaNet",
            {"qkv": "qkvz_ba", "beta": None, "decay": "mamba", "decay_proj": None, "gate": None},
            "fused in_proj_qkvz / in_proj_ba regrouped per key head; z gates the output norm",
        ),
        _gdn(
            "olmo_hybrid",
            "OlmoHybridGatedDeltaNet",
            {
                "qkv": "separate",
                "beta": "b_proj",
                "beta_scale_flag": "allow_neg_eigval",
                "decay": "mamba",
                "decay_proj": "a_proj",
                "gate": ("g_proj",),
                "norm": "o_norm",
                "out": "o_proj",
            },
            "separate q/k/v/a/b projections, g_proj output gate, beta doubled with allow_neg_eigval",
        ),
        _gdn(
            "kimi_linear",
            "KimiLinearDeltaAttention",
            {
                "qkv": "separate",
                "beta": "b_proj",
                "decay": "module",
                "decay_module": "forget_gate",
                "gate": ("g_a_proj", "g_b_proj"),
                "norm": "o_norm",
                "out": "o_proj",
                "key_dim": "qkv_dim",
                "key_head_dim": "head_dim",
                "value_head_dim": "head_dim",
            },
            "Kimi Delta Attention: per-key-channel decay from forget_gate, low-rank sigmoid output gate",
        ),
    )
)

SHORT_CONV_FAMILY = (
    register(
        MixerSpec(
            model_type="lfm2",
            kind="short_conv",
            mixer_classes=("Lfm2ShortConv",),
            forward=short_conv_mixer_forward,
            options=MappingProxyType({"accelerate_children": ("conv",), "activation": None}),
            hybrid=True,
            description="gated depthwise short conv (conv state only)",
        )
    ),
)

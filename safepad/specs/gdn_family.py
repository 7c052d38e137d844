"""Specs for the gated-delta-rule family (Qwen3-Next, Qwen3.5 / MoE, LaraMini, OLMo-Hybrid, Kimi-Linear and the
Kimi-style KDA of Bailing-Hybrid) and the short conv of LFM2, LFM2-MoE and LFM3.

All are hybrids (linear-attention / conv layers interleaved with full attention). Their model forwards
pass ``position_ids`` to ``create_causal_mask``, so the restarting ``position_ids`` safepad synthesises for
packed calls (``hybrid=True``) are enough for their attention layers to keep packed sequences apart.
"""

from __future__ import annotations

from types import MappingProxyType

from ..mixers.gated_delta import gated_delta_mixer_forward
from ..mixers.short_conv import short_conv_mixer_forward
from .registry import MixerSpec, register

__all__ = ["GDN_FAMILY", "KDA_OPTIONS", "SHORT_CONV_FAMILY"]


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


#: Qwen3.5 (dense and MoE): fused ``[q | k | v]`` projection, separate z / b / a projections.
_QWEN3_5 = {
    "qkv": ("in_proj_qkv",),
    "beta": "in_proj_b",
    "decay": "mamba",
    "decay_proj": "in_proj_a",
    "gate": ("in_proj_z",),
}

#: Qwen3.5's text model reads row 0 of ``[4, B, T]`` position_ids as its text positions (its attention mask), so
#: a packed call's ``[3, B, T]`` / ``[1, B, T]`` RoPE rows get a text row restarting at each boundary
#: (``safepad.wrap.hooks``).
_QWEN3_5_TEXT = {**_QWEN3_5, "text_position_rows": (4,)}

#: Kimi Delta Attention (kimi_linear): separate q/k/v, per-key-channel decay module, low-rank gate.
KDA_OPTIONS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "beta": "b_proj",
    "decay": "module",
    "decay_module": "forget_gate",
    "gate": ("g_a_proj", "g_b_proj"),
    "norm": "o_norm",
    "out": "o_proj",
    "key_dim": "qkv_dim",
    "key_head_dim": "head_dim",
    "value_head_dim": "head_dim",
}

GDN_FAMILY = tuple(
    register(s)
    for s in (
        _gdn(
            "qwen3_next",
            "Qwen3NextGatedDeltaNet",
            {"qkv": "qkvz_ba", "beta": None, "decay": "mamba", "decay_proj": None, "gate": None, "router_loss_mask": True},
            "fused in_proj_qkvz / in_proj_ba regrouped per key head; z gates the output norm",
        ),
        _gdn("qwen3_5", "Qwen3_5GatedDeltaNet", _QWEN3_5_TEXT, "fused qkv projection; z / b / a projected separately"),
        _gdn(
            "qwen3_5_moe",
            "Qwen3_5MoeGatedDeltaNet",
            {**_QWEN3_5_TEXT, "router_loss_mask": True},  # Qwen3_5MoeForCausalLM: aux loss reads attention_mask
            "as qwen3_5 (MoE feed-forward)",
        ),
        _gdn("lara_mini", "LaraMiniGatedDeltaNet", _QWEN3_5, "as qwen3_5 (transformers 5.24; MoE, sliding attention)"),
        _gdn(
            "olmo_hybrid",
            "OlmoHybridGatedDeltaNet",
            {
                "qkv": ("q_proj", "k_proj", "v_proj"),
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
            KDA_OPTIONS,
            "Kimi Delta Attention: per-key-channel decay from forget_gate, low-rank sigmoid output gate",
        ),
        _gdn(
            "bailing_hybrid",
            "BailingHybridDeltaAttention",
            {**KDA_OPTIONS, "gate": ("g_proj",)},
            "Kimi Delta Attention with a one-projection sigmoid output gate and a bounded forget gate",
        ),
    )
)

def _short_conv(model_type: str, cls: str, description: str) -> MixerSpec:
    return MixerSpec(
        model_type=model_type,
        kind="short_conv",
        mixer_classes=(cls,),
        forward=short_conv_mixer_forward,
        options=MappingProxyType({"accelerate_children": ("conv",), "activation": None}),
        hybrid=True,
        description=description,
    )


SHORT_CONV_FAMILY = tuple(
    register(s)
    for s in (
        _short_conv("lfm2", "Lfm2ShortConv", "gated depthwise short conv (conv state only)"),
        _short_conv("lfm2_moe", "Lfm2MoeShortConv", "as lfm2 (MoE feed-forward)"),
        _short_conv("lfm3", "Lfm3ShortConv", "as lfm2 (sliding + full attention, gated attention)"),
    )
)

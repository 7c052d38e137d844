"""Tiny, in-memory models of every supported family (no download), with visible SSM contributions.

A randomly initialised tiny model hides padding and packing bugs: the mixer output is small next to the
residual stream, so a corrupted state moves the logits by less than 1e-4. :func:`strengthen_mixers`
re-initialises every sequence mixer's projections (std ≈ 0.3) and short convolution (std ≈ 0.5) so that the
mixers dominate the logits, which stay finite and O(1–10).

Every tiny config uses hidden size 64, vocab 256, 2–4 layers, at least one SSM / linear-attention layer and,
for hybrids, at least one attention layer. Mamba2-family configs use 8 heads of dim 16, ``n_groups = 2`` and
``chunk_size = 16`` so that chunk boundaries fall inside the test sequences.
"""

from __future__ import annotations

import copy
import logging
import re
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = [
    "CACHE_PARAMS_FAMILIES",
    "EXTRA_FAMILIES",
    "FAMILIES",
    "FAMILY_MIN_TRANSFORMERS",
    "GDN_FAMILIES",
    "MAMBA1_FAMILIES",
    "MAMBA2_FAMILIES",
    "MODEL_TYPE_FAMILIES",
    "NEW_FAMILIES",
    "UNSUPPORTED_TINY_FAMILIES",
    "family_available",
    "family_names",
    "find_mixers",
    "strengthen_mixers",
    "tiny_config",
    "tiny_model",
]

#: Mamba2 / SSD mixers (multi-head scan with ``time_step_limit``).
MAMBA2_FAMILIES: tuple[str, ...] = ("nemotron_h", "mamba2", "bamba", "falcon_h1", "granitemoehybrid", "zamba2")
#: Mamba1 selective-scan mixers.
MAMBA1_FAMILIES: tuple[str, ...] = ("jamba", "mamba", "falcon_mamba")
#: Gated-DeltaNet-style linear attention (plus lfm2's short convolution).
GDN_FAMILIES: tuple[str, ...] = ("qwen3_next", "lfm2", "olmo_hybrid", "kimi_linear")
#: Families whose top-level forward takes the cache as ``cache_params=`` instead of ``past_key_values=``.
CACHE_PARAMS_FAMILIES: tuple[str, ...] = ("mamba", "mamba2", "falcon_mamba")

FAMILIES: tuple[str, ...] = MAMBA2_FAMILIES + MAMBA1_FAMILIES + GDN_FAMILIES
#: Further text-model families with a tiny config (variants of the GDN / short-conv mixers above), not in
#: :data:`FAMILIES` so that the 13-family matrix stays the reference set.
EXTRA_FAMILIES: tuple[str, ...] = ("qwen3_5_text", "qwen3_5_moe_text", "lfm2_moe")

_COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_ATTN: dict[str, Any] = {"num_attention_heads": 4, "num_key_value_heads": 2}
# Mamba2 mixer sizes: expand 2 -> intermediate 128 = 8 heads x 16; 2 groups of state 16; chunk 16; conv 4.
_MAMBA2_HF = {
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_n_groups": 2,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 16,
}

# Qwen3-Next / Qwen3.5 gated-delta hybrids: 2 key heads, 4 value heads of dim 16; MoE variants add 4 experts.
_QWEN_GDN: dict[str, Any] = {
    **_ATTN,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
_QWEN_MOE: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
}

_TINY: dict[str, dict[str, Any]] = {
    "nemotron_h": {
        **_ATTN,
        "layers_block_type": ["mamba", "attention", "mamba", "mlp"],
        "head_dim": 16,
        "intermediate_size": 128,
        "ssm_state_size": 16,
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "n_groups": 2,
        "chunk_size": 16,
        "conv_kernel": 4,
        "expand": 2,
    },
    "mamba2": {
        "num_hidden_layers": 2,
        "num_heads": 8,
        "head_dim": 16,
        "state_size": 16,
        "n_groups": 2,
        "chunk_size": 16,
        "conv_kernel": 4,
        "expand": 2,
    },
    "bamba": {**_ATTN, **_MAMBA2_HF, "intermediate_size": 128, "num_hidden_layers": 3, "attn_layer_indices": [1]},
    "falcon_h1": {
        **_ATTN,
        **_MAMBA2_HF,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "head_dim": 16,
        "mamba_d_ssm": 128,
    },
    "granitemoehybrid": {
        **_ATTN,
        **_MAMBA2_HF,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "layer_types": ["mamba", "attention", "mamba"],
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 64,
    },
    "zamba2": {
        "num_hidden_layers": 3,
        "layers_block_type": ["mamba", "hybrid", "mamba"],
        "hybrid_layer_ids": [1],
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_ngroups": 2,
        "n_mamba_heads": 8,
        "chunk_size": 16,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "adapter_rank": 8,
    },
    "jamba": {
        **_ATTN,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_experts": 1,
        "expert_layer_period": 1,
        "expert_layer_offset": 0,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_dt_rank": 8,
    },
    "mamba": {
        "num_hidden_layers": 2,
        "state_size": 16,
        "expand": 2,
        "conv_kernel": 4,
        "time_step_rank": 8,
        "intermediate_size": 128,
    },
    "falcon_mamba": {
        "num_hidden_layers": 2,
        "state_size": 16,
        "expand": 2,
        "conv_kernel": 4,
        "time_step_rank": 8,
        "intermediate_size": 128,
    },
    "qwen3_next": {**_QWEN_GDN, **_QWEN_MOE},
    "lfm2": {
        **_ATTN,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "layer_types": ["conv", "full_attention"],
        "block_auto_adjust_ff_dim": False,
    },
    "olmo_hybrid": {
        **_ATTN,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
    },
    "qwen3_5_text": dict(_QWEN_GDN),
    "qwen3_5_moe_text": {**_QWEN_GDN, **_QWEN_MOE},
    "lfm2_moe": {
        **_ATTN,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "layer_types": ["conv", "full_attention"],
        "num_dense_layers": 1,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    },
    "kimi_linear": {
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"],
        "mlp_layer_types": ["dense", "sparse"],
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "qk_nope_head_dim": 16,
        "qk_head_dim": 24,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_token": 2,
        "linear_head_dim": 16,
        "linear_num_heads": 4,
        "linear_conv_kernel_dim": 4,
    },
}


# --------------------------------------------------------------------------------------------------------------
# Families added for transformers 5.23-5.24 (new entries; the reference matrix above is unchanged).
# --------------------------------------------------------------------------------------------------------------

#: Further families with a tiny config: Mamba1 multi-head (zamba), short conv (lfm3), Gated DeltaNet (lara_mini),
#: Kimi Delta Attention (bailing_hybrid) and VLM wrappers whose language model is a supported family.
NEW_FAMILIES: tuple[str, ...] = (
    "zamba",
    "lfm3",
    "lara_mini",
    "bailing_hybrid",
    "lfm2_vl",
    "lfm3_vl",
    "nemotron_h_omni",
    "inkling_text",
    "inkling2_text",
    "inkling2_loop_text",
    "zaya",
    "recurrent_gemma",
    "qwen4_exp_text",
    "qwen4_exp",
    "glm5_next",
)
#: Tiny configs of recurrent families safepad does not support (see ``safepad/specs/unsupported.py``), for the
#: guard's tests: ``tiny_model`` builds them, ``safepad.wrap`` refuses them.
UNSUPPORTED_TINY_FAMILIES: tuple[str, ...] = ("minimax",)
#: the transformers release each family first appears in (families absent from the installed one cannot be built)
FAMILY_MIN_TRANSFORMERS: dict[str, str] = {"lara_mini": "5.24.0", "inkling2_loop_text": "5.24.0"}
#: auto class building each family (default ``AutoModelForCausalLM``): VLM wrappers are image-text-to-text models
_AUTO_CLASS: dict[str, str] = {
    "glm5_next": "AutoModelForImageTextToText",
    "lfm2_vl": "AutoModelForImageTextToText",
    "lfm3_vl": "AutoModelForImageTextToText",
    "nemotron_h_omni": "AutoModelForImageTextToText",
    "qwen4_exp": "AutoModelForImageTextToText",
}

_LFM3_TEXT: dict[str, Any] = {
    **_ATTN,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "layer_types": ["conv", "sliding_attention", "full_attention"],
    "head_dim": 16,
    "sliding_window": 64,  # longer than every audit row: see README limits (sliding window x right padding)
    "conv_L_cache": 4,
}
_KDA_TEXT: dict[str, Any] = {
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "linear_head_dim": 16,
    "linear_num_heads": 4,
    "linear_conv_kernel_dim": 4,
}
_INKLING_TEXT: dict[str, Any] = {
    **_ATTN,
    "num_hidden_layers": 2,
    "head_dim": 16,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 16,
    "sliding_window_size": 64,  # longer than every audit row (see README limits)
    "rel_extent": 64,
    "d_rel": 4,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "layer_types": ["hybrid_sliding", "hybrid"],
    "n_layers_per_attn_res_block": 1,
}
# Qwen4-Exp: Gated DeltaNet + QSA-indexed attention + PLE on both linear layers (n-grams of 2-3 tokens, dilated conv
# of width 4 over 2 hyper-connection streams); an indexer budget of 8 tokens in blocks of 4 so that it selects.
_QWEN4_EXP_TEXT: dict[str, Any] = {
    **_ATTN,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "layer_types": ["linear_attention", "indexed_attention", "linear_attention"],
    "head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "hc_count": 2,
    "hc_lowrank": 16,
    "ple_layer_ids": [1, 3],
    "ple_embed_dim": 32,
    "ple_conv_kernel_size": 4,
    "ngram_size": 3,
    "heads_per_ngram": 2,
    "ngram_vocab_size_base": 1000,
    "make_ngram_vocab_size_divisible_by": 8,
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 8,
    "indexer_compress_ratio": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
}
_TINY.update(
    {
        "zaya": {
            **_ATTN,
            "num_hidden_layers": 2,
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 1,
            "moe_intermediate_size": 32,
            "router_hidden_size": 16,
            "cca_time0": 3,  # conv state 3 = (3 - 1) + (2 - 1) inputs
            "cca_time1": 2,
        },
        "recurrent_gemma": {
            "num_hidden_layers": 3,
            "block_types": ["recurrent", "attention", "recurrent"],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "lru_width": 64,
            "conv1d_width": 4,
            "attention_window_size": 64,  # longer than every audit row (see README limits)
            "logits_soft_cap": 30.0,
        },
        "qwen4_exp_text": dict(_QWEN4_EXP_TEXT),
        "qwen4_exp": {
            "text_config": {**_COMMON, "model_type": "qwen4_exp_text", **_QWEN4_EXP_TEXT},
            "vision_config": {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
                              "out_hidden_size": 64},
            "image_token_id": 250,
            "video_token_id": 251,
            "vision_start_token_id": 252,
            "vision_end_token_id": 253,
        },
        "inkling_text": dict(_INKLING_TEXT),
        "inkling2_text": {**_INKLING_TEXT, "unpadded_vocab_size": 256},
        "inkling2_loop_text": {**_INKLING_TEXT, "unpadded_vocab_size": 256},
        "zamba": {
            "num_hidden_layers": 4,
            "layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid"],
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "intermediate_size": 128,
            "attention_hidden_size": 128,
            "attention_head_dim": 32,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "n_mamba_heads": 2,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_dt_rank": 8,
        },
        "lfm3": dict(_LFM3_TEXT),
        "lara_mini": {
            **_QWEN_GDN,
            **_QWEN_MOE,
            "num_hidden_layers": 3,
            "layer_types": ["linear_attention", "sliding_attention", "full_attention"],
            "sliding_window": 64,
        },
        "bailing_hybrid": {
            **_KDA_TEXT,
            "layer_types": ["linear_attention", "full_attention"],
            "mlp_layer_types": ["dense", "sparse"],
            "num_experts": 4,
            "num_experts_per_token": 2,
            "num_shared_experts": 1,
            "num_expert_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 16,
            "q_lora_rank": None,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "head_dim": 16,
            "num_nextn_predict_layers": 0,
        },
        "minimax": {
            "num_hidden_layers": 2,
            "layer_types": ["linear_attention", "full_attention"],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "intermediate_size": 64,
            "num_local_experts": 2,
            "num_experts_per_tok": 1,
            "block_size": 16,
        },
        "glm5_next": {
            "text_config": {
                **_COMMON,
                **_KDA_TEXT,
                "num_hidden_layers": 3,
                "layer_types": ["linear_attention", "full_attention", "linear_attention"],
                "mlp_layer_types": ["dense", "sparse", "dense"],
                "indexer_types": ["full", "full", "full"],
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "n_shared_experts": 1,
                "kv_lora_rank": 16,
                "q_lora_rank": 32,
                "qk_rope_head_dim": 0,  # its indexed (DSA) attention layers are NoPE
                "qk_nope_head_dim": 16,
                "v_head_dim": 16,
                "index_head_dim": 16,
                "index_n_heads": 16,  # a pool scores exactly 0 (relu of every head) almost never: no ties
                # pools of 4 keys, 2 selected per query (+ its tail): the top-k selection matters on audit rows
                "index_topk": 8,
                "index_kpool": 4,
                "hc_mult": 2,
            },
            "vision_config": {
                "depth": 1,
                "hidden_size": 32,
                "num_heads": 2,
                "intermediate_size": 64,
                "out_hidden_size": 64,
                "projection_intermediate_size": 64,
            },
            "image_token_id": 250,
            "video_token_id": 251,
            "image_start_token_id": 252,
            "image_end_token_id": 253,
            "video_start_token_id": 254,
            "video_end_token_id": 255,
        },
        "lfm2_vl": {
            "text_config": {**_COMMON, "model_type": "lfm2", **_TINY["lfm2"]},
            "vision_config": {
                "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2
            },
            "image_token_id": 250,
            "projector_hidden_size": 64,
        },
        "lfm3_vl": {
            "text_config": {**_COMMON, "model_type": "lfm3", **_LFM3_TEXT},
            "vision_config": {
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "layer_types": ["conv", "full_attention"],
            },
            "image_token_id": 250,
            "video_token_id": 251,
            "vision_start_token_id": 252,
            "vision_end_token_id": 253,
            "projector_hidden_size": 64,
        },
        "nemotron_h_omni": {
            "text_config": {**_COMMON, "model_type": "nemotron_h", **_TINY["nemotron_h"]},
            "vision_config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                              "video_temporal_patch_size": 2},
            "vision_hidden_size": 32,
            "projector_hidden_size": 64,
            "image_token_id": 250,
        },
    }
)


@torch.no_grad()
def _strengthen_inkling(model: nn.Module, seed: int, std: float = 0.5) -> None:
    """Inkling2's dynamic short convolutions own no ``Conv1d`` (:func:`find_mixers` misses them): draw their static
    taps and tap projection from N(0, std²). Inkling's tiny logits are ~1e-2 at init (a 1e-4 tolerance would then
    tell nothing): its output head is drawn from N(0, 0.3²) too."""
    if not str(getattr(model.config, "model_type", "")).startswith("inkling"):
        return
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    for module in model.modules():
        if type(module).__name__.endswith("DynamicShortConvolution"):
            for p in (module.static_weight, module.weight_proj.weight):
                p.copy_((torch.randn(p.shape, generator=gen) * std).to(p))
    head = model.get_output_embeddings()
    if head is not None:
        head.weight.copy_((torch.randn(head.weight.shape, generator=gen) * 0.3).to(head.weight))


def family_available(family: str) -> tuple[bool, str]:
    """(whether the installed transformers has ``family``, the reason when it does not)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if family in CONFIG_MAPPING:
        return True, ""
    import transformers

    need = FAMILY_MIN_TRANSFORMERS.get(family, "a later release")
    return False, f"{family} needs transformers >= {need} (installed: {transformers.__version__})"


#: transformers model types (``safepad.supported_model_types()``) whose tiny model is their text model: the
#: Qwen3.5 checkpoints are VLMs around a ``qwen3_5_text`` / ``qwen3_5_moe_text`` language model. Either name
#: builds the same tiny model, so every supported model type is a valid ``safepad audit --family``. The reverse
#: for GLM-5 Next: ``glm5_next_text`` has no generative head in transformers; the tiny ``glm5_next`` VLM holds it.
MODEL_TYPE_FAMILIES: dict[str, str] = {
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    "glm5_next_text": "glm5_next",
}


def family_names() -> tuple[str, ...]:
    """Every supported name :func:`tiny_model` accepts: the family tuples and the model-type aliases."""
    return FAMILIES + EXTRA_FAMILIES + NEW_FAMILIES + tuple(k for k in MODEL_TYPE_FAMILIES if k not in _TINY)


def _check_family(family: str) -> str:
    """The tiny family ``family`` names (an alias of :data:`MODEL_TYPE_FAMILIES` resolved); raises if unknown."""
    family = MODEL_TYPE_FAMILIES.get(family, family)
    if family not in _TINY:
        known = ", ".join(family_names() + UNSUPPORTED_TINY_FAMILIES)
        raise ValueError(f"family: unknown family {family!r}; choose one of {known}")
    ok, why = family_available(family)
    if not ok:
        raise ValueError(f"family: {why}")
    return family


def tiny_config(family: str, **overrides: Any):
    """Return the transformers config of the tiny ``family`` model; ``overrides`` replace any field.

    Args:
        family: one of :data:`FAMILIES` or :data:`EXTRA_FAMILIES` (the transformers ``model_type``), or a
            model type of :data:`MODEL_TYPE_FAMILIES`.
        **overrides: config fields to set, e.g. ``chunk_size=8`` or ``use_cache=False``.
    """
    from transformers import AutoConfig

    family = _check_family(family)
    kwargs = {**_COMMON, **copy.deepcopy(_TINY[family]), **overrides}
    return AutoConfig.for_model(family, **kwargs)


def find_mixers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Return ``(name, module)`` of every sequence mixer (SSM / linear attention / short conv) in ``model``.

    A sequence mixer is recognised structurally, so this works on real checkpoints too: it is the module that
    directly owns a depthwise ``nn.Conv1d`` (``conv1d`` in Mamba/Mamba2/GDN mixers, ``conv`` in lfm2).
    """
    out = []
    for name, module in model.named_modules():
        if any(isinstance(child, nn.Conv1d) and child.groups > 1 for child in module.children()):
            out.append((name, module))
    return out


@torch.no_grad()
def strengthen_mixers(model: nn.Module, proj_std: float = 0.3, conv_std: float = 0.5, seed: int = 0) -> nn.Module:
    """Re-initialise every sequence mixer's projections and convolution so its output dominates the residual.

    Every ``nn.Linear`` weight inside a mixer (``in_proj``/``out_proj``, ``x_proj``, ``q/k/v/o_proj``, the
    gate projections, ...) is drawn from N(0, proj_std²), except ``dt_proj`` whose special init keeps dt in
    range; every depthwise ``nn.Conv1d`` weight from N(0, conv_std²). Biases and norms are left alone.
    Deterministic for a given ``seed``; returns ``model`` (modified in place).
    """
    if proj_std <= 0 or conv_std <= 0:
        raise ValueError(f"proj_std and conv_std must be > 0, got proj_std={proj_std}, conv_std={conv_std}")
    mixers = find_mixers(model)
    if not mixers:
        raise ValueError("model: no sequence mixer (module owning a depthwise nn.Conv1d) found to strengthen")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for _, mixer in mixers:
        for sub_name, sub in mixer.named_modules():
            if isinstance(sub, nn.Linear) and "dt_proj" not in sub_name:
                w = torch.randn(sub.weight.shape, generator=gen) * proj_std
                sub.weight.copy_(w.to(sub.weight))
            elif isinstance(sub, nn.Conv1d):
                w = torch.randn(sub.weight.shape, generator=gen) * conv_std
                sub.weight.copy_(w.to(sub.weight))
    return model


def tiny_model(
    family: str,
    seed: int = 0,
    strengthen: bool = True,
    dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
):
    """Build the tiny ``family`` model in memory: ``AutoModelForCausalLM.from_config`` in eval mode.

    Args:
        family: one of :data:`FAMILIES` or :data:`EXTRA_FAMILIES`.
        seed: seeds both the random init and :func:`strengthen_mixers`.
        strengthen: re-initialise the mixers so padding/packing errors are visible (see module docstring).
        dtype: parameter dtype.
        **config_overrides: forwarded to :func:`tiny_config`.
    """
    import transformers

    family = MODEL_TYPE_FAMILIES.get(family, family)
    config = tiny_config(family, **config_overrides)
    auto = getattr(transformers, _AUTO_CLASS.get(family, "AutoModelForCausalLM"))
    devnull = logging.getLogger("transformers")
    level = devnull.level
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        devnull.setLevel(logging.ERROR)  # "use_mamba_kernels is deprecated" etc. on every tiny build
        try:
            model = auto.from_config(config)
        finally:
            devnull.setLevel(level)
    if strengthen and family not in UNSUPPORTED_TINY_FAMILIES:  # (minimax has no conv to find its mixers by)
        strengthen_mixers(model, seed=seed)
        _strengthen_inkling(model, seed)
    return _cast(model, dtype).eval()


def _cast(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model.to(dtype)``, keeping in float32 what transformers keeps there when it builds or loads a model in
    ``dtype``: ``_keep_in_fp32_modules_strict`` for float16 / bfloat16, and ``_keep_in_fp32_modules`` for
    float16. (A plain ``.to(torch.bfloat16)`` breaks such models in stock transformers too: Inkling2's fp32
    MoE router then multiplies a float32 input by a bfloat16 weight.)"""
    keep = set()
    if dtype in (torch.float16, torch.bfloat16):
        keep |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        keep |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    if not keep:
        return model.to(dtype)
    pattern = re.compile("|".join(rf"(^|\.){re.escape(k)}(\.|$)" for k in sorted(keep)))
    held = [
        (module, kind, name, tensor)
        for prefix, module in model.named_modules()
        for kind in ("_parameters", "_buffers")
        for name, tensor in getattr(module, kind).items()
        if tensor is not None and tensor.is_floating_point() and pattern.search(f"{prefix}.{name}".lstrip("."))
    ]
    saved = [t.detach().float().clone() for *_, t in held]
    model.to(dtype)
    for (module, kind, name, _), data in zip(held, saved):
        getattr(module, kind)[name].data = data
    return model

"""Spec for RecurrentGemma (Griffin): its recurrent blocks (conv + RG-LRU, states kept on the modules by the stock
code) are served by :func:`safepad.mixers.rg_lru.rg_lru_block_forward`, which keeps them in the cache."""

from __future__ import annotations

from types import MappingProxyType

from ..mixers.rg_lru import rg_lru_block_forward
from .registry import MixerSpec, register

__all__ = ["RECURRENT_GEMMA_FAMILY"]

RECURRENT_GEMMA_FAMILY = (
    register(
        MixerSpec(
            model_type="recurrent_gemma",
            kind="rg_lru",
            mixer_classes=("RecurrentGemmaRecurrentBlock",),
            inner_classes=("RecurrentGemmaRglru",),  # its recurrence runs in the block's generic forward
            forward=rg_lru_block_forward,
            options=MappingProxyType(
                {
                    "accelerate_children": ("conv_1d", "rg_lru"),  # their weights are read directly
                    "layer_idx_from_name": True,  # the stock block does not keep its layer index
                    # where the stock block keeps its states (read by safepad.testing for the stock reference)
                    "module_states": MappingProxyType({"conv": "conv1d_state", "recurrent": "rg_lru.recurrent_states"}),
                    "c": 8.0,
                }
            ),
            hybrid=True,
            description="Griffin recurrent block: depthwise conv + RG-LRU, states per row in the cache",
        )
    ),
)

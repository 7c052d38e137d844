"""Trainer integrations for safepad (re-exported by ``safepad``)."""

from __future__ import annotations

from .callback import KIND_DROPPED_BOUNDARIES, KIND_TOKENIZER, PaddingGuardCallback
from .grpo import GRPO_METHOD, GRPO_METHOD_PARAMS, PackedGRPOMixin
from .rollout_gap import ROLLOUT_GAP_KEYS, RolloutGapCallback
from .shadow import KIND_SHADOW_MISMATCH, SHADOW_TOLERANCES, ShadowCheckCallback, ShadowResult

__all__ = [
    "GRPO_METHOD",
    "GRPO_METHOD_PARAMS",
    "KIND_DROPPED_BOUNDARIES",
    "KIND_SHADOW_MISMATCH",
    "KIND_TOKENIZER",
    "ROLLOUT_GAP_KEYS",
    "SHADOW_TOLERANCES",
    "PackedGRPOMixin",
    "PaddingGuardCallback",
    "RolloutGapCallback",
    "ShadowCheckCallback",
    "ShadowResult",
]

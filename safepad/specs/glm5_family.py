"""Spec for GLM-5 Next (``glm5_next_text``, inside the ``glm5_next`` VLM): Kimi-style KDA layers and k-pool DSA
indexed attention.

The KDA layers (``Glm5NextTextLinearAttention``) are kimi_linear's mixer (separate q/k/v, per-key-channel decay
from the ``forget_gate`` module, optionally bounded, low-rank output gate): the generic gated-delta forward with the
KDA options. The indexed attention layers attend to exactly the key slots their indexer selects, so causality,
padding and packed boundaries all live in the selection: the indexer (``Glm5NextTextIndexer``) is served by
:func:`safepad.mixers.dsa_indexer.dsa_indexer_forward`, which pools and counts real keys per sequence.
"""

from __future__ import annotations

from types import MappingProxyType

from ..mixers.dsa_indexer import dsa_indexer_forward
from ..mixers.gated_delta import gated_delta_mixer_forward
from .gdn_family import KDA_OPTIONS
from .registry import MixerSpec, register

__all__ = ["GLM5_FAMILY"]

_INDEXER = "Glm5NextTextIndexer"


GLM5_FAMILY = (
    register(
        MixerSpec(
            model_type="glm5_next_text",
            kind="gated_delta+dsa_indexer",
            mixer_classes=("Glm5NextTextLinearAttention", _INDEXER),
            forward=gated_delta_mixer_forward,
            forward_by_class=MappingProxyType({_INDEXER: dsa_indexer_forward}),
            options=MappingProxyType({**KDA_OPTIONS, "accelerate_children_by_class": {_INDEXER: ()}}),
            hybrid=True,
            description="Kimi Delta Attention layers; k-pool DSA indexer pooling real keys per sequence",
        )
    ),
)

"""Spec for ZAYA: its compressed convolutional attention (CCA) projection keeps a q/k conv state and a one-token
delayed value state, served by :func:`safepad.mixers.cca.cca_projection_forward`."""

from __future__ import annotations

from types import MappingProxyType

from ..mixers.cca import cca_projection_forward
from .registry import MixerSpec, register

__all__ = ["ZAYA_FAMILY"]

ZAYA_FAMILY = (
    register(
        MixerSpec(
            model_type="zaya",
            kind="cca",
            mixer_classes=("ZayaCCAProjection",),
            forward=cca_projection_forward,
            options=MappingProxyType({"accelerate_children": ()}),
            hybrid=True,
            description="q/k through a depthwise then a grouped conv over each token's window; delayed value half",
        )
    ),
)

"""Specs for the Mamba1 family: Mamba, FalconMamba, Jamba and Zamba (multi-head), one generic mixer.

Options read by :func:`safepad.mixers.mamba1.mamba1_mixer_forward`: ``dt_norm`` / ``b_norm`` / ``c_norm``
name the mixer's norm submodules applied to ``dt_low`` (before ``dt_proj``), ``B`` and ``C`` right after
``x_proj`` (absent: no norm).
"""

from __future__ import annotations

from types import MappingProxyType

from ..mixers.mamba1 import mamba1_mixer_forward
from .registry import MixerSpec, register

__all__ = ["MAMBA1_FAMILY"]

_BCDT_NORMS = {"dt_norm": "dt_layernorm", "b_norm": "b_layernorm", "c_norm": "c_layernorm"}


def _spec(model_type: str, cls: str, *, hybrid: bool, options: dict | None = None, **kw) -> MixerSpec:
    return MixerSpec(
        model_type=model_type,
        kind="mamba1",
        mixer_classes=(cls,),
        forward=mamba1_mixer_forward,
        # the stock forwards force accelerate's offload hooks on both submodules they read weights from directly
        options=MappingProxyType({"accelerate_children": ("conv1d", "dt_proj"), **(options or {})}),
        hybrid=hybrid,
        **kw,
    )


MAMBA1_FAMILY = tuple(
    register(s)
    for s in (
        _spec("mamba", "MambaMixer", hybrid=False),
        _spec(
            "falcon_mamba",
            "FalconMambaMixer",
            hybrid=False,
            options=_BCDT_NORMS,
            description="weightless RMS norms on dt_low, B and C",
        ),
        _spec(
            "jamba",
            "JambaMambaMixer",
            hybrid=True,
            options={**_BCDT_NORMS, "router_loss_mask": True},  # JambaForCausalLM: aux loss reads attention_mask
            description="RMS norms (with weights) on dt_low, B and C; attention layers see packed position_ids",
        ),
        _spec(
            "zamba",
            "ZambaMambaMixer",
            hybrid=True,
            options={"heads": True, "accelerate_children": ("conv1d",)},
            description="multi-head Mamba1: interleaved x / z, per-head x_proj / dt_proj / A / D, shared attention",
        ),
    )
)

"""Specs for the Mamba2 family: six models, one generic mixer."""

from __future__ import annotations

from types import MappingProxyType

from ..mixers.mamba2 import mamba2_mixer_forward
from .registry import MixerSpec, register

__all__ = ["MAMBA2_FAMILY"]


def _spec(model_type: str, cls: str, *, hybrid: bool, options: dict | None = None, **kw) -> MixerSpec:
    return MixerSpec(
        model_type=model_type,
        kind="mamba2",
        mixer_classes=(cls,),
        forward=mamba2_mixer_forward,
        options=MappingProxyType(options or {}),
        hybrid=hybrid,
        **kw,
    )


MAMBA2_FAMILY = tuple(
    register(s)
    for s in (
        _spec(
            "nemotron_h",
            "NemotronHMamba2Mixer",
            hybrid=True,
            options={"gated_norm": "NemotronHRMSNormGated"},
            description="dt limit hard-coded to (time_step_min, inf)",
        ),
        _spec(
            "mamba2", "Mamba2Mixer", hybrid=False,
            options={"gated_norm": ("MambaRMSNormGated", "Mamba2RMSNormGated")},  # renamed in transformers 5.25
        ),
        _spec("bamba", "BambaMixer", hybrid=True, options={"gated_norm": "BambaRMSNormGated"}),
        _spec(
            "falcon_h1",
            "FalconH1Mixer",
            hybrid=True,
            options={"in_multiplier": "ssm_in_multiplier", "proj_multiplier": "mup_vector", "optional_norm_attr": "mamba_rms_norm"},
            description="muP multipliers on the input and the projection; optional gated norm",
        ),
        _spec(
            "granitemoehybrid",
            "GraniteMoeHybridMambaLayer",
            hybrid=True,
            options={"gated_norm": "GraniteMoeHybridRMSNormGated", "router_loss_mask": True},
            packed_attention_mask=("full_attention",),
            description="its mask construction ignores position_ids: safepad builds the packed attention mask",
        ),
        _spec(
            "zamba2",
            "Zamba2MambaMixer",
            hybrid=True,
            options={"gated_norm": "Zamba2RMSNormGated"},
            description="dt limit hard-coded to (time_step_min, inf)",
        ),
    )
)
